/* raykv.native._holders: the prefix index's table, with no Python object per block or holder.
 *
 * One shard of the global index maps each cached block (by its key's first 16 bytes) to the set
 * of workers holding it and on which tier. Layout:
 *
 *   slots  a dense open-addressing table of 20-byte slots (16 key bytes + a 32-bit set id), linear
 *          probing, at most 7/8 full. It grows 2x incrementally: a new table is allocated and
 *          every later write moves MIGRATE_STEP slots of the old one, so no call ever rehashes the
 *          whole table at once; lookups read both tables while a move is under way.
 *   sets   interned holder sets: a sorted array of 16-bit codes (lane << 2 | tier), reference
 *          counted by slots, found by content through a small intern table. A chain stored by the
 *          same workers shares one set, so memory per membership is ~20 B / load factor at one
 *          holder and falls as holders grow.
 *   memo   a direct-mapped cache of set transitions (set, op, code) -> set, checked by per-id
 *          generations, so a batch of stores of one chain interns its new set once.
 *
 * A worker's removal or clear edits the sets that hold its lane in place (O(sets), not O(keys));
 * slots whose set became empty read as absent and are dropped at the next move.
 *
 * Contract (raykv.index.holders.PyHolders is the pure-Python twin; tests run both op for op):
 *   Holders(capacity=0)         an empty table, pre-sized for `capacity` keys when > 0.
 *   validate(data) -> bool      whether `data` is whole records of well-formed ops (see RECORD).
 *   apply(lane, data) -> (added, removed)
 *                               applies a packed batch of one lane's ops in order; raises
 *                               ValueError (and changes nothing) when validate(data) is False.
 *   drop_lane(lane) -> int      removes the lane from every key; returns the keys it held.
 *   entries(keys) -> list       per key, the index's (all, gpu, host, disk) tuple of lane-spread
 *                               masks (bit 16 * lane), or None where nobody holds it.
 *   route(keys, names, match_type) -> dict
 *                               raykv.index.route.route_held's answer, same matches, same order.
 *   route_rows(keys) -> bytes   the same answer as rows of five little-endian uint16 (lane,
 *                               blocks, gpu, host, disk), in that order.
 *   lane_blocks(lane) -> dict   {16-byte key prefix: tier} of every key the lane holds.
 *   split(data, num_shards) -> list[bytes]  (module function) each shard's records, clears to all.
 *   len(t), memory() -> bytes in use, stats() -> dict, maintain(slots) -> bool (moves up to
 *   `slots` slots of a table being grown; True while one is).
 * `keys` is a sequence of bytes objects or one bytes object of 32-byte keys; anything that is not
 * a 32-byte key reads as absent. Not thread-safe beyond the GIL.
 */#include "holders.h"

/* ---- slot memory ------------------------------------------------------------------------- */
/* Tables are their own mappings, rounded to 2 MiB. No MADV_HUGEPAGE: where the kernel defragments
 * on fault for it, the first touch of a huge page can stall a write for tens of milliseconds, and
 * measured routes gained ~5% from it (docs/benchmarks.md, "Index at scale"). */
#define HUGE_PAGE ((size_t)2 << 20)

static size_t table_bytes(uint64_t cap) {
    size_t bytes = (size_t)cap * sizeof(Slot);
    return (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
}

static int table_alloc(Table *t, uint64_t cap) {
    size_t len = table_bytes(cap);
    void *at = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = (Slot *)at;
    t->cap = cap;
    t->bits = __builtin_ctzll(cap);
    t->filled = 0;
    return 0;
}

/* Unmap up to `bytes` of the retired table (munmap of a large table at once stalls for ms). */
static void retire_some(Holders *h, size_t bytes) {
    size_t n = h->retired_len < bytes ? h->retired_len : bytes;
    if (!n) return;
    munmap(h->retired + h->retired_len - n, n);
    h->retired_len -= n;
    if (!h->retired_len) h->retired = NULL;
}

static void table_free(Table *t) {
    if (t->slots) munmap(t->slots, table_bytes(t->cap));
    t->slots = NULL;
    t->cap = 0;
    t->filled = 0;
}

/* ---- sets ---------------------------------------------------------------------------------- */
static uint32_t codes_hash(const uint16_t *codes, int n) {
    uint64_t x = 1469598103934665603ULL;
    for (int k = 0; k < n; k++) x = (x ^ codes[k]) * 1099511628211ULL;
    return (uint32_t)(x ^ (x >> 32));
}

static int itab_grow(Holders *h) {
    uint32_t cap = h->itab_cap ? h->itab_cap * 2 : 256;
    while (cap < 4 * (h->nsets + 1)) cap *= 2;
    uint32_t *t = PyMem_Calloc(cap, sizeof(uint32_t));
    if (!t) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t filled = 0;
    for (uint32_t i = 0; i < h->itab_cap; i++) {
        uint32_t id = h->itab[i];
        if (id < FIRST_SET) continue;
        uint32_t j = h->sets[id]->hash & (cap - 1);
        while (t[j]) j = (j + 1) & (cap - 1);
        t[j] = id;
        filled++;
    }
    PyMem_Free(h->itab);
    h->itab = t;
    h->itab_cap = cap;
    h->itab_filled = filled;
    return 0;
}

static uint32_t itab_find(const Holders *h, const uint16_t *codes, int n, uint32_t hash) {
    if (!h->itab_cap) return 0;
    uint32_t mask = h->itab_cap - 1, j = hash & mask;
    for (uint32_t id; (id = h->itab[j]) != EMPTY; j = (j + 1) & mask) {
        if (id == TOMB) continue;
        const Set *s = h->sets[id];
        if (s->hash == hash && s->n == n && memcmp(s->codes, codes, (size_t)n * 2) == 0) return id;
    }
    return 0;
}

static void itab_remove(Holders *h, uint32_t id) {
    uint32_t mask = h->itab_cap - 1, j = h->sets[id]->hash & mask;
    for (; h->itab[j] != EMPTY; j = (j + 1) & mask)
        if (h->itab[j] == id) {
            h->itab[j] = TOMB;
            h->sets[id]->interned = 0;
            return;
        }
}

static int itab_add(Holders *h, uint32_t id) {
    if (2 * (h->itab_filled + 1) > h->itab_cap && itab_grow(h) < 0) return -1;
    uint32_t mask = h->itab_cap - 1, j = h->sets[id]->hash & mask;
    while (h->itab[j] >= FIRST_SET) j = (j + 1) & mask;
    if (h->itab[j] == EMPTY) h->itab_filled++;
    h->itab[j] = id;
    h->sets[id]->interned = 1;
    return 0;
}

static int ids_reserve(Holders *h) {
    if (h->nfree || h->nsets < h->sets_cap) return 0;
    uint32_t cap = h->sets_cap ? h->sets_cap * 2 : 256;
    Set **sets = PyMem_Realloc(h->sets, cap * sizeof(Set *));
    if (sets) h->sets = sets;
    uint32_t *gens = sets ? PyMem_Realloc(h->gens, cap * sizeof(uint32_t)) : NULL;
    if (gens) h->gens = gens;
    PyObject **cache = gens ? PyMem_Realloc(h->entry_cache, cap * sizeof(PyObject *)) : NULL;
    if (!cache) {
        PyErr_NoMemory();
        return -1;
    }
    h->entry_cache = cache;
    for (uint32_t i = h->sets_cap; i < cap; i++) {
        h->sets[i] = NULL;
        h->gens[i] = 0;
        h->entry_cache[i] = NULL;
    }
    h->sets_cap = cap;
    return 0;
}

/* The interned set of these codes (a new one when none is), or 0 with an exception set. */
static uint32_t intern_codes(Holders *h, const uint16_t *codes, int n) {
    uint32_t hash = codes_hash(codes, n), id = itab_find(h, codes, n, hash);
    if (id) return id;
    if (ids_reserve(h) < 0) return 0;
    size_t bytes = sizeof(Set) + (size_t)n * 2;
    Set *s = PyMem_Malloc(bytes);
    if (!s) {
        PyErr_NoMemory();
        return 0;
    }
    s->refs = 0;
    s->hash = hash;
    s->n = (uint16_t)n;
    s->interned = 0;
    memcpy(s->codes, codes, (size_t)n * 2);
    id = h->nfree ? h->free_ids[--h->nfree] : h->nsets++;
    h->sets[id] = s;
    h->set_bytes += bytes;
    if (itab_add(h, id) < 0) {
        h->sets[id] = NULL;
        h->set_bytes -= bytes;
        PyMem_Free(s);
        return 0;
    }
    return id;
}

static void forget_entry(Holders *h, uint32_t id) {
    h->gens[id]++;
    Py_CLEAR(h->entry_cache[id]);
}

static void release(Holders *h, uint32_t id) {
    Set *s = h->sets[id];
    if (--s->refs) return;
    if (s->interned) itab_remove(h, id);
    h->set_bytes -= sizeof(Set) + (size_t)s->n * 2;
    PyMem_Free(s);
    h->sets[id] = NULL;
    forget_entry(h, id);
    if (h->nfree == h->free_cap) {
        uint32_t cap = h->free_cap ? 2 * h->free_cap : 64;
        uint32_t *ids = PyMem_Realloc(h->free_ids, cap * sizeof(uint32_t));
        if (!ids) return; /* the id is not reused: a leak of one id, never a wrong answer */
        h->free_ids = ids;
        h->free_cap = cap;
    }
    h->free_ids[h->nfree++] = id;
}

/* The lane's code in set s, or -1. */
HIDDEN int hl_code_of(const Set *s, int lane) {
    int lo = 0, hi = s->n;
    while (lo < hi) {
        int mid = (lo + hi) / 2, l = s->codes[mid] >> 2;
        if (l == lane) return s->codes[mid];
        if (l < lane) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

/* The set `src` (0: none) after the op: store `code`, or remove lane (code >> 2). 0 when the
 * result is empty; (uint32_t)-1 with an exception set on failure. */
static uint32_t transition(Holders *h, uint32_t src, int op, int code) {
    uint32_t what = 1u << 31 | (uint32_t)op << 16 | (uint32_t)code; /* bit 31: a used entry */
    Memo *m = &h->memo[(src * 2654435761u ^ what * 40503u) & (MEMO - 1)];
    if (m->src == src && m->what == what && m->src_gen == h->gens[src] &&
        (!m->dst || m->dst_gen == h->gens[m->dst]))
        return m->dst;
    uint16_t codes[MAX_LANES];
    int n = 0, lane = code >> 2, placed = op != OP_STORE;
    const Set *s = src ? h->sets[src] : NULL;
    for (int k = 0; s && k < s->n; k++) {
        int c = s->codes[k];
        if ((c >> 2) == lane) continue;
        if (!placed && (c >> 2) > lane) codes[n++] = (uint16_t)code, placed = 1;
        codes[n++] = (uint16_t)c;
    }
    if (!placed) codes[n++] = (uint16_t)code;
    uint32_t dst = n ? intern_codes(h, codes, n) : 0;
    if (n && !dst) return (uint32_t)-1;
    *m = (Memo){src, h->gens[src], dst, dst ? h->gens[dst] : 0, what};
    return dst;
}

/* ---- table edits --------------------------------------------------------------------------- */
static int start_move(Holders *h);

/* Move up to `budget` slots of the old table into the new one. */
static void move_some(Holders *h, uint64_t budget) {
    Table *o = &h->old;
    uint64_t end = h->move_at + budget < o->cap ? h->move_at + budget : o->cap;
    for (uint64_t i = h->move_at; i < end; i++) {
        if ((i & 15) == 0) /* request the new homes of the next 16 slots before placing them */
            for (uint64_t k = i; k < i + 16 && k < end; k++)
                if (o->slots[k].set >= FIRST_SET) __builtin_prefetch(&h->cur.slots[home(&h->cur, o->slots[k].a)], 1);
        Slot *s = &o->slots[i];
        if (s->set < FIRST_SET) continue;
        if (h->sets[s->set]->n == 0) {
            release(h, s->set);
        } else {
            uint64_t mask = h->cur.cap - 1, j = home(&h->cur, s->a);
            while (h->cur.slots[j].set != EMPTY) j = (j + 1) & mask;
            h->cur.slots[j] = *s;
            h->cur.filled++;
        }
        s->set = TOMB;
    }
    h->move_at = end;
    if (end == o->cap) {
        retire_some(h, h->retired_len); /* a table retired earlier (rare: it is tiny by now) */
        h->retired = (char *)o->slots;
        h->retired_len = table_bytes(o->cap);
        o->slots = NULL;
        o->cap = 0;
        o->filled = 0;
        h->move_at = 0;
    }
}

static int ensure_room(Holders *h) {
    if (h->old.slots) move_some(h, MIGRATE_STEP);
    if (h->retired) retire_some(h, RETIRE_BYTES / 64);
    if (8 * (h->cur.filled + 1) <= 7 * h->cur.cap) return 0;
    if (h->old.slots) move_some(h, h->old.cap); /* a move that could not keep up: finish it */
    return start_move(h);
}

static int start_move(Holders *h) {
    uint64_t cap = MIN_CAP;
    while (16 * (uint64_t)h->live > 7 * cap) cap *= 2; /* live keys <= 7/16 after */
    Table fresh;
    if (table_alloc(&fresh, cap) < 0) return -1;
    h->old = h->cur;
    h->cur = fresh;
    h->move_at = 0;
    h->moves++;
    move_some(h, MIGRATE_STEP);
    return 0;
}

/* Where key (a, b) lives: its slot, in `which` table; NULL when absent. */
HIDDEN Slot *hl_locate(Holders *h, uint64_t a, uint64_t b) {
    int64_t at = probe(&h->cur, a, b);
    if (at >= 0) return &h->cur.slots[at];
    at = probe(&h->old, a, b);
    return at >= 0 ? &h->old.slots[at] : NULL;
}

static int store(Holders *h, uint64_t a, uint64_t b, int code, int64_t *added) {
    Slot *s = hl_locate(h, a, b);
    if (s) {
        uint32_t old = s->set, was_empty = h->sets[old]->n == 0;
        uint32_t dst = transition(h, old, OP_STORE, code);
        if (dst == (uint32_t)-1) return -1;
        if (dst == old) return 0;
        int had = hl_code_of(h->sets[old], code >> 2) >= 0;
        h->sets[dst]->refs++;
        s->set = dst;
        release(h, old);
        if (was_empty) h->live++;
        if (!had) (*added)++;
        return 0;
    }
    if (ensure_room(h) < 0) return -1;
    uint32_t dst = transition(h, 0, OP_STORE, code);
    if (dst == (uint32_t)-1) return -1;
    uint64_t mask = h->cur.cap - 1, j = home(&h->cur, a);
    while (h->cur.slots[j].set >= FIRST_SET) j = (j + 1) & mask;
    Slot *t = &h->cur.slots[j];
    if (t->set == EMPTY) h->cur.filled++;
    t->a = a;
    t->b = b;
    t->set = dst;
    h->sets[dst]->refs++;
    h->live++;
    (*added)++;
    return 0;
}

static int remove_key(Holders *h, uint64_t a, uint64_t b, int lane, int64_t *removed) {
    Slot *s = hl_locate(h, a, b);
    if (!s || hl_code_of(h->sets[s->set], lane) < 0) return 0;
    uint32_t old = s->set, dst = transition(h, old, OP_REMOVE, lane << 2);
    if (dst == (uint32_t)-1) return -1;
    if (dst) h->sets[dst]->refs++;
    else h->live--;
    s->set = dst ? dst : TOMB;
    release(h, old);
    (*removed)++;
    return 0;
}

/* Remove a lane from every set in place; returns the keys it held. */
static int64_t drop_lane(Holders *h, int lane) {
    int64_t dropped = 0;
    for (uint32_t id = FIRST_SET; id < h->nsets; id++) {
        Set *s = h->sets[id];
        if (!s) continue;
        int k = 0;
        while (k < s->n && (s->codes[k] >> 2) != lane) k++;
        if (k == s->n) continue;
        if (s->interned) itab_remove(h, id);
        memmove(&s->codes[k], &s->codes[k + 1], (size_t)(s->n - k - 1) * 2);
        s->n--;
        s->hash = codes_hash(s->codes, s->n);
        forget_entry(h, id);
        dropped += (int64_t)s->refs;
        if (!s->n) {
            h->live -= (int64_t)s->refs;
        } else if (!itab_find(h, s->codes, s->n, s->hash) && itab_add(h, id) < 0) {
            PyErr_Clear(); /* left un-interned: a duplicate set, never a wrong answer */
        }
    }
    return dropped;
}

/* ---- ops ----------------------------------------------------------------------------------- */
static int valid(const unsigned char *d, Py_ssize_t len) {
    if (len % RECORD) return 0;
    for (Py_ssize_t i = 0; i < len; i += RECORD) {
        int op = d[i], tier = d[i + 1];
        if (op > OP_CLEAR || (op == OP_STORE && tier > 2)) return 0;
    }
    return 1;
}

HIDDEN int hl_lane_arg(PyObject *obj) {
    long lane = PyLong_AsLong(obj);
    if (lane == -1 && PyErr_Occurred()) return -1;
    if (lane < 0 || lane >= MAX_LANES) {
        PyErr_Format(PyExc_ValueError, "lane must be in 0..%d, got %ld", MAX_LANES - 1, lane);
        return -1;
    }
    return (int)lane;
}

static PyObject *H_apply(Holders *h, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "apply(lane, data)");
        return NULL;
    }
    int lane = hl_lane_arg(args[0]);
    if (lane < 0 || PyObject_GetBuffer(args[1], &buf, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t len = buf.len;
    if (!valid(d, len)) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "malformed batch: records of 34 bytes, op 0..2, tier 0..2");
        return NULL;
    }
    int64_t added = 0, removed = 0;
    int rc = 0;
    for (Py_ssize_t k = 0; k < len && k < RECORD * PROBE_AHEAD; k += RECORD) {
        uint64_t a;
        memcpy(&a, d + k + 2, 8);
        prefetch_key(h, a);
    }
    for (Py_ssize_t i = 0; i < len && rc == 0; i += RECORD) {
        if (i + RECORD * PROBE_AHEAD < len) { /* warm the slot of the record PROBE_AHEAD ahead */
            uint64_t a;
            memcpy(&a, d + i + RECORD * PROBE_AHEAD + 2, 8);
            prefetch_key(h, a);
        }
        uint64_t a, b;
        split_key(d + i + 2, &a, &b);
        if (d[i] == OP_STORE) rc = store(h, a, b, lane << 2 | d[i + 1], &added);
        else if (d[i] == OP_REMOVE) rc = remove_key(h, a, b, lane, &removed);
        else removed += drop_lane(h, lane);
    }
    PyBuffer_Release(&buf);
    if (rc < 0) return NULL;
    return Py_BuildValue("LL", (long long)added, (long long)removed);
}

static PyObject *H_validate(Holders *h, PyObject *data) {
    Py_buffer buf;
    if (PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE) < 0) return NULL;
    int ok = valid(buf.buf, buf.len);
    PyBuffer_Release(&buf);
    return PyBool_FromLong(ok);
}

static PyObject *H_drop_lane(Holders *h, PyObject *arg) {
    int lane = hl_lane_arg(arg);
    if (lane < 0) return NULL;
    return PyLong_FromLongLong(drop_lane(h, lane));
}

static uint64_t memory(const Holders *h) {
    uint64_t bytes = table_bytes(h->cur.cap) + (h->old.slots ? table_bytes(h->old.cap) : 0) + h->retired_len;
    bytes += h->set_bytes + (uint64_t)h->sets_cap * (sizeof(Set *) + 4 + sizeof(PyObject *));
    return bytes + (uint64_t)h->itab_cap * 4 + (uint64_t)h->free_cap * 4 + MEMO * sizeof(Memo);
}

static PyObject *H_memory(Holders *h, PyObject *Py_UNUSED(x)) { return PyLong_FromUnsignedLongLong(memory(h)); }

static PyObject *H_stats(Holders *h, PyObject *Py_UNUSED(x)) {
    uint32_t live_sets = h->nsets > FIRST_SET ? h->nsets - FIRST_SET - h->nfree : 0;
    return Py_BuildValue("{s:K,s:K,s:K,s:I,s:O,s:K,s:K}", "capacity", (unsigned long long)h->cur.cap, "filled",
                         (unsigned long long)(h->cur.filled + h->old.filled), "bytes",
                         (unsigned long long)memory(h), "sets", live_sets, "moving",
                         h->old.slots || h->retired ? Py_True : Py_False, "moves", (unsigned long long)h->moves,
                         "slot_bytes", (unsigned long long)sizeof(Slot));
}

static PyObject *H_maintain(Holders *h, PyObject *arg) {
    long long budget = PyLong_AsLongLong(arg);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    if (h->old.slots && budget > 0) move_some(h, (uint64_t)budget);
    else if (h->retired && budget > 0) retire_some(h, RETIRE_BYTES);
    return PyBool_FromLong(h->old.slots != NULL || h->retired != NULL);
}

static Py_ssize_t H_len(Holders *h) { return (Py_ssize_t)h->live; }

/* ---- type ------------------------------------------------------------------------------------ */
static PyObject *H_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"capacity", NULL};
    long long capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L", kw, &capacity)) return NULL;
    Holders *h = (Holders *)type->tp_alloc(type, 0);
    if (!h) return NULL;
    uint64_t cap = MIN_CAP;
    while (capacity > 0 && 8 * (uint64_t)capacity > 7 * cap) cap *= 2;
    h->memo = PyMem_Calloc(MEMO, sizeof(Memo));
    if (!h->memo || table_alloc(&h->cur, cap) < 0 || ids_reserve(h) < 0) {
        if (!h->memo) PyErr_NoMemory();
        Py_DECREF(h);
        return NULL;
    }
    h->nsets = FIRST_SET;
    return (PyObject *)h;
}

static void H_dealloc(Holders *h) {
    table_free(&h->cur);
    table_free(&h->old);
    retire_some(h, h->retired_len);
    for (uint32_t id = 0; id < h->sets_cap; id++) {
        PyMem_Free(h->sets[id]);
        Py_XDECREF(h->entry_cache[id]);
    }
    PyMem_Free(h->sets);
    PyMem_Free(h->gens);
    PyMem_Free(h->entry_cache);
    PyMem_Free(h->free_ids);
    PyMem_Free(h->itab);
    PyMem_Free(h->memo);
    PyMem_Free(h->walk);
    hl_free_answers(h->answers);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef H_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))H_apply, METH_FASTCALL, "apply(lane, data) -> (added, removed)"},
    {"validate", (PyCFunction)H_validate, METH_O, "validate(data) -> bool"},
    {"drop_lane", (PyCFunction)H_drop_lane, METH_O, "drop_lane(lane) -> keys it held"},
    {"entries", (PyCFunction)hl_entries, METH_O, "entries(keys) -> [entry or None]"},
    {"route", (PyCFunction)(void (*)(void))hl_route, METH_FASTCALL, "route(keys, names, match_type) -> dict"},
    {"route_rows", (PyCFunction)hl_route_rows, METH_O, "route_rows(keys) -> bytes of uint16 rows"},
    {"lane_blocks", (PyCFunction)hl_lane_blocks, METH_O, "lane_blocks(lane) -> {key prefix: tier}"},
    {"memory", (PyCFunction)H_memory, METH_NOARGS, "memory() -> bytes in use"},
    {"stats", (PyCFunction)H_stats, METH_NOARGS, "stats() -> dict"},
    {"maintain", (PyCFunction)H_maintain, METH_O, "maintain(slots) -> whether a move is under way"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods H_as_mapping = {.mp_length = (lenfunc)H_len};

static PyTypeObject HoldersType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "raykv.native._holders.Holders",
    .tp_basicsize = sizeof(Holders),
    .tp_dealloc = (destructor)H_dealloc,
    .tp_as_mapping = &H_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefix index's table of key prefixes and holder sets (see raykv.index.holders).",
    .tp_methods = H_methods,
    .tp_new = H_new,
};

static PyMethodDef module_methods[] = {
    {"split", (PyCFunction)(void (*)(void))hl_split, METH_FASTCALL, "split(data, num_shards) -> [bytes]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "raykv.native._holders", "Compiled index table (see raykv.index.holders).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__holders(void) {
    if (PyType_Ready(&HoldersType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&HoldersType);
    if (PyModule_AddObject(m, "Holders", (PyObject *)&HoldersType) < 0) {
        Py_DECREF(&HoldersType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

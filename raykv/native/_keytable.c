/* raykv.native._keytable: a hash table from 32-byte block keys to Python objects.
 *
 * The prefix index maps every cached block's key (a SHA-256 digest) to an interned entry. A dict
 * pays, per lookup, SipHash over the key and three dependent cache misses (index slot, entry, the
 * stored key object); at a million keys a 100-key route is ~20 us of misses. This table stores
 * each key's 32 bytes inline next to its value (one 48-byte slot), takes its slot from the key's own first 8 bytes
 * (digests are uniform; a multiply spreads them anyway), and get_many() computes every slot and
 * prefetches it before resolving any, so the misses of one route overlap.
 *
 * Contract (mirrored by raykv.index.keytable.DictKeyTable, the pure-Python fallback):
 *   get(key, default=None), t[key], t[key] = value, del t[key], key in t, len(t), get_many(keys)
 *   (a list of values, None where absent), prefetch(keys) (no result: warms the slots of a batch of
 *   stores), keys() (a list of new bytes objects), clear(), and route(keys, names, match_type):
 *   raykv.index.route.route_held's answer in one call (each lane's cached prefix of the chain
 *   `keys`, its blocks per tier; `names` maps lane -> worker or None, at most 64 lanes; matches
 *   ordered as Python orders them), or None when an entry is not the index's (all, gpu, host,
 *   disk) tuple of lane masks within `names`' lanes (Python then routes). The dict fallback has no
 *   route(); the index then routes in Python.
 *   A key is a bytes object of exactly 32 bytes; get/get_many/in answer "absent" for anything else,
 *   t[key] = v raises TypeError for it, t[key]/del t[key] raise KeyError. Values are strong
 *   references; the table is not tracked by the cycle collector, so a value must not refer back to
 *   its table (the index's values are tuples of ints). Not thread-safe beyond the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define KEY_BYTES 32
#define EMPTY 0
#define TOMB 1
#define MIN_CAP 64
#define BATCH 64

typedef struct {
    uint64_t tag;                   /* EMPTY, TOMB, or the key's tag (>= 2) */
    unsigned char key[KEY_BYTES];   /* the key's bytes */
    PyObject *value;                /* owned while the slot is live */
} Slot;                             /* 48 bytes: a probe reads one slot, not three arrays */

struct RouteMemo;

typedef struct {
    PyObject_HEAD
    struct RouteMemo *memo; /* route answers with many matches (allocated on first use) */
    Slot *slots;
    Py_ssize_t cap;        /* a power of two */
    Py_ssize_t used;       /* live slots */
    Py_ssize_t filled;     /* live + tombstone slots */
} KeyTable;

static inline uint64_t tag_of(const unsigned char *key) {
    uint64_t h;
    memcpy(&h, key, 8);
    h *= 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    return h < 2 ? h + 2 : h;
}

static inline const unsigned char *key_bytes(PyObject *key) {
    if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != KEY_BYTES) return NULL;
    return (const unsigned char *)PyBytes_AS_STRING(key);
}

/* The slot holding key (or -1). */
static Py_ssize_t find(KeyTable *t, const unsigned char *key, uint64_t tag) {
    Py_ssize_t mask = t->cap - 1, i = (Py_ssize_t)(tag & (uint64_t)mask);
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->tag == EMPTY) return -1;
        if (s->tag == tag && memcmp(s->key, key, KEY_BYTES) == 0) return i;
        i = (i + 1) & mask;
    }
}

/* Zeroed slots (all tags EMPTY, values NULL). From HUGE_SLOTS bytes on they get their own mapping,
 * marked for transparent huge pages where the OS offers them: a route's lookups land on random
 * slots, and 2 MiB pages keep them from missing the TLB as well as the caches. */
#define HUGE_PAGE ((size_t)2 << 20)
#define HUGE_SLOTS ((size_t)1 << 20)

static size_t mapped_bytes(Py_ssize_t cap) {
    size_t bytes = (size_t)cap * sizeof(Slot);
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_SLOTS) return (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
#endif
    return 0;
}

static Slot *slots_alloc(Py_ssize_t cap) {
    size_t len = mapped_bytes(cap);
    if (!len) return PyMem_Calloc((size_t)cap, sizeof(Slot));
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    void *at = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (at == MAP_FAILED) return NULL;
    (void)madvise(at, len, MADV_HUGEPAGE); /* a hint: without it, 4 KiB pages */
    return (Slot *)at;
#else
    return NULL;
#endif
}

static void slots_free(Slot *slots, Py_ssize_t cap) {
    size_t len = mapped_bytes(cap);
    if (!len) {
        PyMem_Free(slots);
        return;
    }
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    munmap(slots, len);
#endif
}

static int alloc_arrays(KeyTable *t, Py_ssize_t cap) {
    Slot *slots = slots_alloc(cap);
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = slots;
    t->cap = cap;
    t->used = 0;
    t->filled = 0;
    return 0;
}

/* Rehash the live slots into arrays of new_cap slots (drops the tombstones). */
static int resize(KeyTable *t, Py_ssize_t new_cap) {
    Slot *old = t->slots;
    Py_ssize_t old_cap = t->cap, used = t->used, filled = t->filled;
    if (alloc_arrays(t, new_cap) < 0) {
        t->slots = old;
        t->cap = old_cap;
        t->used = used;
        t->filled = filled;
        return -1;
    }
    Py_ssize_t mask = new_cap - 1;
    for (Py_ssize_t j = 0; j < old_cap; j++) {
        if (old[j].tag < 2) continue;
        Py_ssize_t i = (Py_ssize_t)(old[j].tag & (uint64_t)mask);
        while (t->slots[i].tag != EMPTY) i = (i + 1) & mask;
        t->slots[i] = old[j];
    }
    t->used = used;
    t->filled = used;
    slots_free(old, old_cap);
    return 0;
}

static int set_item(KeyTable *t, const unsigned char *key, PyObject *value) {
    uint64_t tag = tag_of(key);
    Py_ssize_t at = find(t, key, tag);
    if (at >= 0) {
        PyObject *old = t->slots[at].value;
        Py_INCREF(value);
        t->slots[at].value = value;
        Py_DECREF(old);
        return 0;
    }
    if (2 * (t->filled + 1) > t->cap) {
        Py_ssize_t cap = t->cap;
        while (4 * (t->used + 1) > cap) cap *= 2; /* live keys at most a quarter full after */
        if (resize(t, cap) < 0) return -1;
    }
    Py_ssize_t mask = t->cap - 1, i = (Py_ssize_t)(tag & (uint64_t)mask);
    while (t->slots[i].tag >= 2) i = (i + 1) & mask; /* first empty or tombstone slot */
    Slot *s = &t->slots[i];
    if (s->tag == EMPTY) t->filled++;
    s->tag = tag;
    memcpy(s->key, key, KEY_BYTES);
    Py_INCREF(value);
    s->value = value;
    t->used++;
    return 0;
}

static int del_item(KeyTable *t, PyObject *keyobj) {
    const unsigned char *key = key_bytes(keyobj);
    Py_ssize_t at = key ? find(t, key, tag_of(key)) : -1;
    if (at < 0) {
        PyErr_SetObject(PyExc_KeyError, keyobj);
        return -1;
    }
    PyObject *old = t->slots[at].value;
    t->slots[at].value = NULL;
    t->slots[at].tag = TOMB;
    t->used--;
    Py_DECREF(old);
    return 0;
}

static void clear_all(KeyTable *t) {
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        if (t->slots[i].tag >= 2) Py_CLEAR(t->slots[i].value);
        t->slots[i].tag = EMPTY;
    }
    t->used = 0;
    t->filled = 0;
}

/* ---- Python API ---------------------------------------------------------------------------- */
static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((args && PyTuple_GET_SIZE(args)) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyTable() takes no arguments");
        return NULL;
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    if (alloc_arrays(t, MIN_CAP) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void free_memo(struct RouteMemo *memo);

static void KeyTable_dealloc(KeyTable *t) {
    free_memo(t->memo);
    if (t->slots) {
        clear_all(t);
        slots_free(t->slots, t->cap);
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->used; }

static PyObject *KeyTable_getitem(KeyTable *t, PyObject *keyobj) {
    const unsigned char *key = key_bytes(keyobj);
    Py_ssize_t at = key ? find(t, key, tag_of(key)) : -1;
    if (at < 0) {
        PyErr_SetObject(PyExc_KeyError, keyobj);
        return NULL;
    }
    return Py_NewRef(t->slots[at].value);
}

static int KeyTable_ass_sub(KeyTable *t, PyObject *keyobj, PyObject *value) {
    if (value == NULL) return del_item(t, keyobj);
    const unsigned char *key = key_bytes(keyobj);
    if (!key) {
        PyErr_SetString(PyExc_TypeError, "KeyTable keys are bytes of exactly 32 bytes");
        return -1;
    }
    return set_item(t, key, value);
}

static int KeyTable_contains(KeyTable *t, PyObject *keyobj) {
    const unsigned char *key = key_bytes(keyobj);
    return key ? find(t, key, tag_of(key)) >= 0 : 0;
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    const unsigned char *key = key_bytes(args[0]);
    Py_ssize_t at = key ? find(t, key, tag_of(key)) : -1;
    if (at >= 0) return Py_NewRef(t->slots[at].value);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

/* Values of a batch of keys: every slot is computed and prefetched first, so the cache misses of
 * the batch overlap instead of following one another. */
static PyObject *KeyTable_get_many(KeyTable *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "get_many() takes a sequence of keys");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (!out) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t mask = t->cap - 1;
    uint64_t tags[BATCH];
    for (Py_ssize_t lo = 0; lo < n; lo += BATCH) {
        Py_ssize_t hi = lo + BATCH < n ? lo + BATCH : n;
        for (Py_ssize_t k = lo; k < hi; k++) {
            const unsigned char *key = key_bytes(items[k]);
            uint64_t tag = key ? tag_of(key) : 0;
            tags[k - lo] = tag;
            if (tag) {
                const char *slot = (const char *)&t->slots[(Py_ssize_t)(tag & (uint64_t)mask)];
                __builtin_prefetch(slot);
                __builtin_prefetch(slot + sizeof(Slot) - 1); /* a slot may straddle two lines */
            }
        }
        for (Py_ssize_t k = lo; k < hi; k++) {
            uint64_t tag = tags[k - lo];
            Py_ssize_t at = tag ? find(t, (const unsigned char *)PyBytes_AS_STRING(items[k]), tag) : -1;
            PyList_SET_ITEM(out, k, Py_NewRef(at >= 0 ? t->slots[at].value : Py_None));
        }
    }
    Py_DECREF(seq);
    return out;
}

/* Start loading the slots of a batch of keys (a batch of stores that follows then hits cache). */
static PyObject *KeyTable_prefetch(KeyTable *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "prefetch() takes a sequence of keys");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), mask = t->cap - 1;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *key = key_bytes(items[k]);
        if (!key) continue;
        const char *slot = (const char *)&t->slots[(Py_ssize_t)(tag_of(key) & (uint64_t)mask)];
        __builtin_prefetch(slot, 1);
        __builtin_prefetch(slot + sizeof(Slot) - 1, 1);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* ---- route: each lane's cached prefix of a chain of keys (raykv.index.route.route_held) ------- */
#define ROUTE_LANES 64
#define ROUTE_MAX 65535 /* MAX_ROUTE_BLOCKS */
#define ROUTE_SPARSE 8  /* SPARSE_MATCHES */

typedef struct {
    PyObject *obj;    /* the entry (borrowed from the table) */
    uint64_t m[4];    /* its all/gpu/host/disk masks, one bit per lane */
} Masks;

/* Lane bits of a lane-spread mask (bit 16 * lane per lane, lanes < `lanes`): 0, or -1 when the
 * value is no such mask (the caller then answers None and Python routes). */
static int lane_bits(PyObject *v, int lanes, uint64_t *out) {
    unsigned char buf[2 * ROUTE_LANES];
    if (!PyLong_CheckExact(v)) return -1;
    if (_PyLong_AsByteArray((PyLongObject *)v, buf, (size_t)(2 * lanes), 1, 0) < 0) {
        PyErr_Clear(); /* negative or wider than `lanes` lanes */
        return -1;
    }
    uint64_t bits = 0;
    for (int lane = 0; lane < lanes; lane++) {
        if (buf[2 * lane + 1] || (buf[2 * lane] & 0xFE)) return -1;
        bits |= (uint64_t)buf[2 * lane] << lane;
    }
    *out = bits;
    return 0;
}

static int entry_masks(PyObject *e, int lanes, Masks *out) {
    if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 4) return -1;
    for (int k = 0; k < 4; k++)
        if (lane_bits(PyTuple_GET_ITEM(e, k), lanes, &out->m[k]) < 0) return -1;
    out->obj = e;
    return 0;
}

/* The entry of key k (borrowed; NULL when absent). */
static PyObject *entry_of(KeyTable *t, PyObject *keyobj) {
    const unsigned char *key = key_bytes(keyobj);
    Py_ssize_t at = key ? find(t, key, tag_of(key)) : -1;
    return at >= 0 ? t->slots[at].value : NULL;
}

typedef struct {
    uint64_t alive;
    int ends[ROUTE_LANES];                         /* each lane's prefix length */
    int count[3][ROUTE_LANES];                     /* blocks per tier (gpu, host, disk) */
} Walk;

static void add_run(Walk *w, const Masks *e, int run) {
    for (int k = 0; k < 3; k++)
        for (uint64_t b = e->m[k + 1] & w->alive; b; b &= b - 1) w->count[k][__builtin_ctzll(b)] += run;
}

static void end_lanes(Walk *w, uint64_t lanes, int at) {
    for (uint64_t b = lanes; b; b &= b - 1) w->ends[__builtin_ctzll(b)] = at;
}

/* Start loading what key_bytes() reads of a key object, its type and size and its 32 bytes (two
 * cache lines at most), and a slot (48 bytes: one line or two). */
static inline void prefetch_key(PyObject *key) {
    __builtin_prefetch((const char *)key + offsetof(PyObject, ob_type));
    __builtin_prefetch((const char *)key + offsetof(PyBytesObject, ob_sval) + KEY_BYTES - 1);
}

static inline void prefetch_slot(const Slot *slot) {
    __builtin_prefetch(slot);
    __builtin_prefetch((const char *)slot + sizeof(Slot) - 1);
}

/* Walk the chain: 1 when done, 0 when nobody holds the first key, -1 to leave it to Python. */
static int walk(KeyTable *t, PyObject **keys, Py_ssize_t n, int lanes, Walk *w) {
    Masks cur;
    PyObject *first = entry_of(t, keys[0]);
    if (first == NULL) return 0;
    if (entry_masks(first, lanes, &cur) < 0) return -1;
    if (!cur.m[0]) return 0;
    w->alive = cur.m[0];
    Py_ssize_t i = 0, mask = t->cap - 1;
    for (Py_ssize_t k = 1; k < 33 && k < n; k++) prefetch_key(keys[k]);
    for (Py_ssize_t j = 1;; j++) {
        if ((j & 15) == 1) /* warm the slots of the next 16 keys, and the key objects 16 further */
            for (Py_ssize_t k = j; k < j + 16 && k < n; k++) {
                if (k + 32 < n) prefetch_key(keys[k + 32]);
                const unsigned char *key = key_bytes(keys[k]);
                if (key) prefetch_slot(&t->slots[(Py_ssize_t)(tag_of(key) & (uint64_t)mask)]);
            }
        PyObject *e = j < n ? entry_of(t, keys[j]) : NULL;
        if (j < n && e == cur.obj) continue;
        add_run(w, &cur, (int)(j - i));
        if (j == n || e == NULL) {
            end_lanes(w, w->alive, (int)j);
            return 1;
        }
        if (entry_masks(e, lanes, &cur) < 0) return -1;
        uint64_t keep = w->alive & cur.m[0];
        end_lanes(w, w->alive & ~keep, (int)j);
        w->alive = keep;
        if (!keep) return 1;
        i = j;
    }
}

static PyObject *new_match(PyTypeObject *type, PyObject *name, const Walk *w, int lane) {
    PyObject *m = type->tp_alloc(type, 6);
    if (!m) return NULL;
    long vals[5] = {w->ends[lane], w->count[0][lane], w->count[1][lane], w->count[2][lane], 0};
    PyTuple_SET_ITEM(m, 0, Py_NewRef(name));
    for (int k = 0; k < 5; k++) {
        PyObject *v = PyLong_FromLong(vals[k]);
        if (!v) {
            Py_DECREF(m);
            return NULL;
        }
        PyTuple_SET_ITEM(m, k + 1, v);
    }
    return m;
}

/* The answer dict: RouteMatch(name, blocks, gpu, host, disk, 0) per matched lane of `order`. */
static PyObject *build_route(PyObject *names, PyTypeObject *type, const Walk *w, const int *order, int m) {
    PyObject *out = PyDict_New();
    for (int k = 0; out && k < m; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, order[k]);
        if (name == Py_None) continue;
        PyObject *match = new_match(type, name, w, order[k]);
        if (!match || PyDict_SetItem(out, name, match) < 0) Py_CLEAR(out);
        Py_XDECREF(match);
    }
    return out;
}

/* Answers with many matches are kept by their content (each matched lane's prefix length and
 * tier counts, with the names tuple and match type they were built for; Python's route memo,
 * raykv.index.route._collect): a prefix many workers hold (a shared system prompt) then costs a
 * dict copy, not a RouteMatch per worker. Direct-mapped; a caller always gets a fresh dict. */
#define MEMO_ENTRIES 64
typedef struct {
    uint64_t hash;
    PyObject *names, *type, *dict; /* owned; NULL when empty */
    int m;
    uint16_t sig[ROUTE_LANES][5];  /* lane, blocks, gpu, host, disk */
} MemoEntry;

struct RouteMemo {
    MemoEntry e[MEMO_ENTRIES];
};

static void free_memo(struct RouteMemo *memo) {
    if (!memo) return;
    for (int i = 0; i < MEMO_ENTRIES; i++) {
        Py_XDECREF(memo->e[i].names);
        Py_XDECREF(memo->e[i].type);
        Py_XDECREF(memo->e[i].dict);
    }
    PyMem_Free(memo);
}

static PyObject *memo_route(KeyTable *t, PyObject *names, PyTypeObject *type, const Walk *w, const int *order, int m) {
    uint16_t sig[ROUTE_LANES][5];
    uint64_t h = 1469598103934665603ULL;
    for (int k = 0; k < m; k++) {
        int lane = order[k];
        uint16_t row[5] = {(uint16_t)lane, (uint16_t)w->ends[lane], (uint16_t)w->count[0][lane],
                           (uint16_t)w->count[1][lane], (uint16_t)w->count[2][lane]};
        memcpy(sig[k], row, sizeof(row));
        for (int j = 0; j < 5; j++) h = (h ^ row[j]) * 1099511628211ULL;
    }
    if (!t->memo && !(t->memo = PyMem_Calloc(1, sizeof(struct RouteMemo)))) return PyErr_NoMemory();
    MemoEntry *e = &t->memo->e[(h ^ (h >> 32)) % MEMO_ENTRIES];
    size_t bytes = (size_t)m * sizeof(sig[0]);
    if (e->dict && e->hash == h && e->names == names && e->type == (PyObject *)type && e->m == m &&
        memcmp(e->sig, sig, bytes) == 0)
        return PyDict_Copy(e->dict);
    PyObject *out = build_route(names, type, w, order, m);
    PyObject *kept = out ? PyDict_Copy(out) : NULL;
    if (!kept) {
        Py_XDECREF(out);
        return NULL;
    }
    Py_XSETREF(e->dict, kept);
    Py_XSETREF(e->names, Py_NewRef(names));
    Py_XSETREF(e->type, Py_NewRef((PyObject *)type));
    e->hash = h;
    e->m = m;
    memcpy(e->sig, sig, bytes);
    return out;
}

/* route(keys, names, match_type) -> dict or None. See raykv.index.prefix_index.PrefixIndex.route. */
static PyObject *KeyTable_route(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_CheckExact(args[1]) || !PyType_Check(args[2]) ||
        !PyType_IsSubtype((PyTypeObject *)args[2], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "route(keys, names: tuple, match_type: a tuple subclass)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "route() takes a sequence of keys");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), lanes = PyTuple_GET_SIZE(args[1]);
    if (n > ROUTE_MAX) n = ROUTE_MAX;
    if (lanes > ROUTE_LANES) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    Walk w;
    memset(&w, 0, sizeof(w));
    int got = n ? walk(t, PySequence_Fast_ITEMS(seq), n, (int)lanes, &w) : 0;
    Py_DECREF(seq);
    if (got < 0) Py_RETURN_NONE;
    if (got == 0) return PyDict_New();
    int order[ROUTE_LANES], m = 0;
    for (int lane = 0; lane < lanes; lane++)
        if (w.ends[lane]) order[m++] = lane;
    if (m <= ROUTE_SPARSE) { /* few matches: by prefix length, then lane (Python's sparse order) */
        for (int a = 1; a < m; a++)
            for (int b = a; b > 0 && w.ends[order[b - 1]] > w.ends[order[b]]; b--) {
                int x = order[b];
                order[b] = order[b - 1], order[b - 1] = x;
            }
        return build_route(args[1], (PyTypeObject *)args[2], &w, order, m);
    }
    return memo_route(t, args[1], (PyTypeObject *)args[2], &w, order, m);
}

static PyObject *KeyTable_keys(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(t->used);
    if (!out) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < t->cap && k < t->used; i++) {
        if (t->slots[i].tag < 2) continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)t->slots[i].key, KEY_BYTES);
        if (!key) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, key);
    }
    return out;
}

static PyObject *KeyTable_clear(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    clear_all(t);
    if (t->cap > MIN_CAP && resize(t, MIN_CAP) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL, "get(key, default=None)"},
    {"get_many", (PyCFunction)KeyTable_get_many, METH_O, "get_many(keys) -> list (None if absent)"},
    {"prefetch", (PyCFunction)KeyTable_prefetch, METH_O, "prefetch(keys): start loading their slots"},
    {"route", (PyCFunction)(void (*)(void))KeyTable_route, METH_FASTCALL,
     "route(keys, names, match_type) -> {name: match} or None (see raykv.index.prefix_index)"},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys() -> list of the keys (new bytes)"},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "clear(): remove everything"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    (lenfunc)KeyTable_len,
    (binaryfunc)KeyTable_getitem,
    (objobjargproc)KeyTable_ass_sub,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "raykv.native._keytable.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hash table from 32-byte block keys to objects (see raykv.index.keytable).",
    .tp_methods = KeyTable_methods,
    .tp_new = KeyTable_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "raykv.native._keytable", "Compiled KeyTable (see raykv.index.keytable).", -1, NULL,
};

PyMODINIT_FUNC PyInit__keytable(void) {
    if (PyType_Ready(&KeyTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

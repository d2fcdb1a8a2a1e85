/* raykv.native._holders, the read side: lookups, the route walk, listings and batch splitting
 * (see _holders.c for the table and its contract). */
#include "holders.h"

/* ---- entries ------------------------------------------------------------------------------- */
static PyObject *mask_int(const Set *s, int tier) {
    int top = s->n ? (s->codes[s->n - 1] >> 2) + 1 : 1;
    unsigned char *bytes = PyMem_Calloc((size_t)top, 2);
    if (!bytes) return PyErr_NoMemory();
    for (int k = 0; k < s->n; k++)
        if (tier < 0 || (s->codes[k] & 3) == tier) bytes[2 * (s->codes[k] >> 2)] = 1;
    PyObject *v = _PyLong_FromByteArray(bytes, (size_t)top * 2, 1, 0);
    PyMem_Free(bytes);
    return v;
}

static PyObject *entry_of(Holders *h, uint32_t id) {
    if (h->entry_cache[id]) return Py_NewRef(h->entry_cache[id]);
    PyObject *e = PyTuple_New(4);
    for (int k = 0; e && k < 4; k++) {
        PyObject *v = mask_int(h->sets[id], k - 1);
        if (!v) Py_CLEAR(e);
        else PyTuple_SET_ITEM(e, k, v);
    }
    if (e) h->entry_cache[id] = Py_NewRef(e);
    return e;
}

static void resolve(Holders *h, const Keys *k, Py_ssize_t lo, Py_ssize_t hi, uint32_t *ids);
#define RESOLVE 32

HIDDEN PyObject *hl_entries(Holders *h, PyObject *obj) {
    Keys k;
    uint32_t ids[RESOLVE];
    if (keys_open(obj, &k) < 0) return NULL;
    PyObject *out = PyList_New(k.n);
    for (Py_ssize_t lo = 0; out && lo < k.n; lo += RESOLVE) {
        Py_ssize_t hi = lo + RESOLVE < k.n ? lo + RESOLVE : k.n;
        resolve(h, &k, lo, hi, ids);
        for (Py_ssize_t i = lo; out && i < hi; i++) {
            PyObject *e = ids[i - lo] ? entry_of(h, ids[i - lo]) : Py_NewRef(Py_None);
            if (!e) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, e);
        }
    }
    keys_close(&k);
    return out;
}

/* ---- route ---------------------------------------------------------------------------------- */
typedef struct {
    uint16_t lane, ends, count[3];
} Row;

typedef struct Walk {
    Row alive[MAX_LANES], done[MAX_LANES];
    int n_alive, n_done;
} Walk;

/* Add a run of `run` positions of set s to each alive lane's tier count (alive is a subset of
 * s's lanes; both sorted by lane). */
static void add_run(Walk *w, const Set *s, int run) {
    int k = 0;
    for (int a = 0; a < w->n_alive; a++) {
        while ((s->codes[k] >> 2) != w->alive[a].lane) k++;
        w->alive[a].count[s->codes[k] & 3] += (uint16_t)run;
    }
}

/* Keep the alive lanes that are in s; the others end at `at`. */
static void narrow(Walk *w, const Set *s, int at) {
    int keep = 0, k = 0;
    for (int a = 0; a < w->n_alive; a++) {
        int lane = w->alive[a].lane;
        while (k < s->n && (s->codes[k] >> 2) < lane) k++;
        if (k < s->n && (s->codes[k] >> 2) == lane) {
            w->alive[keep++] = w->alive[a];
        } else {
            w->done[w->n_done] = w->alive[a];
            w->done[w->n_done++].ends = (uint16_t)at;
        }
    }
    w->n_alive = keep;
}

static void end_all(Walk *w, int at) {
    for (int a = 0; a < w->n_alive; a++) {
        w->done[w->n_done] = w->alive[a];
        w->done[w->n_done++].ends = (uint16_t)at;
    }
    w->n_alive = 0;
}

static int by_ends(const void *x, const void *y) {
    const Row *a = x, *b = y;
    return a->ends != b->ends ? a->ends - b->ends : a->lane - b->lane;
}

static int by_lane(const void *x, const void *y) { return ((const Row *)x)->lane - ((const Row *)y)->lane; }

/* Each lane's cached prefix of the chain, in Python's order (route_held). */
/* The set ids (0: absent or held by nobody) of keys lo..hi-1 (at most RESOLVE of them): every
 * key's slot is computed and its line requested before any is compared, so the misses overlap. */
static void resolve(Holders *h, const Keys *k, Py_ssize_t lo, Py_ssize_t hi, uint32_t *ids) {
    uint64_t a[RESOLVE], b[RESOLVE];
    int ok[RESOLVE];
    for (Py_ssize_t i = lo; i < hi; i++) {
        ok[i - lo] = key_at(k, i, &a[i - lo], &b[i - lo]);
        if (ok[i - lo]) prefetch_key(h, a[i - lo]);
    }
    for (Py_ssize_t i = lo; i < hi; i++) {
        Slot *s = ok[i - lo] ? hl_locate(h, a[i - lo], b[i - lo]) : NULL;
        ids[i - lo] = s && h->sets[s->set]->n ? s->set : 0;
    }
}

/* Each lane's cached prefix of the chain, in Python's order (route_held). The first 4 keys are
 * resolved alone (a prefix that ends there costs few probes), then RESOLVE at a time. */
static void walk(Holders *h, const Keys *k, Walk *w) {
    Py_ssize_t n = k->n < ROUTE_MAX ? k->n : ROUTE_MAX;
    uint32_t ids[RESOLVE];
    w->n_alive = w->n_done = 0;
    if (!n) return;
    Py_ssize_t lo = 0, hi = n < 4 ? n : 4;
    resolve(h, k, lo, hi, ids);
    uint32_t cur = ids[0];
    if (!cur) return;
    const Set *s = h->sets[cur];
    for (int a = 0; a < s->n; a++) w->alive[a] = (Row){(uint16_t)(s->codes[a] >> 2), 0, {0, 0, 0}};
    w->n_alive = s->n;
    Py_ssize_t i = 0;
    for (Py_ssize_t j = 1;; j++) {
        if (j == hi && j < n) {
            lo = j;
            hi = j + RESOLVE < n ? j + RESOLVE : n;
            resolve(h, k, lo, hi, ids);
        }
        uint32_t id = j < n ? ids[j - lo] : 0;
        if (j < n && id == cur) continue;
        add_run(w, h->sets[cur], (int)(j - i));
        if (!id) {
            end_all(w, (int)j);
            break;
        }
        narrow(w, h->sets[id], (int)j);
        if (!w->n_alive) break;
        cur = id;
        i = j;
    }
    qsort(w->done, (size_t)w->n_done, sizeof(Row), w->n_done <= ROUTE_SPARSE ? by_ends : by_lane);
}

static Walk *get_walk(Holders *h) {
    if (!h->walk && !(h->walk = PyMem_Malloc(sizeof(Walk)))) PyErr_NoMemory();
    return h->walk;
}

HIDDEN PyObject *hl_route_rows(Holders *h, PyObject *obj) {
    Keys k;
    Walk *w = get_walk(h);
    if (!w || keys_open(obj, &k) < 0) return NULL;
    walk(h, &k, w);
    keys_close(&k);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)w->n_done * 10);
    if (out) {
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
        for (int r = 0; r < w->n_done; r++) {
            uint16_t v[5] = {w->done[r].lane, w->done[r].ends, w->done[r].count[0], w->done[r].count[1],
                             w->done[r].count[2]};
            memcpy(p + 10 * r, v, 10); /* little-endian hosts (x86-64, aarch64) */
        }
    }
    return out;
}

static PyObject *new_match(PyTypeObject *type, PyObject *name, const Row *r) {
    PyObject *m = type->tp_alloc(type, 6);
    if (!m) return NULL;
    long vals[5] = {r->ends, r->count[0], r->count[1], r->count[2], 0};
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

/* The answer dict of a walk: match_type(name, blocks, gpu, host, disk, 0) per named lane. */
static PyObject *build_answer(const Walk *w, PyObject *names, PyTypeObject *type) {
    Py_ssize_t known = PyTuple_GET_SIZE(names);
    PyObject *out = PyDict_New();
    for (int r = 0; out && r < w->n_done; r++) {
        if (w->done[r].lane >= known) continue;
        PyObject *name = PyTuple_GET_ITEM(names, w->done[r].lane);
        if (name == Py_None) continue;
        PyObject *match = new_match(type, name, &w->done[r]);
        if (!match || PyDict_SetItem(out, name, match) < 0) Py_CLEAR(out);
        Py_XDECREF(match);
    }
    return out;
}

/* Answers with many matches, kept by their rows (with the names tuple and match type they were
 * built for): a prefix many workers hold (a shared system prompt) then costs a dict copy, not a
 * match object per worker. Direct-mapped; a caller always gets a fresh dict. */
#define ANSWERS 64
#define ANSWER_ROWS 64
typedef struct {
    uint64_t hash;
    PyObject *names, *type, *dict; /* owned; NULL when empty */
    int n;
    Row rows[ANSWER_ROWS];
} Answer;

struct AnswerMemo {
    Answer e[ANSWERS];
};

HIDDEN void hl_free_answers(struct AnswerMemo *memo) {
    if (!memo) return;
    for (int i = 0; i < ANSWERS; i++) {
        Py_XDECREF(memo->e[i].names);
        Py_XDECREF(memo->e[i].type);
        Py_XDECREF(memo->e[i].dict);
    }
    PyMem_Free(memo);
}

static PyObject *memo_answer(Holders *h, const Walk *w, PyObject *names, PyTypeObject *type) {
    uint64_t x = 1469598103934665603ULL;
    const unsigned char *p = (const unsigned char *)w->done;
    for (size_t i = 0; i < (size_t)w->n_done * sizeof(Row); i++) x = (x ^ p[i]) * 1099511628211ULL;
    if (!h->answers && !(h->answers = PyMem_Calloc(1, sizeof(struct AnswerMemo)))) return PyErr_NoMemory();
    Answer *e = &h->answers->e[(x ^ (x >> 32)) % ANSWERS];
    size_t bytes = (size_t)w->n_done * sizeof(Row);
    if (e->dict && e->hash == x && e->names == names && e->type == (PyObject *)type && e->n == w->n_done &&
        memcmp(e->rows, w->done, bytes) == 0)
        return PyDict_Copy(e->dict);
    PyObject *out = build_answer(w, names, type);
    PyObject *kept = out ? PyDict_Copy(out) : NULL;
    if (!kept) {
        Py_XDECREF(out);
        return NULL;
    }
    Py_XSETREF(e->dict, kept);
    Py_XSETREF(e->names, Py_NewRef(names));
    Py_XSETREF(e->type, Py_NewRef((PyObject *)type));
    e->hash = x;
    e->n = w->n_done;
    memcpy(e->rows, w->done, bytes);
    return out;
}

/* route(keys, names, match_type) -> {name: match_type(name, blocks, gpu, host, disk, 0)};
 * names[lane] is the lane's worker (None or beyond the tuple: left out). */
HIDDEN PyObject *hl_route(Holders *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_CheckExact(args[1]) || !PyType_Check(args[2]) ||
        !PyType_IsSubtype((PyTypeObject *)args[2], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "route(keys, names: tuple, match_type: a tuple subclass)");
        return NULL;
    }
    Keys k;
    Walk *w = get_walk(h);
    if (!w || keys_open(args[0], &k) < 0) return NULL;
    walk(h, &k, w);
    keys_close(&k);
    if (w->n_done > ROUTE_SPARSE && w->n_done <= ANSWER_ROWS)
        return memo_answer(h, w, args[1], (PyTypeObject *)args[2]);
    return build_answer(w, args[1], (PyTypeObject *)args[2]);
}

/* ---- listing and upkeep --------------------------------------------------------------------- */
static int list_table(Holders *h, const Table *t, int lane, PyObject *out) {
    for (uint64_t i = 0; t->slots && i < t->cap; i++) {
        const Slot *s = &t->slots[i];
        if (s->set < FIRST_SET) continue;
        int code = hl_code_of(h->sets[s->set], lane);
        if (code < 0) continue;
        unsigned char key[PREFIX];
        memcpy(key, &s->a, 8);
        memcpy(key + 8, &s->b, 8);
        PyObject *k = PyBytes_FromStringAndSize((const char *)key, PREFIX), *v = PyLong_FromLong(code & 3);
        int rc = k && v ? PyDict_SetItem(out, k, v) : -1;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (rc < 0) return -1;
    }
    return 0;
}

HIDDEN PyObject *hl_lane_blocks(Holders *h, PyObject *arg) {
    int lane = hl_lane_arg(arg);
    if (lane < 0) return NULL;
    PyObject *out = PyDict_New();
    if (out && (list_table(h, &h->cur, lane, out) < 0 || list_table(h, &h->old, lane, out) < 0)) Py_CLEAR(out);
    return out;
}

/* ---- split ------------------------------------------------------------------------------------ */
HIDDEN PyObject *hl_split(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "split(data, num_shards)");
        return NULL;
    }
    long shards = PyLong_AsLong(args[1]);
    if (shards < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "num_shards must be >= 1");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t n = buf.len / RECORD, *count = PyMem_Calloc((size_t)shards, sizeof(Py_ssize_t));
    uint32_t *dest = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    PyObject *out = count && dest ? PyList_New(shards) : NULL;
    for (Py_ssize_t r = 0; out && r < n; r++) {
        const unsigned char *p = d + r * RECORD;
        uint64_t first = 0;
        for (int b = 0; b < 8; b++) first = first << 8 | p[2 + b]; /* big-endian, as shard_of */
        dest[r] = p[0] == OP_CLEAR ? UINT32_MAX : (uint32_t)(first % (uint64_t)shards);
        if (dest[r] == UINT32_MAX)
            for (long s = 0; s < shards; s++) count[s]++;
        else count[dest[r]]++;
    }
    for (long s = 0; out && s < shards; s++) {
        PyObject *part = PyBytes_FromStringAndSize(NULL, count[s] * RECORD);
        if (!part) {
            Py_CLEAR(out);
            break;
        }
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(part);
        for (Py_ssize_t r = 0; r < n; r++)
            if (dest[r] == (uint32_t)s || dest[r] == UINT32_MAX) memcpy(p, d + r * RECORD, RECORD), p += RECORD;
        PyList_SET_ITEM(out, s, part);
    }
    if (!count || !dest) PyErr_NoMemory();
    PyMem_Free(count);
    PyMem_Free(dest);
    PyBuffer_Release(&buf);
    return out;
}

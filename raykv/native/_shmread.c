/* raykv.native._shmread: one-sided reads of a same-node peer's shared host tier, in one C call.
 *
 * raykv.transfer.shm_read serves a same-node pull from the owner's tier mapping and its slot
 * directory (raykv.core.tiers.shm_directory: a seqlock per slot, an open-addressing hash table). In
 * Python the checks around a one-page copy cost several times the copy; Reader.read does it all:
 *   1. locate, as DirectoryView.locate: the first key through the table, then all keys as one run
 *      of consecutive slots (generations all even, keys in place), else key by key (below
 *      vector_min keys the slot after the previous key's first, else the table). Then the records
 *      (parent key, token count, root flag). A key not found or an odd generation: None;
 *   2. copy: one memmove per run of consecutive slots into `out`'s leading rows;
 *   3. re-check every slot's generation and key; anything changed: None (`out` may hold partial
 *      bytes).
 * Ordering: the owner (another process) writes with plain stores, relying on x86-64's total store
 * order (shm_directory.supported()). Every shared word is read once, with an atomic load (acquire
 * for generations and tags): the compiler neither re-reads nor reorders it; an acquire fence keeps
 * the copy's loads before the re-check's. Safety: every value read from the shared file is checked
 * before use (a cell must name a slot below num_slots; probes are masked), the layout is checked
 * against the buffers at construction, and `out` must be a writable C-contiguous 2-D uint8
 * `array_type` of at least len(keys) rows of page_bytes (as results.check_out): nothing outside
 * the buffers given is read or written. Copies of REL_GIL_BYTES or more run without the GIL;
 * release() meanwhile waits for them.
 *
 * Reader(directory, tier, num_slots, page_bytes, cells, gen_off, key_off, parent_off, meta_off,
 *        tags_off, cells_off, vector_min, array_type): tier None makes a locate-only reader (a GPU
 *        tier's directory: locate and unchanged work, read raises ValueError).
 *   read(keys, out, hook=None, whole=False) -> None, (keys, parents, roots, tokens) tuples, or
 *       after set_result(type, ((name, value), ...)) a new `type` whose attributes are set as
 *       object.__setattr__ would; a value that is one of the markers KEYS, PARENTS, ROOTS, TOKENS,
 *       DATA (out[:len(keys)], `out` itself when `whole`) or SECONDS (the call's duration) stands
 *       for that value. hook: called between the copy and the re-check (tests).
 *   locate(keys) -> (slots, gens, parents, roots, tokens, first) lists | None and
 *       unchanged(slots, gens, keys) -> bool: as DirectoryView's (first: the run's or -1).
 *   release(): drop the buffers (later calls: ValueError); idempotent.
 * keys: a list or tuple of 32-byte bytes (else TypeError); ValueError for a bad `out` or a released
 * reader. Not tracked by the cycle collector (no cycles through a Reader).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define KEY_BYTES 32
#define EMPTY 0
#define DELETED 1
#define STACK_KEYS 32
#define REL_GIL_BYTES (1 << 20)

typedef struct {
    PyObject_HEAD
    Py_buffer dir, tier;
    int has_buffers; /* the buffers held (the directory; the tier too when has_tier) */
    int has_tier;    /* 0: a locate-only reader (tier=None): read() refuses */
    int busy;        /* calls copying without the GIL */
    int closing;     /* release() was asked while busy */
    Py_ssize_t num_slots, page_bytes, cells, vector_min;
    const uint64_t *gen, *tags; /* the directory's arrays (see shm_directory._layout) */
    const unsigned char *key, *parent, *pages;
    const uint32_t *meta;
    const int64_t *cell;
    PyObject *array_type;
    PyObject *result_type;   /* NULL: read() returns (keys, parents, roots, tokens) */
    PyObject *result_fields; /* ((name, value or a marker), ...) */
} Reader;

/* The markers a result field's value may be: filled in by read() (see set_result). */
enum { M_KEYS, M_PARENTS, M_ROOTS, M_TOKENS, M_DATA, M_SECONDS, N_MARKERS };
static const char *marker_names[N_MARKERS] = {"KEYS", "PARENTS", "ROOTS", "TOKENS", "DATA", "SECONDS"};
static PyObject *markers[N_MARKERS];
static PyObject *empty_tuple, *zero;

/* Per-call scratch: slots and generations (on the stack for a few keys). */
typedef struct {
    int64_t *slots;
    uint64_t *gens;
    int64_t slots_stack[STACK_KEYS];
    uint64_t gens_stack[STACK_KEYS];
} Scratch;

static int scratch_init(Scratch *s, Py_ssize_t n) {
    if (n <= STACK_KEYS) {
        s->slots = s->slots_stack;
        s->gens = s->gens_stack;
        return 0;
    }
    s->slots = (size_t)n < PY_SSIZE_T_MAX / 16 ? PyMem_Malloc((size_t)n * 16) : NULL; /* slots, gens */
    if (!s->slots) return PyErr_NoMemory(), -1;
    s->gens = (uint64_t *)(s->slots + n);
    return 0;
}

static void scratch_free(Scratch *s) { if (s->slots != s->slots_stack) PyMem_Free(s->slots); }

static inline uint64_t load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline uint64_t tag_of(const unsigned char *key) {
    uint64_t tag = 0;
    for (int i = 7; i >= 0; i--) tag = (tag << 8) | key[i]; /* little-endian, as the owner's */
    return tag;
}

#define key_at(r, slot) ((r)->key + (size_t)(slot) * KEY_BYTES) /* slot: checked by the caller */

/* The slot the table lists for key with that key in its record, else -1 (DirectoryView.find). */
static int64_t find(const Reader *r, const unsigned char *key) {
    uint64_t tag = tag_of(key);
    if (tag <= DELETED) return -1;
    uint64_t mask = (uint64_t)r->cells - 1, i = tag & mask;
    for (Py_ssize_t step = 0; step < r->cells; step++) {
        uint64_t seen = load_acquire(&r->tags[i]); /* the owner writes the cell, then the tag */
        if (seen == EMPTY) return -1;
        if (seen == tag) {
            int64_t slot = __atomic_load_n(&r->cell[i], __ATOMIC_RELAXED);
            if (slot >= 0 && slot < r->num_slots && memcmp(key_at(r, slot), key, KEY_BYTES) == 0) return slot;
        }
        i = (i + 1) & mask;
    }
    return -1;
}

#define KEY(obj) ((const unsigned char *)PyBytes_AS_STRING(obj))

/* keys[0..n) as one run from `first`: every generation even (kept in gens), every key in place. */
static int locate_run(const Reader *r, PyObject *const *keys, Py_ssize_t n, int64_t first, uint64_t *gens) {
    if (n > r->num_slots - first) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        gens[i] = load_acquire(&r->gen[first + i]);
        if (gens[i] & 1) return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (memcmp(key_at(r, first + i), KEY(keys[i]), KEY_BYTES) != 0) return 0;
    return 1;
}

/* Fill slots/gens for every key; 1 when all are bound at even generations, else 0. *first: the
 * run's first slot, or -1 when the keys were located one by one. */
static int locate(const Reader *r, PyObject *const *keys, Py_ssize_t n, Scratch *s, int64_t *first) {
    *first = -1;
    if (n == 0) return 1;
    int64_t start = find(r, KEY(keys[0]));
    if (start < 0) return 0;
    if (locate_run(r, keys, n, start, s->gens)) {
        for (Py_ssize_t i = 0; i < n; i++) s->slots[i] = start + i;
        *first = start;
        return 1;
    }
    s->slots[0] = start;
    for (Py_ssize_t i = 1; i < n; i++) {
        const unsigned char *key = KEY(keys[i]);
        int64_t guess = s->slots[i - 1] + 1, slot;
        if (n < r->vector_min && guess < r->num_slots && memcmp(key_at(r, guess), key, KEY_BYTES) == 0)
            slot = guess;
        else
            slot = find(r, key);
        if (slot < 0) return 0;
        s->slots[i] = slot;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        s->gens[i] = load_acquire(&r->gen[s->slots[i]]);
        if (s->gens[i] & 1) return 0;
    }
    return 1;
}

/* Whether every slot still holds its key at the generation seen (after the reads it guards). */
static int unchanged(const Reader *r, PyObject *const *keys, Py_ssize_t n, const int64_t *slots,
                     const uint64_t *gens) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (Py_ssize_t i = 0; i < n; i++)
        if (load_acquire(&r->gen[slots[i]]) != gens[i]) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (memcmp(key_at(r, slots[i]), KEY(keys[i]), KEY_BYTES) != 0) return 0;
    return 1;
}

static void copy_pages(const Reader *r, const int64_t *slots, Py_ssize_t n, unsigned char *out) {
    size_t page = (size_t)r->page_bytes;
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = i + 1;
        while (j < n && slots[j] == slots[j - 1] + 1) j++;
        memmove(out + (size_t)i * page, r->pages + (size_t)slots[i] * page, (size_t)(j - i) * page);
        i = j;
    }
}

/* ---- argument checks ------------------------------------------------------------------------ */
static int check_open(const Reader *r) {
    if (r->has_buffers && !r->closing) return 0;
    PyErr_SetString(PyExc_ValueError, "the shm reader was released");
    return -1;
}

/* keys as a tuple (a new reference; a list is copied so it cannot change under us), every item a
 * bytes of exactly 32 bytes; NULL with TypeError otherwise. */
static PyObject *key_tuple(PyObject *keys) {
    int list = PyList_CheckExact(keys);
    PyObject *tuple = list ? PyList_AsTuple(keys) : PyTuple_CheckExact(keys) ? Py_NewRef(keys) : NULL;
    for (Py_ssize_t i = 0; tuple && i < PyTuple_GET_SIZE(tuple); i++) {
        PyObject *k = PyTuple_GET_ITEM(tuple, i);
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != KEY_BYTES) Py_CLEAR(tuple);
    }
    if (!tuple && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "keys must be a list or tuple of 32-byte bytes");
    return tuple;
}

/* A writable buffer of `out` when it can take `rows` pages (as results.check_out); else -1 with
 * ValueError. */
static int get_out(const Reader *r, PyObject *out, Py_ssize_t rows, Py_buffer *view) {
    if (!PyObject_TypeCheck(out, (PyTypeObject *)r->array_type)) goto bad;
    if (PyObject_GetBuffer(out, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_STRIDES) < 0) goto refused;
    if (view->ndim != 2 || view->itemsize != 1 || !view->format || strcmp(view->format, "B") != 0 ||
        view->shape[0] < rows || view->shape[1] != r->page_bytes ||
        !PyBuffer_IsContiguous(view, 'C')) { /* ignores the strides of dimensions of 1, as numpy */
        PyBuffer_Release(view);
        goto bad;
    }
    return 0;
refused:
    PyErr_Clear();
bad:
    PyErr_Format(PyExc_ValueError, "out: needs a writable C-contiguous uint8 array of at least %zd rows "
                 "of %zd bytes", rows, r->page_bytes);
    return -1;
}

/* ---- results -------------------------------------------------------------------------------- */
/* (parents, roots, tokens) of the slots as new tuples, read from the records. A parent equal to
 * the key before it (a chain: the usual batch) is that key's object (`keys`: the n keys asked
 * for), not a new bytes: no allocation, and later comparisons of the two stop at identity. */
static int records(const Reader *r, const int64_t *slots, Py_ssize_t n, PyObject *const *keys,
                   PyObject **parts) {
    for (int k = 0; k < 3; k++) parts[k] = PyTuple_New(n);
    if (!parts[0] || !parts[1] || !parts[2]) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        const char *at = (const char *)r->parent + (size_t)s * KEY_BYTES;
        PyObject *parent = i > 0 && memcmp(at, PyBytes_AS_STRING(keys[i - 1]), KEY_BYTES) == 0
                               ? Py_NewRef(keys[i - 1])
                               : PyBytes_FromStringAndSize(at, KEY_BYTES);
        uint32_t tokens = __atomic_load_n(&r->meta[2 * s], __ATOMIC_RELAXED);
        uint32_t flags = __atomic_load_n(&r->meta[2 * s + 1], __ATOMIC_RELAXED);
        PyObject *count = PyLong_FromUnsignedLong(tokens);
        PyTuple_SET_ITEM(parts[0], i, parent); /* NULL on failure: the tuple frees the others */
        PyTuple_SET_ITEM(parts[1], i, Py_NewRef((flags & 1) ? Py_True : Py_False));
        PyTuple_SET_ITEM(parts[2], i, count);
        if (!parent || !count) goto fail;
    }
    return 0;
fail:
    for (int k = 0; k < 3; k++) Py_CLEAR(parts[k]);
    return -1;
}

static void drop_buffers(Reader *r) {
    if (!r->has_buffers) return;
    r->has_buffers = 0;
    PyBuffer_Release(&r->dir);
    if (r->has_tier) PyBuffer_Release(&r->tier);
}

/* A call that copied without the GIL is done: a release() asked meanwhile happens now. */
static void finish_busy(Reader *r) {
    if (r->busy == 0 && r->closing) drop_buffers(r);
}

/* The pages, copied without the GIL when large (the buffers stay exported meanwhile). */
static void copy_out(Reader *r, const int64_t *slots, Py_ssize_t n, unsigned char *out) {
    if ((size_t)n * (size_t)r->page_bytes < REL_GIL_BYTES) {
        copy_pages(r, slots, n, out);
        return;
    }
    r->busy++;
    Py_BEGIN_ALLOW_THREADS
    copy_pages(r, slots, n, out);
    Py_END_ALLOW_THREADS
    r->busy--;
}

/* ---- methods -------------------------------------------------------------------------------- */
static double now(void) { /* time.perf_counter's clock on Linux */
    struct timespec ts;
    return clock_gettime(CLOCK_MONOTONIC, &ts) == 0 ? (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 : 0.0;
}

/* The result of a read: a result_type instance whose fields are set as object.__setattr__ would
 * (a frozen dataclass's own __setattr__ is bypassed), or the tuple (keys, parents, roots, tokens). */
static PyObject *make_result(Reader *r, PyObject *keys, PyObject **parts, PyObject *out, int whole,
                             double start) {
    if (!r->result_type) return PyTuple_Pack(4, keys, parts[0], parts[1], parts[2]);
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *data = whole ? Py_NewRef(out) : PySequence_GetSlice(out, 0, n);
    PyObject *seconds = data ? PyFloat_FromDouble(now() - start) : NULL;
    PyTypeObject *type = (PyTypeObject *)r->result_type;
    PyObject *obj = seconds ? PyBaseObject_Type.tp_new(type, empty_tuple, NULL) : NULL; /* object.__new__ */
    PyObject *values[N_MARKERS] = {keys, parts[0], parts[1], parts[2], data, seconds};
    for (Py_ssize_t i = 0; obj && i < PyTuple_GET_SIZE(r->result_fields); i++) {
        PyObject *field = PyTuple_GET_ITEM(r->result_fields, i);
        PyObject *value = PyTuple_GET_ITEM(field, 1);
        for (int m = 0; m < N_MARKERS; m++)
            if (value == markers[m]) {
                value = values[m];
                break;
            }
        if (PyObject_GenericSetAttr(obj, PyTuple_GET_ITEM(field, 0), value) < 0) Py_CLEAR(obj);
    }
    Py_XDECREF(data);
    Py_XDECREF(seconds);
    return obj;
}

static PyObject *Reader_read(Reader *r, PyObject *const *args, Py_ssize_t nargs) {
    double start = r->result_type ? now() : 0.0;
    if (nargs < 2 || nargs > 4) return PyErr_Format(PyExc_TypeError, "read(keys, out, hook, whole)");
    PyObject *hook = nargs >= 3 ? args[2] : Py_None;
    int whole = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (whole < 0 || check_open(r) < 0) return NULL;
    if (!r->has_tier) return PyErr_Format(PyExc_ValueError, "read(): this reader has no tier (tier=None)");
    PyObject *keys = key_tuple(args[0]);
    if (!keys) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    PyObject *const *items = &PyTuple_GET_ITEM(keys, 0);
    Py_buffer out;
    Scratch s;
    if (get_out(r, args[1], n, &out) < 0) {
        Py_DECREF(keys);
        return NULL;
    }
    if (scratch_init(&s, n) < 0) {
        PyBuffer_Release(&out);
        Py_DECREF(keys);
        return NULL;
    }
    PyObject *result = NULL, *parts[3] = {NULL, NULL, NULL};
    int64_t first;
    if (!locate(r, items, n, &s, &first)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (records(r, s.slots, n, items, parts) < 0) goto done;
    copy_out(r, s.slots, n, (unsigned char *)out.buf);
    finish_busy(r);
    if (hook != Py_None) {
        PyObject *got = PyObject_CallNoArgs(hook);
        if (!got) goto done;
        Py_DECREF(got);
    }
    if (!r->has_buffers || r->closing || !unchanged(r, items, n, s.slots, s.gens)) /* or released */
        result = Py_NewRef(Py_None);
    else
        result = make_result(r, keys, parts, args[1], whole, start);
done:
    for (int k = 0; k < 3; k++) Py_XDECREF(parts[k]);
    scratch_free(&s);
    PyBuffer_Release(&out);
    Py_DECREF(keys);
    return result;
}

/* set_result(type, fields): read() returns type instances (see the module docstring). */
static PyObject *Reader_set_result(Reader *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_CheckExact(args[1]))
        return PyErr_Format(PyExc_TypeError, "set_result(type, ((name, value), ...))");
    if (((PyTypeObject *)args[0])->tp_new != PyBaseObject_Type.tp_new) /* made by object.__new__ */
        return PyErr_Format(PyExc_TypeError, "set_result(): the type must not define or inherit __new__");
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); i++) {
        PyObject *f = PyTuple_GET_ITEM(args[1], i);
        if (!PyTuple_CheckExact(f) || PyTuple_GET_SIZE(f) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(f, 0)))
            return PyErr_Format(PyExc_TypeError, "set_result(): each field is a (str name, value) pair");
    }
    Py_XSETREF(r->result_type, Py_NewRef(args[0]));
    Py_XSETREF(r->result_fields, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* A list of the slots, or (slots NULL) of the generations. */
static PyObject *int_list(const int64_t *slots, const uint64_t *gens, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *x = slots ? PyLong_FromLongLong(slots[i]) : PyLong_FromUnsignedLongLong(gens[i]);
        if (!x) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, x);
    }
    return list;
}

static PyObject *Reader_locate(Reader *r, PyObject *arg) {
    if (check_open(r) < 0) return NULL;
    PyObject *keys = key_tuple(arg);
    if (!keys) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    Scratch s;
    PyObject *result = NULL, *lists[5] = {NULL, NULL, NULL, NULL, NULL}, *parts[3] = {NULL, NULL, NULL};
    int64_t first;
    int got = scratch_init(&s, n) < 0 ? -1 : locate(r, &PyTuple_GET_ITEM(keys, 0), n, &s, &first);
    if (got <= 0) {
        if (got == 0) scratch_free(&s);
        Py_DECREF(keys);
        return got < 0 ? NULL : Py_NewRef(Py_None);
    }
    lists[0] = int_list(s.slots, NULL, n);
    lists[1] = int_list(NULL, s.gens, n);
    if (!lists[0] || !lists[1] || records(r, s.slots, n, &PyTuple_GET_ITEM(keys, 0), parts) < 0) goto done;
    for (int k = 0; k < 3; k++)
        if (!(lists[2 + k] = PySequence_List(parts[k]))) goto done;
    result = Py_BuildValue("(OOOOOL)", lists[0], lists[1], lists[2], lists[3], lists[4], (long long)first);
done:
    for (int k = 0; k < 5; k++) Py_XDECREF(lists[k]);
    for (int k = 0; k < 3; k++) Py_XDECREF(parts[k]);
    scratch_free(&s);
    Py_DECREF(keys);
    return result;
}

/* slots/gens (sequences of ints) into the scratch; False (0) when any slot is out of range. */
static int parse_located(const Reader *r, PyObject *slots, PyObject *gens, Py_ssize_t n, Scratch *s) {
    for (Py_ssize_t i = 0; i < n; i++) {
        long long slot = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred()) return -1;
        unsigned long long gen = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(gens, i));
        if (gen == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        if (slot < 0 || slot >= r->num_slots)
            return PyErr_Format(PyExc_ValueError, "unchanged(): a slot outside the directory"), -1;
        s->slots[i] = slot;
        s->gens[i] = gen;
    }
    return 0;
}

static PyObject *Reader_unchanged(Reader *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "unchanged(slots, gens, keys)");
    if (check_open(r) < 0) return NULL;
    PyObject *keys = key_tuple(args[2]);
    if (!keys) return NULL;
    PyObject *slots = PySequence_Fast(args[0], "slots must be a sequence of ints");
    PyObject *gens = slots ? PySequence_Fast(args[1], "gens must be a sequence of ints") : NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    Scratch s;
    if (!gens) goto done;
    if (PySequence_Fast_GET_SIZE(slots) != n || PySequence_Fast_GET_SIZE(gens) != n) {
        result = Py_NewRef(Py_False); /* as DirectoryView.unchanged: not the located keys */
        goto done;
    }
    if (scratch_init(&s, n) < 0) goto done;
    if (parse_located(r, slots, gens, n, &s) == 0)
        result = Py_NewRef(unchanged(r, &PyTuple_GET_ITEM(keys, 0), n, s.slots, s.gens) ? Py_True : Py_False);
    scratch_free(&s);
done:
    Py_XDECREF(slots);
    Py_XDECREF(gens);
    Py_DECREF(keys);
    return result;
}

static PyObject *Reader_release(Reader *r, PyObject *Py_UNUSED(ignored)) {
    if (r->busy > 0)
        r->closing = 1;
    else
        drop_buffers(r);
    Py_RETURN_NONE;
}


/* ---- construction --------------------------------------------------------------------------- */
/* The address of an array of `count` items of `size` bytes at `off` in the directory buffer, or
 * NULL with ValueError when it does not fit or is misaligned. */
static const void *region(const Py_buffer *buf, Py_ssize_t off, Py_ssize_t count, Py_ssize_t size,
                          Py_ssize_t align, const char *name) {
    if (off < 0 || off > buf->len || count < 0 || count > (buf->len - off) / size ||
        ((uintptr_t)buf->buf + (uintptr_t)off) % (uintptr_t)align != 0) {
        return PyErr_Format(PyExc_ValueError, "the directory's %s array does not fit its buffer", name);
    }
    return (const char *)buf->buf + off;
}

static int set_layout(Reader *r, Py_ssize_t *offs) {
    const Py_buffer *d = &r->dir;
    Py_ssize_t n = r->num_slots;
    r->gen = region(d, offs[0], n, 8, 8, "gen");
    r->key = r->gen ? region(d, offs[1], n, KEY_BYTES, 1, "key") : NULL;
    r->parent = r->key ? region(d, offs[2], n, KEY_BYTES, 1, "parent") : NULL;
    r->meta = r->parent ? region(d, offs[3], n, 8, 4, "meta") : NULL; /* two uint32 per slot */
    r->tags = r->meta ? region(d, offs[4], r->cells, 8, 8, "tags") : NULL;
    r->cell = r->tags ? region(d, offs[5], r->cells, 8, 8, "cells") : NULL;
    if (!r->cell) return -1;
    if (!r->has_tier) return 0; /* locate-only: no pages */
    if (n > 0 && r->page_bytes > r->tier.len / n)
        return PyErr_Format(PyExc_ValueError, "the tier buffer is smaller than num_slots x page_bytes"), -1;
    r->pages = (const unsigned char *)r->tier.buf;
    return 0;
}

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"directory", "tier", "num_slots", "page_bytes", "cells", "gen_off", "key_off",
                            "parent_off", "meta_off", "tags_off", "cells_off", "vector_min", "array_type",
                            NULL};
    PyObject *dir, *tier, *array_type;
    Py_ssize_t num_slots, page_bytes, cells, offs[6], vector_min;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnnnnnnnnnnO:Reader", names, &dir, &tier, &num_slots,
                                     &page_bytes, &cells, &offs[0], &offs[1], &offs[2], &offs[3], &offs[4],
                                     &offs[5], &vector_min, &array_type))
        return NULL;
    if (num_slots < 0 || page_bytes < 1 || cells < 1 || (cells & (cells - 1)) != 0 || vector_min < 1)
        return PyErr_Format(PyExc_ValueError, "Reader(): num_slots >= 0, page_bytes >= 1, cells a power "
                                              "of two and vector_min >= 1 are required");
    if (!PyType_Check(array_type)) return PyErr_Format(PyExc_TypeError, "Reader(): array_type: a type");
    Reader *r = (Reader *)type->tp_alloc(type, 0);
    if (!r) return NULL;
    r->num_slots = num_slots;
    r->page_bytes = page_bytes;
    r->cells = cells;
    r->vector_min = vector_min;
    r->array_type = Py_NewRef(array_type);
    r->has_tier = tier != Py_None;
    if (PyObject_GetBuffer(dir, &r->dir, PyBUF_SIMPLE) == 0) {
        if (!r->has_tier || PyObject_GetBuffer(tier, &r->tier, PyBUF_SIMPLE) == 0)
            r->has_buffers = 1;
        else
            PyBuffer_Release(&r->dir);
    }
    if (!r->has_buffers || set_layout(r, offs) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    return (PyObject *)r;
}

static void Reader_dealloc(Reader *r) {
    drop_buffers(r); /* no call can be copying: it holds a reference */
    Py_XDECREF(r->array_type);
    Py_XDECREF(r->result_type);
    Py_XDECREF(r->result_fields);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef Reader_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Reader_read, METH_FASTCALL,
     "read(keys, out, hook=None, whole=False) -> the result (see set_result), or None"},
    {"set_result", (PyCFunction)(void (*)(void))Reader_set_result, METH_FASTCALL,
     "set_result(type, ((name, value or marker), ...)): what read() returns"},
    {"locate", (PyCFunction)Reader_locate, METH_O,
     "locate(keys) -> (slots, gens, parents, roots, tokens, first), or None"},
    {"unchanged", (PyCFunction)(void (*)(void))Reader_unchanged, METH_FASTCALL,
     "unchanged(slots, gens, keys) -> whether every slot still holds its key at that generation"},
    {"release", (PyCFunction)Reader_release, METH_NOARGS, "release(): drop the buffers (idempotent)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "raykv.native._shmread.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One-sided reads of a peer's shared host tier through its slot directory "
              "(see raykv.transfer.shm_read).",
    .tp_methods = Reader_methods,
    .tp_new = Reader_new,
};

/* tally(counters, key, amounts): counters[i][key] += amounts[i], through the dict C API (a
 * Counter's own item stores go through a Python-level slot, as it defines __delitem__: ~0.1 us). */
static PyObject *tally(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[2]) ||
        PyTuple_GET_SIZE(args[0]) != PyTuple_GET_SIZE(args[2]))
        return PyErr_Format(PyExc_TypeError, "tally(counters, key, amounts): two tuples of one size");
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[0]); i++) {
        PyObject *counts = PyTuple_GET_ITEM(args[0], i);
        if (!PyDict_Check(counts)) return PyErr_Format(PyExc_TypeError, "tally(): counters are dicts");
        PyObject *had = PyDict_GetItemWithError(counts, args[1]); /* absent: 0, as a Counter */
        if (!had && PyErr_Occurred()) return NULL;
        had = Py_NewRef(had ? had : zero); /* owned: an amount's __radd__ may drop it from the dict */
        PyObject *sum = PyNumber_Add(had, PyTuple_GET_ITEM(args[2], i));
        Py_DECREF(had);
        int failed = !sum || PyDict_SetItem(counts, args[1], sum) < 0;
        Py_XDECREF(sum);
        if (failed) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"tally", (PyCFunction)(void (*)(void))tally, METH_FASTCALL, "tally(counters, key, amounts)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "raykv.native._shmread", "Compiled one-sided shm reads (see raykv.transfer.shm_read).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__shmread(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (!empty_tuple && !(empty_tuple = PyTuple_New(0))) goto fail;
    if (!zero && !(zero = PyLong_FromLong(0))) goto fail;
    for (int i = 0; i < N_MARKERS; i++) {
        if (!markers[i] && !(markers[i] = PyUnicode_FromFormat("<_shmread.%s>", marker_names[i]))) goto fail;
        if (PyModule_AddObjectRef(m, marker_names[i], markers[i]) < 0) goto fail;
    }
    if (PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

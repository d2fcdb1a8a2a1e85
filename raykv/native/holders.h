/* raykv/native/holders.h: what the two sources of raykv.native._holders share (see _holders.c). */
#ifndef RAYKV_HOLDERS_H
#define RAYKV_HOLDERS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define KEY_BYTES 32
#define PREFIX 16
#define RECORD 34 /* op (0 store, 1 remove, 2 clear), tier (0..2), 32 key bytes */
#define OP_STORE 0
#define OP_REMOVE 1
#define OP_CLEAR 2
#define MAX_LANES 4096
#define LANE_BITS 16
#define ROUTE_MAX 65535
#define ROUTE_SPARSE 8
#define MIN_CAP 64
#define MIGRATE_STEP 32
#define EMPTY 0u
#define TOMB 1u
#define FIRST_SET 2u
#define MEMO 4096
#define PROBE_AHEAD 24 /* keys whose slots a walk or batch loads ahead of the one it reads */
#define RETIRE_BYTES ((size_t)4 << 20)

typedef struct __attribute__((packed)) {
    uint64_t a, b; /* the key's first 16 bytes */
    uint32_t set;  /* EMPTY, TOMB or a set id */
} Slot;

typedef struct {
    Slot *slots;
    uint64_t cap; /* a power of two; 0 when absent */
    int bits;
    uint64_t filled; /* slots not EMPTY */
} Table;

typedef struct {
    uint64_t refs; /* slots pointing here */
    uint32_t hash;
    uint16_t n;
    uint8_t interned;
    uint16_t codes[]; /* sorted; code = lane << 2 | tier */
} Set;

typedef struct {
    uint32_t src, src_gen, dst, dst_gen;
    uint32_t what; /* op << 16 | code */
} Memo;

typedef struct {
    PyObject_HEAD
    Table cur, old; /* old.slots != NULL while a move is under way */
    uint64_t move_at;
    Set **sets;
    uint32_t *gens;
    PyObject **entry_cache; /* per set id, the Python entry tuple (owned), or NULL */
    uint32_t nsets; /* ids handed out so far (FIRST_SET..) */
    uint32_t sets_cap;
    uint32_t *free_ids;
    uint32_t nfree, free_cap;
    uint32_t *itab; /* intern table of set ids by hash: EMPTY, TOMB or an id */
    uint32_t itab_cap, itab_filled;
    Memo *memo;
    int64_t live; /* keys whose set is not empty */
    uint64_t set_bytes;
    uint64_t moves;
    char *retired; /* a moved-out table still being unmapped, RETIRE_BYTES per write */
    size_t retired_len;
    struct Walk *walk; /* the route walk's rows (allocated on first use) */
    struct AnswerMemo *answers; /* route answers with many matches (allocated on first use) */
} Holders;

static inline uint64_t home(const Table *t, uint64_t a) {
    return (a * 0x9E3779B97F4A7C15ULL) >> (64 - t->bits);
}

/* The slot of key (a, b) in t, or -1. */
static inline int64_t probe(const Table *t, uint64_t a, uint64_t b) {
    if (!t->slots) return -1;
    uint64_t mask = t->cap - 1, i = home(t, a);
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->set == EMPTY) return -1;
        if (s->a == a && s->b == b && s->set != TOMB) return (int64_t)i;
        i = (i + 1) & mask;
    }
}

static inline void prefetch_key(const Holders *h, uint64_t a) {
    __builtin_prefetch(&h->cur.slots[home(&h->cur, a)]);
    if (h->old.slots) __builtin_prefetch(&h->old.slots[home(&h->old, a)]);
}

static inline void split_key(const unsigned char *key, uint64_t *a, uint64_t *b) {
    memcpy(a, key, 8);
    memcpy(b, key + 8, 8);
}

/* ---- keys in --------------------------------------------------------------------------------- */
typedef struct {
    PyObject *seq;   /* a fast sequence, or NULL for one buffer */
    Py_buffer buf;   /* when one buffer */
    Py_ssize_t n;
} Keys;

static inline int keys_open(PyObject *obj, Keys *k) {
    k->seq = NULL;
    if (PyBytes_Check(obj)) {
        if (PyObject_GetBuffer(obj, &k->buf, PyBUF_SIMPLE) < 0) return -1;
        k->n = k->buf.len / KEY_BYTES;
        return 0;
    }
    k->seq = PySequence_Fast(obj, "keys: a sequence of 32-byte bytes, or one bytes of them");
    if (!k->seq) return -1;
    k->n = PySequence_Fast_GET_SIZE(k->seq);
    return 0;
}

static inline void keys_close(Keys *k) {
    if (k->seq) Py_DECREF(k->seq);
    else PyBuffer_Release(&k->buf);
}

/* Key i's first 16 bytes; 0 when it is not a 32-byte key. */
static inline int key_at(const Keys *k, Py_ssize_t i, uint64_t *a, uint64_t *b) {
    const unsigned char *p;
    if (k->seq) {
        PyObject *o = PySequence_Fast_ITEMS(k->seq)[i];
        if (!PyBytes_CheckExact(o) || PyBytes_GET_SIZE(o) != KEY_BYTES) return 0;
        p = (const unsigned char *)PyBytes_AS_STRING(o);
    } else {
        p = (const unsigned char *)k->buf.buf + i * KEY_BYTES;
    }
    split_key(p, a, b);
    return 1;
}

#define HIDDEN __attribute__((visibility("hidden")))

/* _holders.c */
HIDDEN Slot *hl_locate(Holders *h, uint64_t a, uint64_t b);
HIDDEN int hl_code_of(const Set *s, int lane);
HIDDEN int hl_lane_arg(PyObject *obj);
/* _holders_read.c */
HIDDEN PyObject *hl_entries(Holders *h, PyObject *obj);
HIDDEN PyObject *hl_route(Holders *h, PyObject *const *args, Py_ssize_t nargs);
HIDDEN PyObject *hl_route_rows(Holders *h, PyObject *obj);
HIDDEN PyObject *hl_lane_blocks(Holders *h, PyObject *arg);
HIDDEN PyObject *hl_split(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
HIDDEN void hl_free_answers(struct AnswerMemo *memo);

#endif

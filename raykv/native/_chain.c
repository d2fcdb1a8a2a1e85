/* raykv.native._chain: build the Page and Block objects of an imported chain without running Python
 * bytecode per object (optional; raykv.core.page and raykv.core.radix fall back to Python without it).
 *
 * Page and Block are __slots__ classes. Their instances are made here the way Python makes
 * them (tp_alloc, which zero-fills the slots and tracks the object for the GC) and each slot is
 * stored at the offset its member descriptor names, so what comes out is indistinguishable from
 * objects built by __init__. `bind` checks once that every slot these functions store is a plain
 * writable object slot of that class; the functions refuse a class they were not bound to.
 * queue_chain queues an imported chain's pages for eviction in one call (raykv.core.eviction);
 * all_keys checks a batch of block keys in one loop (raykv.core.types.check_block_keys).
 * KeyMemo keys a prompt's blocks, reusing the keys of blocks it keyed before
 * (raykv.routing.session_keys).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define PAGE_FIELDS 9
#define BLOCK_FIELDS 7

static const char *page_names[PAGE_FIELDS] = {"uid", "level", "slot", "priority", "block",
                                              "pins", "leases", "holders", "queued"};
enum { P_UID, P_LEVEL, P_SLOT, P_PRIORITY, P_BLOCK, P_PINS, P_LEASES, P_HOLDERS, P_QUEUED };

static const char *block_names[BLOCK_FIELDS] = {"key", "parent", "children", "page",
                                                "ordinal", "num_tokens", "checksum"};
enum { B_KEY, B_PARENT, B_CHILDREN, B_PAGE, B_ORDINAL, B_TOKENS, B_CHECKSUM };

static PyTypeObject *page_type = NULL, *block_type = NULL;
static Py_ssize_t page_off[PAGE_FIELDS], block_off[BLOCK_FIELDS];

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* The offset of writable object slot `name` of `type`; -1 with an exception set otherwise. */
static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *descr = PyDict_GetItemString(type->tp_dict, name); /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", type->tp_name, name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name, name);
        return -1;
    }
    return member->offset;
}

static int offsets(PyTypeObject *type, const char **names, int count, Py_ssize_t *out) {
    if (type->tp_dictoffset != 0 || type->tp_itemsize != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a plain __slots__ class", type->tp_name);
        return -1;
    }
    for (int i = 0; i < count; i++) {
        out[i] = slot_offset(type, names[i]);
        if (out[i] < 0) return -1;
    }
    return 0;
}

/* bind(Page, Block): check the classes' slots and remember where they are. */
static PyObject *bind(PyObject *self, PyObject *args) {
    PyTypeObject *page, *block;
    Py_ssize_t poff[PAGE_FIELDS], boff[BLOCK_FIELDS];
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &page, &PyType_Type, &block)) return NULL;
    if (offsets(page, page_names, PAGE_FIELDS, poff) < 0) return NULL;
    if (offsets(block, block_names, BLOCK_FIELDS, boff) < 0) return NULL;
    Py_INCREF(page);
    Py_INCREF(block);
    Py_XSETREF(page_type, page);
    Py_XSETREF(block_type, block);
    memcpy(page_off, poff, sizeof(poff));
    memcpy(block_off, boff, sizeof(boff));
    Py_RETURN_NONE;
}

static PyObject *new_instance(PyTypeObject *type) { return type->tp_alloc(type, 0); }

/* make_pages(uids, level, slots, priority) -> list of Page: what
 * [Page(level, slot, priority) for slot in slots] returns, each uid next(uids). */
static PyObject *make_pages(PyObject *self, PyObject *args) {
    PyObject *uids, *level, *slots, *priority;
    if (!PyArg_ParseTuple(args, "OOO!O", &uids, &level, &PyList_Type, &slots, &priority)) return NULL;
    if (page_type == NULL) return PyErr_Format(PyExc_RuntimeError, "raykv.native._chain is not bound");
    if (!PyIter_Check(uids)) return PyErr_Format(PyExc_TypeError, "uids must be an iterator");
    Py_ssize_t n = PyList_GET_SIZE(slots);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *uid = PyIter_Next(uids);
        if (uid == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "uids ran out");
            goto fail;
        }
        PyObject *page = new_instance(page_type);
        if (page == NULL) {
            Py_DECREF(uid);
            goto fail;
        }
        SLOT(page, page_off[P_UID]) = uid;
        SLOT(page, page_off[P_LEVEL]) = Py_NewRef(level);
        SLOT(page, page_off[P_SLOT]) = Py_NewRef(PyList_GET_ITEM(slots, i));
        SLOT(page, page_off[P_PRIORITY]) = Py_NewRef(priority);
        SLOT(page, page_off[P_BLOCK]) = Py_NewRef(Py_None);
        SLOT(page, page_off[P_PINS]) = Py_NewRef(zero);
        SLOT(page, page_off[P_LEASES]) = Py_NewRef(zero);
        SLOT(page, page_off[P_HOLDERS]) = Py_NewRef(zero);
        SLOT(page, page_off[P_QUEUED]) = Py_NewRef(Py_False);
        PyList_SET_ITEM(out, i, page);
    }
    Py_DECREF(zero);
    return out;
fail:
    Py_XDECREF(zero);
    Py_DECREF(out); /* unset items are NULL: list dealloc skips them */
    return NULL;
}

/* link_chain(parent, keys, pages, tokens, ordinal) -> list of Block: a Block per key, the first
 * a child of `parent` (any object with a `children` dict), each later one a child of the one
 * before; block i gets page i (whose `block` becomes it), tokens i and ordinal `ordinal + i`.
 * `keys`, `pages` and `tokens` are lists or tuples of one length (TypeError or ValueError,
 * nothing changed, otherwise). None, nothing changed, when a page backs a block already. The
 * caller checks beforehand that the keys are new, distinct and hashable (bytes): then only
 * running out of memory can stop it midway. */
static int list_or_tuple(PyObject *obj, const char *name) {
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a list or a tuple", name);
    return -1;
}

static PyObject *link_chain(PyObject *self, PyObject *args) {
    PyObject *parent, *keys, *pages, *tokens, *ordinal;
    if (!PyArg_ParseTuple(args, "OOOOO!", &parent, &keys, &pages, &tokens, &PyLong_Type, &ordinal))
        return NULL;
    if (block_type == NULL) return PyErr_Format(PyExc_RuntimeError, "raykv.native._chain is not bound");
    if (list_or_tuple(keys, "keys") || list_or_tuple(pages, "pages") || list_or_tuple(tokens, "tokens"))
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(pages) != n || PySequence_Fast_GET_SIZE(tokens) != n)
        return PyErr_Format(PyExc_ValueError, "a chain needs one page and one token count per key");
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *page = PySequence_Fast_GET_ITEM(pages, i);
        if (!Py_IS_TYPE(page, page_type)) return PyErr_Format(PyExc_TypeError, "pages[%zd] is not a Page", i);
        if (SLOT(page, page_off[P_BLOCK]) != Py_None) Py_RETURN_NONE; /* backs a block already */
    }
    PyObject *children = PyObject_GetAttrString(parent, "children");
    if (children == NULL) return NULL;
    if (!PyDict_CheckExact(children)) {
        Py_DECREF(children);
        return PyErr_Format(PyExc_TypeError, "the parent's children must be a dict");
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(children);
        return NULL;
    }
    long long first = PyLong_AsLongLong(ordinal);
    if (first == -1 && PyErr_Occurred()) goto fail;
    PyObject *node = parent; /* borrowed: the caller's, then blocks held by `out` */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i), *page = PySequence_Fast_GET_ITEM(pages, i);
        PyObject *kids = PyDict_New();
        PyObject *ord = PyLong_FromLongLong(first + i);
        PyObject *block = (kids && ord) ? new_instance(block_type) : NULL;
        if (block == NULL) {
            Py_XDECREF(kids);
            Py_XDECREF(ord);
            goto fail;
        }
        SLOT(block, block_off[B_KEY]) = Py_NewRef(key);
        SLOT(block, block_off[B_PARENT]) = Py_NewRef(node);
        SLOT(block, block_off[B_CHILDREN]) = kids;
        SLOT(block, block_off[B_PAGE]) = Py_NewRef(page);
        SLOT(block, block_off[B_ORDINAL]) = ord;
        SLOT(block, block_off[B_TOKENS]) = Py_NewRef(PySequence_Fast_GET_ITEM(tokens, i));
        SLOT(block, block_off[B_CHECKSUM]) = Py_NewRef(Py_None);
        PyList_SET_ITEM(out, i, block);
        if (PyDict_SetItem(children, key, block) < 0) goto fail;
        Py_SETREF(children, Py_NewRef(kids));
        Py_XSETREF(SLOT(page, page_off[P_BLOCK]), Py_NewRef(block));
        node = block;
    }
    Py_DECREF(children);
    return out;
fail:
    Py_DECREF(children);
    Py_DECREF(out);
    return NULL;
}

/* Whether slot value `have` (NULL when unset) equals `want`: 1, 0, or -1 with an exception. */
static int same_value(PyObject *have, PyObject *want) {
    if (have == NULL) return 0;
    return have == want ? 1 : PyObject_RichCompareBool(have, want, Py_EQ);
}

/* queue_chain(queue, pages, level, priority) -> bool: PriorityLRU.add_many's usual batch (an
 * imported chain) in one call. When every item of `pages` (a list) is a Page that is not queued
 * (`queued` is False) and has level `level` and priority `priority`: queue[page.uid] = page for
 * each in order, each page's `queued` becomes True, True is returned. Otherwise nothing changes
 * and False is returned (the caller takes its general path). Only running out of memory can
 * stop it midway. */
static PyObject *queue_chain(PyObject *self, PyObject *args) {
    PyObject *queue, *pages, *level, *priority;
    if (!PyArg_ParseTuple(args, "OO!OO", &queue, &PyList_Type, &pages, &level, &priority)) return NULL;
    if (page_type == NULL) return PyErr_Format(PyExc_RuntimeError, "raykv.native._chain is not bound");
    Py_ssize_t n = PyList_GET_SIZE(pages);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *page = PyList_GET_ITEM(pages, i);
        if (!Py_IS_TYPE(page, page_type) || SLOT(page, page_off[P_QUEUED]) != Py_False ||
            SLOT(page, page_off[P_UID]) == NULL)
            Py_RETURN_FALSE;
        int same = same_value(SLOT(page, page_off[P_LEVEL]), level);
        if (same > 0) same = same_value(SLOT(page, page_off[P_PRIORITY]), priority);
        if (same < 0) return NULL;
        if (same == 0) Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *page = PyList_GET_ITEM(pages, i);
        if (PyObject_SetItem(queue, SLOT(page, page_off[P_UID]), page) < 0) return NULL;
        Py_SETREF(SLOT(page, page_off[P_QUEUED]), Py_NewRef(Py_True));
    }
    Py_RETURN_TRUE;
}

/* all_keys(keys): True when `keys` (a list or tuple) holds only exact bytes objects of 32 bytes:
 * types.check_block_keys' fast pass in one C loop (it falls back to its checks otherwise). */
static PyObject *all_keys(PyObject *Py_UNUSED(module), PyObject *keys) {
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys)) Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != 32) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* ---- KeyMemo: block keys of a chain, remembering the blocks keyed before ------------------------
 * KeyMemo(tokens_per_block, slots, sha256) keeps up to `slots` (a power of two) blocks it keyed:
 * each slot holds a parent key, the block's tokens and its key, SHA-256(parent || tokens as u32
 * little-endian) computed by `sha256` (hashlib.sha256). chain(parent, tokens, first_block) returns
 * the keys of the full blocks of `tokens` (a C-contiguous buffer of 4-byte unsigned token ids)
 * from `first_block` on, chained from `parent` (the key of block first_block - 1, or the root key):
 * the keys raykv.core.keys.chain_keys gives. A block whose parent key and tokens equal a slot's,
 * compared in full, reuses its key (a hit); another is hashed (a miss) and replaces the least
 * recently used slot of its bucket (MEMO_WAYS slots, fewer when `slots` is smaller). The bucket
 * and a 32-bit tag come from 4 of the block's tokens, so colliding blocks only cost misses: a key
 * is never taken from a block that is not equal. A token above 2**31 - 1 anywhere (a hashed block
 * or the trailing partial one; a hit's tokens equal tokens checked before) raises ValueError.
 * `hits` and `misses` count blocks.
 *
 * Memory: the tags (16 bytes a slot: one or two cache lines a bucket) apart from the slots' data
 * (parent and tokens, cache-line aligned), on transparent huge pages where the OS offers them (a
 * memo larger than the caches is read from memory: one TLB entry covers 2 MiB of it). A chain
 * fetches the tags of a block MEMO_FAR blocks ahead and the data of the slots whose tag matches
 * (usually one) MEMO_NEAR blocks ahead, so only the slot that is compared is read. */
#include <sys/mman.h>

#define MAX_TOKEN 0x7FFFFFFFu
#define MEMO_WAYS 8 /* slots per bucket */
#define MEMO_FAR 8  /* blocks whose bucket tags are fetched ahead of the one compared */
#define MEMO_NEAR 2 /* blocks whose matching slots' data are fetched ahead */
#define MEMO_RING 16 /* > MEMO_FAR: hashes of the blocks ahead, by block number */
#define HUGE_PAGE ((size_t)2 << 20)

typedef struct {
    uint32_t tag;  /* from the block's sampled tokens (any value; key NULL: empty) */
    uint32_t used; /* the memo's clock when last filled or hit (wraps; compared as an age) */
    PyObject *key; /* the block's key (32-byte bytes), owned; NULL when empty */
} MemoTag;

typedef struct {
    PyObject_HEAD
    MemoTag *tags;
    char *data;           /* per slot: parent key (32 bytes), then tpb uint32 tokens */
    void *map;            /* the mapping holding both (NULL: PyMem) */
    size_t map_len;
    Py_ssize_t nslots, ways, tpb, stride;
    uint64_t bucket_mask;
    PyObject *sha256;
    uint32_t clock;
    long long hits, misses;
} KeyMemo;

#define MEMO_DATA(m, i) ((m)->data + (size_t)(i) * (size_t)(m)->stride)

static uint64_t memo_hash64(const uint32_t *toks, Py_ssize_t tpb) {
    uint64_t h = ((uint64_t)toks[0] << 32 | toks[tpb / 2]) * 0x9E3779B97F4A7C15ULL;
    h ^= ((uint64_t)toks[tpb - 1] << 32 | toks[tpb / 4]) * 0xC2B2AE3D27D4EB4FULL;
    return h ^ (h >> 29);
}

static int tokens_ok(const uint32_t *toks, Py_ssize_t n) {
    uint32_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) any |= toks[i];
    return !(any & ~MAX_TOKEN);
}

/* SHA-256(parent || toks) through the Python constructor: a new 32-byte bytes, or NULL. */
static PyObject *memo_hash(KeyMemo *m, const unsigned char *parent, const uint32_t *toks) {
    Py_ssize_t body = m->tpb * 4;
    PyObject *data = PyBytes_FromStringAndSize(NULL, 32 + body);
    if (!data) return NULL;
    memcpy(PyBytes_AS_STRING(data), parent, 32);
    memcpy(PyBytes_AS_STRING(data) + 32, toks, (size_t)body); /* x86 and arm64 Linux: little-endian */
    PyObject *h = PyObject_CallOneArg(m->sha256, data);
    Py_DECREF(data);
    if (!h) return NULL;
    PyObject *key = PyObject_CallMethod(h, "digest", NULL);
    Py_DECREF(h);
    if (key && (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != 32)) {
        Py_DECREF(key);
        PyErr_SetString(PyExc_TypeError, "sha256(...).digest() must give 32 bytes");
        return NULL;
    }
    return key;
}

/* The first slot of a block's bucket (from its hash: the low bits pick the bucket, the high
 * 32 are its tag), so the buckets of a whole prompt are known before any key is. */
static inline Py_ssize_t memo_bucket(const KeyMemo *m, uint64_t h) {
    return (Py_ssize_t)(h & m->bucket_mask) * m->ways;
}

static void prefetch_lines(const void *at, size_t len, int write) {
    const char *p = (const char *)((uintptr_t)at & ~(uintptr_t)63), *end = (const char *)at + len;
    for (; p < end; p += 64) {
        if (write)
            __builtin_prefetch(p, 1);
        else
            __builtin_prefetch(p);
    }
}

/* Fetch the data (and key object) of every slot of the block's bucket whose tag matches. */
static void memo_fetch_matches(KeyMemo *m, uint64_t h) {
    Py_ssize_t first = memo_bucket(m, h);
    const MemoTag *t = m->tags + first;
    for (Py_ssize_t w = 0; w < m->ways; w++)
        if (t[w].key && t[w].tag == (uint32_t)(h >> 32)) {
            prefetch_lines(MEMO_DATA(m, first + w), (size_t)m->stride, 0);
            prefetch_lines(t[w].key, sizeof(PyBytesObject) + 32, 1); /* its refcount is written */
        }
}

/* The key of one block (a new reference), from the memo or hashed and remembered. */
static PyObject *memo_key(KeyMemo *m, const unsigned char *parent, const uint32_t *toks, uint64_t h) {
    size_t body = (size_t)m->tpb * 4;
    Py_ssize_t first = memo_bucket(m, h), victim = first;
    MemoTag *t = m->tags + first;
    uint32_t tag = (uint32_t)(h >> 32), now = ++m->clock, oldest = 0;
    for (Py_ssize_t w = 0; w < m->ways; w++) {
        if (!t[w].key) {
            victim = first + w, oldest = UINT32_MAX; /* an empty slot goes first */
            continue;
        }
        const char *d = MEMO_DATA(m, first + w);
        if (t[w].tag == tag && memcmp(d, parent, 32) == 0 && memcmp(d + 32, toks, body) == 0) {
            m->hits++;
            t[w].used = now;
            return Py_NewRef(t[w].key);
        }
        if (now - t[w].used > oldest) victim = first + w, oldest = now - t[w].used;
    }
    if (!tokens_ok(toks, m->tpb)) {
        PyErr_SetString(PyExc_ValueError, "token ids must be in 0..2**31-1");
        return NULL;
    }
    PyObject *key = memo_hash(m, parent, toks);
    if (!key) return NULL;
    m->misses++;
    MemoTag *s = &m->tags[victim];
    Py_XSETREF(s->key, Py_NewRef(key));
    s->tag = tag;
    s->used = now;
    memcpy(MEMO_DATA(m, victim), parent, 32);
    memcpy(MEMO_DATA(m, victim) + 32, toks, body);
    return key;
}

/* The keys of blocks first..last-1 of toks (a new list), chained from parent. */
static PyObject *memo_chain(KeyMemo *m, const unsigned char *parent, const uint32_t *toks, Py_ssize_t first,
                            Py_ssize_t last) {
    Py_ssize_t tpb = m->tpb;
    uint64_t ring[MEMO_RING];
    PyObject *out = PyList_New(first < last ? last - first : 0);
    for (Py_ssize_t b = first; out && b < last; b++) {
        for (Py_ssize_t k = b == first ? b : b + MEMO_FAR; k <= b + MEMO_FAR && k < last; k++) {
            ring[k % MEMO_RING] = memo_hash64(toks + k * tpb, tpb);
            prefetch_lines(m->tags + memo_bucket(m, ring[k % MEMO_RING]), (size_t)m->ways * sizeof(MemoTag), 1);
        }
        if (b == first)
            for (Py_ssize_t k = b; k < b + MEMO_NEAR && k < last; k++) memo_fetch_matches(m, ring[k % MEMO_RING]);
        if (b + MEMO_NEAR < last) memo_fetch_matches(m, ring[(b + MEMO_NEAR) % MEMO_RING]);
        PyObject *key = memo_key(m, parent, toks + b * tpb, ring[b % MEMO_RING]);
        if (!key) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, b - first, key);
        parent = (const unsigned char *)PyBytes_AS_STRING(key);
    }
    return out;
}

static PyObject *KeyMemo_chain(KeyMemo *m, PyObject *args) {
    const char *parent;
    Py_ssize_t parent_len, first;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y#y*n", &parent, &parent_len, &buf, &first)) return NULL;
    PyObject *out = NULL;
    if (parent_len != 32 || first < 0 || (buf.itemsize != 1 && buf.itemsize != 4) || buf.len % 4 ||
        !PyBuffer_IsContiguous(&buf, 'C')) {
        PyErr_SetString(PyExc_ValueError, "chain(parent: 32 bytes, tokens: contiguous u32 buffer, first_block >= 0)");
        goto done;
    }
    const uint32_t *toks = (const uint32_t *)buf.buf;
    Py_ssize_t n = buf.len / 4, last = n / m->tpb;
    if (!tokens_ok(toks + last * m->tpb, n - last * m->tpb)) {
        PyErr_SetString(PyExc_ValueError, "token ids must be in 0..2**31-1");
        goto done;
    }
    out = memo_chain(m, (const unsigned char *)parent, toks, first, last);
done:
    PyBuffer_Release(&buf);
    return out;
}

/* Zeroed memory for the tags and the data: an anonymous mapping on 2 MiB boundaries, marked for
 * huge pages, where there is one; else PyMem_Calloc. -1 with MemoryError set on failure. */
static int memo_alloc(KeyMemo *m) {
    size_t tags = ((size_t)m->nslots * sizeof(MemoTag) + 63) & ~(size_t)63;
    size_t len = tags + (size_t)m->nslots * (size_t)m->stride;
    char *at = NULL;
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    if (len >= HUGE_PAGE) {
        size_t map_len = len + HUGE_PAGE;
        void *map = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map != MAP_FAILED) {
            m->map = map, m->map_len = map_len;
            at = (char *)(((uintptr_t)map + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
            (void)madvise(at, len, MADV_HUGEPAGE); /* a hint: without it, 4 KiB pages */
        }
    }
#endif
    if (!at) {
        at = PyMem_Calloc(1, len + 63);
        if (!at) {
            PyErr_NoMemory();
            return -1;
        }
        m->map = NULL, m->map_len = 0;
        m->tags = (MemoTag *)at; /* PyMem_Free's pointer; the data start on the next line */
        m->data = (char *)(((uintptr_t)at + tags + 63) & ~(uintptr_t)63);
        return 0;
    }
    m->tags = (MemoTag *)at;
    m->data = at + tags;
    return 0;
}

static PyObject *KeyMemo_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t tpb, nslots;
    PyObject *sha256;
    if (kwds && PyDict_GET_SIZE(kwds)) return PyErr_Format(PyExc_TypeError, "KeyMemo takes positional arguments");
    if (!PyArg_ParseTuple(args, "nnO", &tpb, &nslots, &sha256)) return NULL;
    if (tpb < 1 || nslots < 2 || (nslots & (nslots - 1)) || !PyCallable_Check(sha256))
        return PyErr_Format(PyExc_ValueError, "KeyMemo(tokens_per_block >= 1, slots: a power of two >= 2, sha256)");
    KeyMemo *m = (KeyMemo *)type->tp_alloc(type, 0);
    if (!m) return NULL;
    m->tpb = tpb;
    m->stride = (Py_ssize_t)((32 + (size_t)tpb * 4 + 63) & ~(size_t)63);
    m->nslots = nslots;
    m->ways = nslots < MEMO_WAYS ? nslots : MEMO_WAYS;
    m->bucket_mask = (uint64_t)(nslots / m->ways - 1);
    if (memo_alloc(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    m->sha256 = Py_NewRef(sha256);
    return (PyObject *)m;
}

static void KeyMemo_dealloc(KeyMemo *m) {
    if (m->tags)
        for (Py_ssize_t i = 0; i < m->nslots; i++) Py_XDECREF(m->tags[i].key);
    if (m->map)
        munmap(m->map, m->map_len);
    else
        PyMem_Free(m->tags);
    Py_XDECREF(m->sha256);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef KeyMemo_methods[] = {
    {"chain", (PyCFunction)KeyMemo_chain, METH_VARARGS,
     "chain(parent, tokens, first_block) -> keys of the full blocks from first_block (see source)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef KeyMemo_members[] = {
    {"hits", T_LONGLONG, offsetof(KeyMemo, hits), READONLY, "blocks whose key came from the memo"},
    {"misses", T_LONGLONG, offsetof(KeyMemo, misses), READONLY, "blocks hashed"},
    {"slots", T_PYSSIZET, offsetof(KeyMemo, nslots), READONLY, "blocks it can remember"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject KeyMemoType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "raykv.native._chain.KeyMemo",
    .tp_basicsize = sizeof(KeyMemo),
    .tp_dealloc = (destructor)KeyMemo_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block keys of a chain with a memo of recent blocks (see raykv.routing.session_keys).",
    .tp_methods = KeyMemo_methods,
    .tp_members = KeyMemo_members,
    .tp_new = KeyMemo_new,
};

static PyMethodDef methods[] = {
    {"queue_chain", queue_chain, METH_VARARGS,
     "queue_chain(queue, pages, level, priority) -> whether the pages were queued (see source)."},
    {"all_keys", all_keys, METH_O, "all_keys(keys) -> whether every item is a bytes of exactly 32 bytes."},
    {"bind", bind, METH_VARARGS, "bind(Page, Block): check and remember the classes' slots."},
    {"make_pages", make_pages, METH_VARARGS,
     "make_pages(uids, level, slots, priority) -> [Page(level, slot, priority) for slot in slots]."},
    {"link_chain", link_chain, METH_VARARGS,
     "link_chain(parent, keys, pages, tokens, ordinal) -> the new chain's blocks (see source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "raykv.native._chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) {
    if (PyType_Ready(&KeyMemoType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "KeyMemo", (PyObject *)&KeyMemoType) < 0) Py_CLEAR(m);
    return m;
}

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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }

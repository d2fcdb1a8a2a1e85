/* raykv.native._slots: plan a batch of page copies in one pass (optional; raykv.core.tiers.slots
 * does the same with numpy without it).
 *
 * A GPU tier copy batch is two int64 slot arrays, source and destination. Before it is enqueued,
 * the copier needs how many runs (pages consecutive on both sides) the batch has, to choose the
 * DMA engines or the copy kernel, and the kernel needs both arrays side by side in its argument
 * table (page-locked memory). With numpy that is seven passes over the arrays and more than half
 * of the host time before a 1 GiB batch of 64 KiB pages starts on the GPU; here it is one.
 *
 * pack(src, dst, out) -> runs: writes src into out[0:n] and dst into out[n:2n] as int32 and
 *     returns the number of runs (0 for n == 0). src and dst: C-contiguous 1-D int64 buffers of
 *     equal length n; out: a writable C-contiguous int32 buffer of at least 2n items. Nothing is
 *     written unless all three are valid (TypeError for a wrong item type or shape, ValueError
 *     for differing lengths, a short out, or a slot outside 0..2**31-1).
 * run_starts(src, dst, out) -> count: the indices where a run starts (always 0 first when n > 0)
 *     written into out[0:count] (out: writable int64 buffer of at least n items).
 * pack_ids(first, second, out, first_limit, second_limit) -> n: the block copy kernel's table from
 *     two sequences of ints (lists, tuples or 1-D int64 arrays) of equal length n: first into
 *     out[0:n] (None: 0, 1, .. n-1) and second into out[n:2n], as int32. Every item of first must
 *     be in 0..first_limit-1 and of second in 0..second_limit-1 (limits at most 2**31). Nothing
 *     is written unless all are (ValueError for a length, a short out or an item out of range,
 *     TypeError for an item that is not an int). Lists of Python ints are read without building
 *     numpy arrays: that conversion and its range checks took 20-27 us of a 64 MiB engine load.
 * The int32 table halves the bytes written and uploaded per batch (a pool never has 2**31 pages).
 * The GIL is held throughout: the arrays are small (a 1 GiB batch of 64 KiB pages is 16,384
 * slots, 20 us).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Fill `view` with a C-contiguous 1-D buffer of `obj` of 8-byte (or, `narrow`, 4-byte) signed
 * integers, writable when asked; 0 or -1. */
static int int_view(PyObject *obj, Py_buffer *view, int writable, int narrow, const char *name) {
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') {
        fmt++;
    }
    int size = narrow ? 4 : 8;
    int ok = view->ndim == 1 && view->itemsize == size && fmt[1] == '\0' &&
             (fmt[0] == 'q' || fmt[0] == 'l' || fmt[0] == 'i');
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D int%d array", name, 8 * size);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Get the three views; on success the caller releases all three. */
static int three_views(PyObject *args, Py_buffer *src, Py_buffer *dst, Py_buffer *out, Py_ssize_t factor,
                       int narrow) {
    PyObject *a, *b, *c;
    if (!PyArg_ParseTuple(args, "OOO", &a, &b, &c)) {
        return -1;
    }
    if (int_view(a, src, 0, 0, "src") < 0) {
        return -1;
    }
    if (int_view(b, dst, 0, 0, "dst") < 0) {
        PyBuffer_Release(src);
        return -1;
    }
    if (int_view(c, out, 1, narrow, "out") < 0) {
        PyBuffer_Release(src);
        PyBuffer_Release(dst);
        return -1;
    }
    Py_ssize_t n = src->shape[0];
    const char *problem = NULL;
    if (dst->shape[0] != n) {
        problem = "src and dst differ in length";
    } else if (out->shape[0] < factor * n) {
        problem = "out is too short";
    }
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        PyBuffer_Release(src);
        PyBuffer_Release(dst);
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    Py_buffer src, dst, out;
    if (three_views(args, &src, &dst, &out, 2, 1) < 0) {
        return NULL;
    }
    Py_ssize_t n = src.shape[0], runs = n > 0 ? 1 : 0;
    const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf;
    int32_t *o = (int32_t *)out.buf;
    uint64_t high = 0; /* any bit at or above bit 31 of any slot (negative ones included) */
    for (Py_ssize_t i = 0; i < n; i++) {
        high |= ((uint64_t)s[i] | (uint64_t)d[i]) >> 31;
        if (i > 0) {
            runs += (s[i] != s[i - 1] + 1) | (d[i] != d[i - 1] + 1);
        }
    }
    if (high == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            o[i] = (int32_t)s[i];
            o[n + i] = (int32_t)d[i];
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&out);
    if (high != 0) {
        PyErr_SetString(PyExc_ValueError, "a slot is outside 0..2**31-1");
        return NULL;
    }
    return PyLong_FromSsize_t(runs);
}

static PyObject *run_starts(PyObject *self, PyObject *args) {
    Py_buffer src, dst, out;
    if (three_views(args, &src, &dst, &out, 1, 0) < 0) {
        return NULL;
    }
    Py_ssize_t n = src.shape[0], count = 0;
    const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf;
    int64_t *o = (int64_t *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || s[i] != s[i - 1] + 1 || d[i] != d[i - 1] + 1) {
            o[count++] = i;
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(count);
}

/* Item i of `seq` (a tuple), of `view` (int64), or of 0..n-1 (both NULL) as a C long long; -1 with an error
 * set when it is not an int (a Python int of any size is read; out-of-range ones are caught by
 * the caller's limit check through overflow). */
static int item_at(PyObject *seq, Py_buffer *view, Py_ssize_t i, long long *value) {
    if (view != NULL) {
        *value = ((const int64_t *)view->buf)[i];
        return 0;
    }
    if (seq == NULL) {
        *value = i;
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(seq, i), &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *value = overflow ? -1 : v; /* any int too large for 64 bits is out of range */
    return 0;
}

/* One input of pack_ids: a 1-D int64 buffer (view filled, *seq NULL), None (both NULL) or a
 * sequence (*seq a new reference). 0 or -1. */
static int ids_input(PyObject *obj, PyObject **seq, Py_buffer *view, int *is_view, const char *name) {
    *seq = NULL;
    *is_view = 0;
    if (obj == Py_None) {
        return 0;
    }
    if (PyObject_CheckBuffer(obj)) {
        if (int_view(obj, view, 0, 0, name) < 0) {
            return -1;
        }
        *is_view = 1;
        return 0;
    }
    *seq = PySequence_Tuple(obj); /* a tuple: items converted by __index__ cannot resize it */
    return *seq == NULL ? -1 : 0;
}

static Py_ssize_t ids_length(PyObject *seq, Py_buffer *view, int is_view, Py_ssize_t other) {
    if (is_view) {
        return view->shape[0];
    }
    return seq != NULL ? PyTuple_GET_SIZE(seq) : other;
}

/* Check every item of one input against its limit, then (write) store them at o. 0 or -1. */
static int ids_pass(PyObject *seq, Py_buffer *view, Py_ssize_t n, long long limit, int32_t *o, int write,
                    const char *name) {
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        if (item_at(seq, view, i, &v) < 0) {
            return -1;
        }
        if (!write && (v < 0 || v >= limit)) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is outside 0..%lld", name, i, limit - 1);
            return -1;
        }
        if (write) {
            o[i] = (int32_t)v;
        }
    }
    return 0;
}

static PyObject *pack_ids(PyObject *self, PyObject *args) {
    PyObject *a, *b, *c, *sa = NULL, *sb = NULL, *result = NULL;
    long long la, lb;
    Py_buffer va, vb, out;
    int ia = 0, ib = 0, have_out = 0;
    if (!PyArg_ParseTuple(args, "OOOLL", &a, &b, &c, &la, &lb)) {
        return NULL;
    }
    if (la < 1 || lb < 1 || la > ((long long)1 << 31) || lb > ((long long)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "limits must be in 1..2**31");
        return NULL;
    }
    if (b == Py_None) {
        PyErr_SetString(PyExc_TypeError, "second must be a sequence of ints");
        return NULL;
    }
    if (ids_input(a, &sa, &va, &ia, "first") < 0 || ids_input(b, &sb, &vb, &ib, "second") < 0) {
        goto done;
    }
    if (int_view(c, &out, 1, 1, "out") < 0) {
        goto done;
    }
    have_out = 1;
    Py_ssize_t n = ids_length(sb, &vb, ib, 0);
    Py_buffer *pa = ia ? &va : NULL, *pb = ib ? &vb : NULL;
    if (ids_length(sa, &va, ia, n) != n) {
        PyErr_SetString(PyExc_ValueError, "first and second differ in length");
        goto done;
    }
    if (out.shape[0] < 2 * n) {
        PyErr_SetString(PyExc_ValueError, "out is too short");
        goto done;
    }
    int32_t *o = (int32_t *)out.buf;
    if (ids_pass(sa, pa, n, la, o, 0, "first") < 0 || ids_pass(sb, pb, n, lb, o + n, 0, "second") < 0) {
        goto done;
    }
    ids_pass(sa, pa, n, la, o, 1, "first");
    ids_pass(sb, pb, n, lb, o + n, 1, "second");
    result = PyLong_FromSsize_t(n);
done:
    Py_XDECREF(sa);
    Py_XDECREF(sb);
    if (ia) {
        PyBuffer_Release(&va);
    }
    if (ib) {
        PyBuffer_Release(&vb);
    }
    if (have_out) {
        PyBuffer_Release(&out);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(src, dst, out) -> runs: out[:n] = src, out[n:2n] = dst."},
    {"pack_ids", pack_ids, METH_VARARGS, "pack_ids(first, second, out, first_limit, second_limit) -> n."},
    {"run_starts", run_starts, METH_VARARGS, "run_starts(src, dst, out) -> count of run starts written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "raykv.native._slots", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slots(void) { return PyModule_Create(&module); }

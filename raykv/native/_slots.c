/* raykv.native._slots: plan a batch of page copies in one pass (optional; raykv.core.tiers.slots
 * does the same with numpy without it).
 *
 * A GPU tier copy batch is two int64 slot arrays, source and destination. Before it is enqueued,
 * the copier needs how many runs (pages consecutive on both sides) the batch has, to choose the
 * DMA engines or the copy kernel, and the kernel needs both arrays side by side in its argument
 * table (page-locked memory). With numpy that is seven passes over the arrays and more than half
 * of the host time before a 1 GiB batch of 64 KiB pages starts on the GPU; here it is one.
 *
 * pack(src, dst, out[, cap]) -> runs: writes src into out[0:n] and dst into out[n:2n] as int32
 *     and returns the number of runs (0 for n == 0), or `cap` when there are at least that many
 *     (cap >= 0: the count stops there, so a scattered batch is not scanned for runs past it).
 *     src and dst: C-contiguous 1-D int64 buffers of equal length n; out: a writable
 *     C-contiguous int32 buffer of at least 2n items. Nothing is written unless all three are
 *     valid (TypeError for a wrong item type or shape, ValueError for differing lengths, a short
 *     out, or a slot outside 0..2**31-1).
 * run_starts(src, dst, out) -> count: the indices where a run starts (always 0 first when n > 0)
 *     written into out[0:count] (out: writable int64 buffer of at least n items).
 * pack_ids(first, second, out, first_limit, second_limit) -> n: the block copy kernel's table from
 *     two sequences of ints (lists, tuples or 1-D int64 arrays) of equal length n: first into
 *     out[0:n] (None: 0, 1, .. n-1) and second into out[n:2n], as int32. Every item of first must
 *     be in 0..first_limit-1 and of second in 0..second_limit-1 (limits at most 2**31). Nothing
 *     is written unless all are (ValueError for a length, a short out or an item out of range,
 *     TypeError for an item that is not an int). Lists of Python ints are read without building
 *     numpy arrays: that conversion and its range checks took 20-27 us of a 64 MiB engine load.
 * pack_launch(launch, function, grid_x, grid_y, threads, stream, params, table, capacity, first,
 *     second, first_limit, second_limit) -> CUresult: pack_ids into the int32 array at address
 *     `table` (capacity items: a kernel argument passed by value, which `params`, the launch's
 *     argument pointer array, points at), then call cuLaunchKernel at address `launch` with
 *     `function`, grid (grid_x, grid_y, 1), `threads` threads and `stream`. Raises as pack_ids,
 *     before launching; returns the driver's result. One call instead of a pack and a ctypes
 *     launch: 5 + 7 us of the 17 us of host work before a small engine load starts.
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

/* Runs of (s, d) (pages consecutive on both sides), counted no further than `cap` (< 0: all).
 * Blocks of 256 pairs keep the inner loop branch-free; the cap is checked between blocks. */
static Py_ssize_t count_runs(const int64_t *s, const int64_t *d, Py_ssize_t n, Py_ssize_t cap) {
    if (n == 0) {
        return 0;
    }
    int64_t runs = 1; /* slots below 2**31: the differences cannot overflow */
    if (cap >= 0 && runs >= cap) {
        return cap;
    }
    Py_ssize_t i = 1;
    while (i < n) {
        Py_ssize_t end = n - i > 256 ? i + 256 : n;
        int64_t breaks = 0;
        for (; i < end; i++) {
            breaks += (s[i] - s[i - 1] != 1) | (d[i] - d[i - 1] != 1);
        }
        runs += breaks;
        if (cap >= 0 && runs >= cap) {
            return cap;
        }
    }
    return (Py_ssize_t)runs;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    Py_buffer src, dst, out;
    Py_ssize_t cap = -1;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs == 4) {
        cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 3));
        if (cap == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    PyObject *three = nargs == 4 ? PyTuple_GetSlice(args, 0, 3) : (Py_INCREF(args), args);
    if (three == NULL) {
        return NULL;
    }
    int bad = three_views(three, &src, &dst, &out, 2, 1) < 0;
    Py_DECREF(three);
    if (bad) {
        return NULL;
    }
    Py_ssize_t n = src.shape[0], runs = 0;
    const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf;
    int32_t *o = (int32_t *)out.buf;
    /* Three branch-free passes the compiler vectorizes (one fused loop with a run test did not:
     * 26 us for 16,384 slots on the H200 host, against 5 us for numpy's conversion alone). */
    uint64_t high = 0; /* any bit at or above bit 31 of any slot (negative ones included) */
    for (Py_ssize_t i = 0; i < n; i++) {
        high |= (uint64_t)s[i] | (uint64_t)d[i];
    }
    high >>= 31;
    if (high == 0) {
        runs = count_runs(s, d, n, cap);
        for (Py_ssize_t i = 0; i < n; i++) {
            o[i] = (int32_t)s[i];
        }
        for (Py_ssize_t i = 0; i < n; i++) {
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

/* fill_int64(seq, out) -> count: the leading items of a list or tuple that are exact ints within
 * int64, into the int64 buffer out (at least len(seq) items); stops at the first other item, so no
 * Python code runs (the caller converts the rest, or all, another way). */
static PyObject *fill_int64(PyObject *self, PyObject *args) {
    PyObject *seq, *c;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OO", &seq, &c)) {
        return NULL;
    }
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_SetString(PyExc_TypeError, "seq must be a list or a tuple");
        return NULL;
    }
    if (int_view(c, &out, 1, 0, "out") < 0) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    if (out.shape[0] < n) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "out is too short");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t *o = (int64_t *)out.buf;
    for (; i < n; i++) {
        if (!PyLong_CheckExact(items[i])) {
            break;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) {
            break;
        }
        o[i] = v;
    }
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(i);
}

/* spans(src, dst, src_base, dst_base, page_bytes, out_dst, out_src, out_sizes) -> runs: each run's
 * DMA descriptor (destination address, source address, bytes) into the uint64 outputs (n items
 * each), in one pass. */
static PyObject *spans(PyObject *self, PyObject *args) {
    PyObject *a, *b, *od, *os, *oz;
    unsigned long long src_base, dst_base, page;
    Py_buffer src, dst, vd, vs, vz;
    if (!PyArg_ParseTuple(args, "OOKKKOOO", &a, &b, &src_base, &dst_base, &page, &od, &os, &oz)) {
        return NULL;
    }
    if (int_view(a, &src, 0, 0, "src") < 0) {
        return NULL;
    }
    if (int_view(b, &dst, 0, 0, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int got = 0;
    Py_buffer *views[3] = {&vd, &vs, &vz};
    PyObject *outs[3] = {od, os, oz};
    for (; got < 3; got++) { /* uint64 outputs: 'Q'/'L' formats are read as 8-byte integers */
        if (PyObject_GetBuffer(outs[got], views[got], PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            break;
        }
        if (views[got]->ndim != 1 || views[got]->itemsize != 8 || views[got]->shape[0] < src.shape[0]) {
            PyBuffer_Release(views[got]);
            PyErr_SetString(PyExc_ValueError, "outputs must be 1-D 8-byte buffers of at least n items");
            break;
        }
    }
    Py_ssize_t n = src.shape[0], count = 0;
    int ok = got == 3 && dst.shape[0] == n;
    if (got == 3 && !ok) {
        PyErr_SetString(PyExc_ValueError, "src and dst differ in length");
    }
    if (ok) {
        const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf;
        uint64_t *pd = (uint64_t *)vd.buf, *ps = (uint64_t *)vs.buf, *pz = (uint64_t *)vz.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i == 0 || s[i] != s[i - 1] + 1 || d[i] != d[i - 1] + 1) {
                pd[count] = dst_base + (uint64_t)d[i] * page;
                ps[count] = src_base + (uint64_t)s[i] * page;
                pz[count++] = page;
            } else {
                pz[count - 1] += page;
            }
        }
    }
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(views[k]);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return ok ? PyLong_FromSsize_t(count) : NULL;
}

/* One input of pack_ids: a list or tuple (read in place), a 1-D int64 buffer, None (0..n-1), or
 * any other sequence (read as a tuple). */
typedef struct {
    PyObject *seq; /* a new reference: a list or a tuple; NULL for a buffer or None */
    Py_buffer view;
    int is_view;
} ids_t;

static int ids_open(PyObject *obj, ids_t *in, const char *name) {
    in->seq = NULL;
    in->is_view = 0;
    if (obj == Py_None) {
        return 0;
    }
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        Py_INCREF(obj);
        in->seq = obj;
        return 0;
    }
    if (PyObject_CheckBuffer(obj)) {
        if (int_view(obj, &in->view, 0, 0, name) < 0) {
            return -1;
        }
        in->is_view = 1;
        return 0;
    }
    in->seq = PySequence_Tuple(obj);
    return in->seq == NULL ? -1 : 0;
}

static Py_ssize_t ids_len(ids_t *in, Py_ssize_t other) {
    if (in->is_view) {
        return in->view.shape[0];
    }
    return in->seq != NULL ? PySequence_Fast_GET_SIZE(in->seq) : other;
}

static void ids_close(ids_t *in) {
    Py_XDECREF(in->seq);
    if (in->is_view) {
        PyBuffer_Release(&in->view);
    }
}

static int out_of_range(const char *name, Py_ssize_t i, long long limit) {
    PyErr_Format(PyExc_ValueError, "%s[%zd] is outside 0..%lld", name, i, limit - 1);
    return -1;
}

/* Items from `from` on of a tuple: any int (through __index__; one too large for 64 bits is out of
 * range), checked against limit, into o. 0 or -1. */
static int tuple_read(PyObject *seq, Py_ssize_t from, Py_ssize_t n, long long limit, int32_t *o, const char *name) {
    for (Py_ssize_t i = from; i < n; i++) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(seq, i), &overflow);
        if (v == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow || v < 0 || v >= limit) {
            return out_of_range(name, i, limit);
        }
        o[i] = (int32_t)v;
    }
    return 0;
}

/* The n items of `in` into o as int32, each checked against limit. 0 or -1. A list is read in
 * place while its items are exact ints (reading those runs no Python code, so the list cannot
 * change meanwhile); from the first other item on it is read as a tuple, whose items' __index__
 * may run any code. */
static int ids_read(ids_t *in, Py_ssize_t n, long long limit, int32_t *o, const char *name) {
    if (in->is_view) {
        const int64_t *s = (const int64_t *)in->view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (s[i] < 0 || s[i] >= limit) {
                return out_of_range(name, i, limit);
            }
            o[i] = (int32_t)s[i];
        }
        return 0;
    }
    if (in->seq == NULL) {
        if (n > limit) {
            return out_of_range(name, (Py_ssize_t)limit, limit);
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            o[i] = (int32_t)i;
        }
        return 0;
    }
    Py_ssize_t i = 0;
    if (PyList_CheckExact(in->seq)) {
        for (; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(in->seq, i);
            if (!PyLong_CheckExact(item)) {
                break;
            }
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || v < 0 || v >= limit) {
                return out_of_range(name, i, limit);
            }
            o[i] = (int32_t)v;
        }
        if (i == n) {
            return 0;
        }
        PyObject *tuple = PyList_AsTuple(in->seq);
        if (tuple == NULL) {
            return -1;
        }
        Py_SETREF(in->seq, tuple);
    }
    return tuple_read(in->seq, i, n, limit, o, name);
}

/* The table of `a` then `b` into out[0:2n] (capacity: items out holds); n, or -1 with an error set
 * and out unchanged. */
static Py_ssize_t pack_core(PyObject *a, PyObject *b, long long la, long long lb, int32_t *out, Py_ssize_t capacity) {
    if (la < 1 || lb < 1 || la > ((long long)1 << 31) || lb > ((long long)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "limits must be in 1..2**31");
        return -1;
    }
    if (b == Py_None) {
        PyErr_SetString(PyExc_TypeError, "second must be a sequence of ints");
        return -1;
    }
    ids_t in_a, in_b;
    if (ids_open(a, &in_a, "first") < 0) {
        return -1;
    }
    if (ids_open(b, &in_b, "second") < 0) {
        ids_close(&in_a);
        return -1;
    }
    Py_ssize_t n = ids_len(&in_b, 0), result = -1;
    int32_t stack[2048], *tmp = stack;
    if (ids_len(&in_a, n) != n) {
        PyErr_SetString(PyExc_ValueError, "first and second differ in length");
    } else if (capacity < 2 * n) {
        PyErr_SetString(PyExc_ValueError, "out is too short");
    } else if (2 * n > 2048 && (tmp = PyMem_Malloc(sizeof(int32_t) * 2 * n)) == NULL) {
        PyErr_NoMemory();
    } else if (ids_read(&in_a, n, la, tmp, "first") == 0 && ids_read(&in_b, n, lb, tmp + n, "second") == 0) {
        memcpy(out, tmp, sizeof(int32_t) * 2 * n);
        result = n;
    }
    if (tmp != stack && tmp != NULL) {
        PyMem_Free(tmp);
    }
    ids_close(&in_a);
    ids_close(&in_b);
    return result;
}

static PyObject *pack_ids(PyObject *self, PyObject *args) {
    PyObject *a, *b, *c;
    long long la, lb;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OOOLL", &a, &b, &c, &la, &lb)) {
        return NULL;
    }
    if (int_view(c, &out, 1, 1, "out") < 0) {
        return NULL;
    }
    Py_ssize_t n = pack_core(a, b, la, lb, (int32_t *)out.buf, out.shape[0]);
    PyBuffer_Release(&out);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

/* cuLaunchKernel's C signature (CUDA driver API; no CUDA headers needed to call it). */
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);

static PyObject *pack_launch(PyObject *self, PyObject *args) {
    unsigned long long launch, function, stream, params, table;
    unsigned int gx, gy, threads;
    Py_ssize_t capacity;
    PyObject *a, *b;
    long long la, lb;
    if (!PyArg_ParseTuple(args, "KKIIIKKKnOOLL", &launch, &function, &gx, &gy, &threads, &stream, &params, &table,
                          &capacity, &a, &b, &la, &lb)) {
        return NULL;
    }
    if (launch == 0 || params == 0 || table == 0) {
        PyErr_SetString(PyExc_ValueError, "null launch, parameter or table address");
        return NULL;
    }
    if (pack_core(a, b, la, lb, (int32_t *)(uintptr_t)table, capacity) < 0) {
        return NULL;
    }
    int code = ((launch_fn)(uintptr_t)launch)((void *)(uintptr_t)function, gx, gy, 1, threads, 1, 1, 0,
                                              (void *)(uintptr_t)stream, (void **)(uintptr_t)params, NULL);
    return PyLong_FromLong(code);
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(src, dst, out[, cap]) -> runs (at most cap): out[:n] = src, out[n:2n] = dst."},
    {"pack_ids", pack_ids, METH_VARARGS, "pack_ids(first, second, out, first_limit, second_limit) -> n."},
    {"pack_launch", pack_launch, METH_VARARGS,
     "pack_launch(launch, function, grid_x, grid_y, threads, stream, params, table, capacity, first, second, "
     "first_limit, second_limit) -> CUresult."},
    {"fill_int64", fill_int64, METH_VARARGS, "fill_int64(seq, out) -> leading exact ints written."},
    {"spans", spans, METH_VARARGS, "spans(src, dst, src_base, dst_base, page, out_dst, out_src, out_sizes) -> runs."},
    {"fill_int64", fill_int64, METH_VARARGS, "fill_int64(seq, out) -> leading exact ints written."},
    {"spans", spans, METH_VARARGS, "spans(src, dst, src_base, dst_base, page, out_dst, out_src, out_sizes) -> runs."},
    {"run_starts", run_starts, METH_VARARGS, "run_starts(src, dst, out) -> count of run starts written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "raykv.native._slots", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slots(void) { return PyModule_Create(&module); }

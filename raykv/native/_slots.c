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

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS, "pack(src, dst, out) -> runs: out[:n] = src, out[n:2n] = dst."},
    {"run_starts", run_starts, METH_VARARGS, "run_starts(src, dst, out) -> count of run starts written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "raykv.native._slots", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slots(void) { return PyModule_Create(&module); }

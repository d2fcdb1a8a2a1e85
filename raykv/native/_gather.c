/* raykv.native._gather: an owner's one copy of engine blocks into its page rows.
 *
 * A CacheWorker maps a CPU engine's KV memory read-only (raykv.transfer.kv_share) and builds each
 * stored page from that engine's block segments. In Python each segment costs a call, and a copy
 * of tens of KiB through ordinary stores first reads every destination line it writes; here the
 * segments go in one call, without the GIL, with non-temporal stores (SSE2, part of x86-64) where
 * the destination is 16-byte aligned and a segment a multiple of 64 bytes, else memcpy.
 *
 * gather(dst, srcs, lens) -> None: writes the segments back to back from address `dst`; segment
 * i is lens[i] bytes from address srcs[i]. srcs: a C-contiguous buffer of uint64 addresses, lens
 * one of int64 sizes, of the same count (else ValueError). The caller guarantees every address
 * range is mapped: the Python side checks each against the regions it mapped before calling.
 * Ends with a store fence: the bytes are visible to other cores when the call returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

static void copy_segment(unsigned char *dst, const unsigned char *src, int64_t n) {
#if defined(__x86_64__)
    if (((uintptr_t)dst & 15) == 0 && (n & 63) == 0) {
        for (int64_t k = 0; k < n; k += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + k));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + k + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + k + 48));
            _mm_stream_si128((__m128i *)(dst + k), a);
            _mm_stream_si128((__m128i *)(dst + k + 16), b);
            _mm_stream_si128((__m128i *)(dst + k + 32), c);
            _mm_stream_si128((__m128i *)(dst + k + 48), d);
        }
        return;
    }
#endif
    memcpy(dst, src, (size_t)n);
}

static PyObject *gather(PyObject *self, PyObject *args) {
    unsigned long long dst_addr;
    Py_buffer srcs, lens;
    if (!PyArg_ParseTuple(args, "Ky*y*", &dst_addr, &srcs, &lens)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = srcs.len / 8;
    if (srcs.len % 8 || lens.len != srcs.len || !PyBuffer_IsContiguous(&srcs, 'C') ||
        !PyBuffer_IsContiguous(&lens, 'C') || (n && dst_addr == 0)) {
        PyErr_SetString(PyExc_ValueError, "srcs and lens: equal counts of 8-byte values, and a destination");
        goto done;
    }
    const uint64_t *src = (const uint64_t *)srcs.buf;
    const int64_t *len = (const int64_t *)lens.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (len[i] < 0 || (len[i] && src[i] == 0)) {
            PyErr_SetString(PyExc_ValueError, "a negative size or a null source");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char *out = (unsigned char *)(uintptr_t)dst_addr;
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_segment(out, (const unsigned char *)(uintptr_t)src[i], len[i]);
        out += len[i];
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&srcs);
    PyBuffer_Release(&lens);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, "gather(dst, srcs, lens) -> None: segments back to back from dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "raykv.native._gather", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gather(void) { return PyModule_Create(&module); }

"""Many scattered host <-> GPU page copies on the DMA engines: ``cuMemcpyBatchAsync``, pipelined.

The driver call (CUDA 12.8 and later) takes arrays of destination and source addresses and sizes
and enqueues them all on one stream. It costs about 0.4 us of host time per copy, so one call of
4,096 copies of 64 KiB would keep the copy engines idle for 1.7 ms before the first byte moves.
:meth:`BatchMemcpy.enqueue` therefore issues the batch in chunks of ``CHUNK`` copies: the engines
start on the first chunk while the host enqueues the next, and the whole batch ends close to
where one raw copy of the same bytes would (1x H200: 0.90-0.96x at 64 KiB pages, against 0.79-0.81x
for the copy kernel reading host memory; docs/benchmarks.md).

The entry point is looked up once per process through ``cuGetProcAddress`` at the 12.8 signature
(drivers keep old signatures); an older driver or no cuda-python makes :func:`batch_memcpy` return
None and the copier uses its other paths. Calls go through ctypes with numpy arrays: cuda-python's
list conversion costs more than the copies.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.errors import CudaError
from raykv.core.tiers.cuda_calls import failure, proc_address

log = logging.getLogger(__name__)

CHUNK = 128
"""Copies per driver call: small enough that the engines start early, large enough that a call's
fixed cost stays small (1x H200, 64 KiB pages: 128 was best of 32-1,024)."""
_VERSION = 12080
_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes: access order, source and destination location hints, flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _Location),
        ("dst_loc_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


_SIGNATURE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr* dsts
    ctypes.c_void_p,  # CUdeviceptr* srcs
    ctypes.c_void_p,  # size_t* sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes* attrs
    ctypes.c_void_p,  # size_t* attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t* failIdx
    ctypes.c_void_p,  # CUstream
)


class BatchMemcpy:
    """The driver's batched copy, bound once (thread-safe: each call has its own failure index)."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self._attributes = _Attributes(_STREAM_ORDER, _Location(0, 0), _Location(0, 0), 0)
        self._attribute_index = (ctypes.c_size_t * 1)(0)

    def enqueue(
        self,
        stream_handle: int,
        dst: npt.NDArray[np.uint64],
        src: npt.NDArray[np.uint64],
        sizes: npt.NDArray[np.uint64],
        chunk: int = CHUNK,
    ) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every i on the stream, in
        order after the work already there. Returns once enqueued (the arrays may be dropped
        then). CudaError (or OutOfMemoryError) naming the first failing copy when the driver
        refuses one; copies of earlier chunks may have been enqueued by then. ValueError when the
        arrays differ in length or are not contiguous uint64."""
        arrays = (dst, src, sizes)
        if any(a.dtype != np.uint64 or not a.flags.c_contiguous or a.shape != dst.shape for a in arrays):
            raise ValueError("dst, src and sizes must be contiguous uint64 arrays of one length")
        failed = ctypes.c_size_t(0)
        attributes, index = ctypes.addressof(self._attributes), ctypes.addressof(self._attribute_index)
        base = [int(a.ctypes.data) for a in arrays]
        for lo in range(0, len(dst), chunk):
            count = min(chunk, len(dst) - lo)
            at = [b + 8 * lo for b in base]
            code = self._function(*at, count, attributes, index, 1, ctypes.byref(failed), stream_handle)
            if code != 0:
                raise failure(f"cuMemcpyBatchAsync (copy {lo + failed.value})", code)


_LOCK = threading.Lock()
_BOUND: list[BatchMemcpy | None] = []


def batch_memcpy() -> BatchMemcpy | None:
    """The process's :class:`BatchMemcpy`, or None when the driver or cuda-python lacks it
    (looked up once; a CUDA context must be current on first call)."""
    with _LOCK:
        if not _BOUND:
            _BOUND.append(_bind())
        return _BOUND[0]


def _bind() -> BatchMemcpy | None:
    try:
        pointer = proc_address("cuMemcpyBatchAsync", _VERSION)
    except CudaError as exc:
        log.info("GPU tier: cuMemcpyBatchAsync unavailable (%s)", exc)
        return None
    if not pointer:
        log.info("GPU tier: the driver has no cuMemcpyBatchAsync (CUDA < 12.8); using the copy kernel")
        return None
    return BatchMemcpy(_SIGNATURE(pointer))

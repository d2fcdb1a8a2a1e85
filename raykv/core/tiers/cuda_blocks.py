"""One CUDA kernel that copies whole pages between raykv page rows and an engine's strided blocks.

An engine keeps a block's KV as parts (per layer, keys and values) of shape ``[blocks, r, N, H, D]``
with arbitrary strides (vLLM: any ``KVCacheLayout``, kernel blocks ``r`` of ``N`` tokens each); a
token-major raykv page holds each part as ``[r * N, H, D]`` contiguous at its region's offset. The
kernel moves a batch of pages in one launch. Its table is one int32 pair per page: the page's
slot (the page is at ``base + slot * stride``) and its engine block, passed by value in the
launch's parameters for a batch of up to ``SMALL_PAGES`` pages, else uploaded first. Grid rows
are (part, token) of one page, 16-byte vectors strided over the threads, ``PAGES_PER_STEP``
pages at a time strided over the grid's second dimension. Both directions: pages into
blocks (a load) and blocks into pages (a save). Page rows may be device memory (a GPU tier, mapped
or owned, or a device staging buffer) or page-locked host memory mapped for the device.

:class:`BlockKernel` takes the parts' geometry once (:class:`PartGeometry`) and then one call per
batch; it is None-safe to build: :func:`block_kernel` returns None when the geometry does not
allow 16-byte vectors (an unaligned base, stride or head size) or NVRTC is missing, and the
caller copies with torch instead. cuda-python and torch are imported inside functions.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.errors import CudaError, InvalidArgumentError
from raykv.core.tiers.copy_plan import pack_ids
from raykv.core.tiers.cuda_calls import KernelArgs, current_stream
from raykv.core.tiers.cuda_copy import compile_kernel
from raykv.core.tiers.cuda_util import ArgTables, check, driver, ensure_context

log = logging.getLogger(__name__)

NAME = "raykv_copy_blocks"
THREADS = 64
TARGET_BLOCKS = 16384
"""Thread blocks per launch to aim for (each copies one (part, token) row of several pages)."""

PAGES_PER_STEP = 8
"""Pages each thread block moves per step, their loads all issued before the stores (1x H200,
2026-12-03, 64 and 512 MiB batches in vLLM's layout: 8 pages x 64 threads 47.9 / 279.7 us of GPU
time against 48.2-52.2 / 287.6-290.3 us for 2 or 4 pages and 64 or 128 threads; raw copy 46.2 /
275.9 us)."""

SMALL_PAGES = 480
"""Batches of at most this many pages pass their table by value in the launch's parameters (960
int32, within the 4 KiB every CUDA device takes): no pinned buffer, no upload before the copy."""

_SOURCE = r"""
#define ARGS unsigned long long page_base, long long page_stride, \
    const unsigned long long* __restrict__ geometry, int npages, int parts, int tokens, \
    int kernel_tokens, int heads, int dvec, long long sb, long long sr, long long sn, long long sh, \
    int to_engine
#define PASS page_base, page_stride, geometry, npages, parts, tokens, kernel_tokens, heads, dvec, \
    sb, sr, sn, sh, to_engine

struct SmallTable { int v[2 * SMALL_PAGES]; };

__device__ __forceinline__ void copy_pages(const int* __restrict__ table, ARGS) {
    const int part = blockIdx.x / tokens, t = blockIdx.x % tokens;
    const int row = heads * dvec;
    const unsigned long long base = geometry[part]
        + (long long)(t / kernel_tokens) * sr + (long long)(t % kernel_tokens) * sn;
    const unsigned long long offset = page_base + geometry[parts + part] + (unsigned long long)t * row * 16;
    for (int p0 = blockIdx.y * U; p0 < npages; p0 += gridDim.y * U) {
        char* e[U];
        char* q[U];
        #pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = p0 + u < npages ? p0 + u : p0;
            e[u] = (char*)(base + (long long)table[npages + p] * sb);
            q[u] = (char*)(offset + (long long)table[p] * page_stride);
        }
        for (int k = threadIdx.x; k < row; k += blockDim.x) {
            const long long eo = (long long)(k / dvec) * sh + (long long)(k % dvec) * 16;
            const long long qo = (long long)k * 16;
            uint4 r[U];
            #pragma unroll
            for (int u = 0; u < U; u++)
                if (p0 + u < npages)
                    r[u] = to_engine ? *(const uint4*)(q[u] + qo) : *(const uint4*)(e[u] + eo);
            #pragma unroll
            for (int u = 0; u < U; u++) {
                if (p0 + u >= npages) continue;
                if (to_engine) { *(uint4*)(e[u] + eo) = r[u]; } else { *(uint4*)(q[u] + qo) = r[u]; }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
raykv_copy_blocks(const int* __restrict__ table, ARGS) { copy_pages(table, PASS); }

extern "C" __global__ void __launch_bounds__(THREADS)
raykv_copy_blocks_small(const __grid_constant__ SmallTable small, ARGS) { copy_pages(small.v, PASS); }
"""


def kernel_source() -> str:
    """The kernel's CUDA C with :data:`THREADS` and :data:`PAGES_PER_STEP` filled in."""
    head = f"#define U {PAGES_PER_STEP}\n#define THREADS {THREADS}\n#define SMALL_PAGES {SMALL_PAGES}\n"
    return head + _SOURCE


_INTS, _LONGS = (ctypes.c_int,) * 6, (ctypes.c_longlong,) * 4
_REST = (ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_void_p, *_INTS, *_LONGS)
_ARG_TYPES = (ctypes.c_void_p, *_REST, ctypes.c_int)
_SMALL_ARG_TYPES = (ctypes.c_int * (2 * SMALL_PAGES), *_REST, ctypes.c_int)

_KERNELS: dict[int, tuple[Any, Any, Any] | None] = {}  # device -> (module, function, small function)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class PartGeometry:
    """Where the parts of one block live (bytes): part ``j`` of block ``b``, token ``t``, head
    ``h`` starts at ``bases[j] + b * strides[0] + (t // kernel_tokens) * strides[1] +
    (t % kernel_tokens) * strides[2] + h * strides[3]`` and holds ``row_bytes`` contiguous bytes;
    in a page it is at ``offsets[j] + (t * heads + h) * row_bytes``."""

    bases: tuple[int, ...]
    offsets: tuple[int, ...]
    tokens: int
    kernel_tokens: int
    heads: int
    row_bytes: int
    strides: tuple[int, int, int, int]

    @classmethod
    def of_parts(cls, parts: Sequence[Any], offsets: Sequence[int]) -> PartGeometry | None:
        """The geometry of torch views ``[blocks, r, N, H, D]`` (one per page region, at page
        ``offsets``), or None when they differ in shape or strides or the last dimension is not
        contiguous."""
        first = parts[0]
        if first.dim() != 5 or any(p.shape != first.shape or p.stride() != first.stride() for p in parts):
            return None
        if first.stride(4) != 1:
            return None
        size = first.element_size()
        _, r, n, heads, d = (int(x) for x in first.shape)
        sb, sr, sn, sh = (int(first.stride(i)) * size for i in range(4))
        return cls(
            tuple(int(p.data_ptr()) for p in parts),
            tuple(int(o) for o in offsets),
            r * n,
            n,
            heads,
            d * size,
            (sb, sr, sn, sh),
        )

    def vectorizable(self) -> bool:
        """Whether every address the kernel forms is 16-byte aligned."""
        values = (*self.bases, *self.offsets, *self.strides, self.row_bytes)
        return all(v % 16 == 0 for v in values) and self.row_bytes > 0


class BlockKernel:
    """The compiled kernel and the device tables of one engine's parts (see the module doc)."""

    def __init__(self, device: Any, geometry: PartGeometry, function: Any, small: Any) -> None:
        import torch

        self.device = device
        self.geometry = geometry
        self._launcher = KernelArgs(int(function), _ARG_TYPES)
        self._small = KernelArgs(int(small), _SMALL_ARG_TYPES)
        self._geometry = torch.tensor(
            [*geometry.bases, *geometry.offsets], dtype=torch.int64, device=device
        )  # int64 bit patterns of the addresses; the kernel reads them as unsigned
        self._geometry_address = int(self._geometry.data_ptr())
        self._args = ArgTables(device.index or 0)

    def copy(
        self,
        page_base: int,
        page_stride: int,
        slots: Sequence[int] | npt.NDArray[np.int64] | None,
        block_ids: Sequence[int] | npt.NDArray[np.int64],
        to_engine: bool,
        limits: tuple[int, int],
        stream: int | None = None,
    ) -> None:
        """Enqueue, on raw stream handle ``stream`` (default: the device's current torch
        stream), the copy of page ``slots[i]`` (at ``page_base + slots[i] * page_stride``; None:
        page ``i``) into (``to_engine``) or out of engine block ``block_ids[i]``, for every i.
        ``limits``: (pages, engine blocks) there are; a slot or block id outside them raises
        InvalidArgumentError before anything is enqueued. Returns at once; the stream orders it
        (the caller synchronizes)."""
        count = len(block_ids)
        if count == 0:
            return
        g = self.geometry
        handle = current_stream(self.device.index or 0) if stream is None else int(stream)
        ensure_context(self.device.index or 0)
        steps = -(-count // PAGES_PER_STEP)
        grid_x = len(g.bases) * g.tokens
        grid = (grid_x, max(1, min(steps, 65535, TARGET_BLOCKS // max(1, grid_x))), 1)
        rest = (
            *(page_base, page_stride, self._geometry_address, count, len(g.bases), g.tokens),
            *(g.kernel_tokens, g.heads, g.row_bytes // 16, *g.strides, int(to_engine)),
        )
        if count <= SMALL_PAGES:  # the table by value: packed and launched in one call
            try:
                self._small.launch_packed(
                    grid[:2], THREADS, handle, (None, *rest), (slots, block_ids), limits
                )
            except (ValueError, TypeError) as exc:
                raise _invalid(count, exc) from None
            return
        table = self._args.take(2 * count, np.int32)
        _pack(slots, block_ids, table, limits, count)
        self._launcher.launch(grid, THREADS, handle, (self._args.send(handle, 8 * count), *rest))
        self._args.record(handle)


def _pack(
    slots: Sequence[int] | npt.NDArray[np.int64] | None,
    block_ids: Sequence[int] | npt.NDArray[np.int64],
    table: npt.NDArray[np.int32],
    limits: tuple[int, int],
    count: int,
) -> None:
    """The kernel's table: ``slots`` then ``block_ids`` as int32 (InvalidArgumentError when one is
    out of range or they differ in length)."""
    try:
        pack_ids(slots, block_ids, table, *limits)
    except (ValueError, TypeError) as exc:
        raise _invalid(count, exc) from None


def _invalid(count: int, exc: Exception) -> InvalidArgumentError:
    return InvalidArgumentError(
        "slots", f"block copy of {count} pages (first: page slots, second: block ids): {exc}"
    )


def block_kernel(device: Any, geometry: PartGeometry | None) -> BlockKernel | None:
    """A :class:`BlockKernel` for ``geometry`` on CUDA ``device``, or None when the geometry is
    missing or not vectorizable or the kernel cannot be compiled (logged once per device)."""
    if geometry is None or not geometry.vectorizable() or getattr(device, "type", "") != "cuda":
        return None
    index = device.index or 0
    with _LOCK:
        if index not in _KERNELS:
            try:
                ensure_context(index)
                module, function = compile_kernel(index, kernel_source(), NAME)
                small = check(driver().cuModuleGetFunction(module, b"raykv_copy_blocks_small"), "small")
                _KERNELS[index] = (module, function, small)
            except (CudaError, ImportError, RuntimeError) as exc:
                log.warning("block copy kernel unavailable on cuda:%d (%s); copying with torch", index, exc)
                _KERNELS[index] = None
        compiled = _KERNELS[index]
    return None if compiled is None else BlockKernel(device, geometry, compiled[1], compiled[2])

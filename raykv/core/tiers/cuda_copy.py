"""Asynchronous batched page copies on dedicated CUDA streams (the GPU tier's copy engine).

A :class:`CudaCopier` belongs to one GPU pool and owns three non-blocking streams: ``d2h``
(demotion), ``h2d`` (promotion) and ``d2d`` (within or between device pools), so a demotion and a
promotion can run at once on the two copy engines. :meth:`CudaCopier.copy` enqueues one batch of
page copies and returns the event recorded after it; nothing blocks the host.

How a batch is copied: the (source, destination) slot pairs are split into runs that are
consecutive on both sides. Few or long runs go as one ``cuMemcpyAsync`` each (the DMA engines);
many short runs between host and device go as batched DMA copies (:mod:`cuda_batch`,
``cuMemcpyBatchAsync``, CUDA 12.8+; without it, one kernel launch that reads and writes pinned host
memory directly through unified addressing); many runs within the device go through one kernel
launch that copies every page with 16-byte loads and stores. ``RAYKV_GPU_COPY`` (``kernel`` /
``memcpy`` / ``batch``) forces one method.

Ordering contract (what the caller passes in and does with the event):

* before the batch, the copy stream waits for the caller's current torch stream (so KV an engine
  wrote there is complete) and for ``waits`` (the pending events of every slot involved);
* the returned event is the new pending event of every source and destination slot; a slot is
  not reused, read, exported or overwritten before it completes (see :class:`SlotEvents`).

GPU <-> disk goes through :class:`PinnedStaging`: two pinned halves used alternately, so reading
the disk for one chunk overlaps the copy of the previous one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.errors import CudaError
from raykv.core.tiers.copy_plan import pack, runs, spans
from raykv.core.tiers.cuda_batch import batch_memcpy
from raykv.core.tiers.cuda_calls import KernelArgs, calls, current_stream
from raykv.core.tiers.cuda_util import (
    ArgTables,
    SlotList,
    check,
    driver,
    ensure_context,
    one_run,
    torch_errors,
)

log = logging.getLogger(__name__)

MEMCPY_MAX_RUNS = 8
"""Batches of at most this many runs always go as one cuMemcpyAsync per run."""
MEMCPY_MIN_RUN_BYTES = 1 << 20
"""Runs at least this long on average go as cuMemcpyAsync (the DMA engines beat the kernel)."""
KERNEL_D2H_RUN_BYTES = 256 << 10
"""GPU -> host runs shorter than this on average go by the kernel even where batched DMA is
available (1x H200, 64 KiB pages: kernel 0.89x, batched DMA 0.84x of a raw copy)."""
MAX_BLOCKS_PER_PAGE = 128
TARGET_BLOCKS = 16384
"""Blocks per launch to aim for (a block copies several pages when there are many)."""
THREADS = 256
UNROLL = 4
_ARG_TYPES = (ctypes.c_void_p, ctypes.c_int) + (ctypes.c_ulonglong,) * 4

_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256)
raykv_copy_pages(const int* __restrict__ slots, int npages, unsigned long long src_base,
                 unsigned long long dst_base, unsigned long long page_bytes, unsigned long long nvec) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (int page = blockIdx.y; page < npages; page += gridDim.y) {
        const unsigned long long s = slots[page], d = slots[npages + page];
        const uint4* __restrict__ src = (const uint4*)(src_base + s * page_bytes);
        uint4* __restrict__ dst = (uint4*)(dst_base + d * page_bytes);
        unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + 3 * stride < nvec; i += 4 * stride) {
            uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
            dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
        }
        for (; i < nvec; i += stride) dst[i] = src[i];
    }
}
"""


def _compile_kernel(device: int) -> Any:
    """Compile and load the page-copy kernel for ``device`` (NVRTC, once per process)."""
    return compile_kernel(device, _KERNEL, "raykv_copy_pages")


def compile_kernel(device: int, source: str, name: str) -> tuple[Any, Any]:
    """Compile CUDA C ``source`` for ``device``'s architecture with NVRTC and load it: (module,
    function ``name``). CudaError with NVRTC's log when it does not compile; ImportError without
    cuda-python's nvrtc."""
    from cuda.bindings import nvrtc

    drv = driver()
    dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
    attr = drv.CUdevice_attribute
    major = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
    minor = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        text = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, text)
        raise CudaError(f"NVRTC failed: {text.decode(errors='replace')}", cuda_error=str(err))
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    module = check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
    return module, check(drv.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")


class CudaCopier:
    """Streams, the copy kernel and the disk staging buffer of one device."""

    def __init__(self, device: int) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.torch_device = torch.device("cuda", device)
        with torch_errors("create copy streams"):
            self.streams = {name: torch.cuda.Stream(self.torch_device) for name in ("d2h", "h2d", "d2d")}
        self.method = os.environ.get("RAYKV_GPU_COPY", "auto")
        self._kernel: Any = None
        self._kernel_args: KernelArgs | None = None
        self._kernel_failed = False
        self._host_ptrs: dict[int, int | None] = {}
        self.staging: PinnedStaging | None = None
        self._tables = ArgTables(device)
        ensure_context(device)
        drv = driver()
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._order_handle: Any = check(drv.cuEventCreate(flags), "cuEventCreate")
        self._order_event = int(self._order_handle)
        self._order_lock = threading.Lock()

    # ---- addresses ----------------------------------------------------------------------------
    def host_address(self, array: npt.NDArray[np.uint8], pinned: bool) -> int | None:
        """Unified address of a pinned host array (usable by copies and kernels), else None."""
        if not pinned or array.size == 0:
            return None
        host = int(array.ctypes.data)
        if host not in self._host_ptrs:
            drv = driver()
            ensure_context(self.device)
            err, ptr = drv.cuMemHostGetDevicePointer(host, 0)
            self._host_ptrs[host] = int(ptr) if int(err) == 0 else None
            if int(err) != 0:
                log.warning("GPU tier: host memory at %#x is not device-mapped; copies are synchronous", host)
        return self._host_ptrs[host]

    # ---- copies ---------------------------------------------------------------------------------
    def copy(
        self,
        stream_name: str,
        src_base: int,
        src_slots: SlotList,
        dst_base: int,
        dst_slots: SlotList,
        nbytes: int,
        waits: Sequence[Any] = (),
    ) -> Any:
        """Enqueue ``nbytes`` from each source page to its destination page; return the event.

        Page ``i`` lives at ``base + slot * nbytes``. Returns None (and does nothing) for an empty
        batch or zero bytes. The copy starts after the current stream's work and ``waits``.
        """
        return self.copy_many(stream_name, src_base, dst_base, nbytes, [(src_slots, dst_slots)], waits)[0]

    def copy_many(
        self,
        stream_name: str,
        src_base: int,
        dst_base: int,
        nbytes: int,
        batches: Sequence[tuple[SlotList, SlotList]],
        waits: Sequence[Any] = (),
    ) -> list[Any]:
        """:meth:`copy` of each ``(source slots, destination slots)`` batch in turn on one stream,
        one event per batch (None for an empty one): the stream waits once (for the current
        stream and ``waits``), so batch ``k``'s event completes when batches ``0..k`` have.
        ValueError, with nothing enqueued, when a batch's two sides differ in length."""
        if any(len(src) != len(dst) for src, dst in batches):
            raise ValueError("source and destination batches differ in length")
        if nbytes == 0 or not any(len(src) for src, _ in batches):
            return [None] * len(batches)
        ensure_context(self.device)
        stream = self.streams[stream_name]
        events: list[Any] = []
        with torch_errors(f"{stream_name} page copy"):
            self._after_current(stream)
            for event in waits:
                stream.wait_event(event)
            for src_slots, dst_slots in batches:
                events.append(self._one(stream, src_base, src_slots, dst_base, dst_slots, nbytes))
        return events

    def _after_current(self, stream: Any) -> None:
        """Order ``stream`` after the work on the caller's current torch stream (as torch's
        ``wait_stream``, through one reused driver event: two ctypes calls)."""
        current = current_stream(self.device)
        with self._order_lock:  # the event's record and the wait on it go together
            calls().event_record(self._order_event, current)
            calls().stream_wait_event(stream.cuda_stream, self._order_event)

    def _one(
        self, stream: Any, src_base: int, src_slots: SlotList, dst_base: int, dst_slots: SlotList, nbytes: int
    ) -> Any:
        """Enqueue one batch on ``stream`` (already ordered) and record its event (None if empty)."""
        if not len(src_slots):
            return None
        if self.method != "kernel" and one_run(src_slots) and one_run(dst_slots):
            spans = [(int(src_slots[0]), int(dst_slots[0]), len(src_slots))]  # one DMA copy
            self._memcpy(stream, src_base, dst_base, nbytes, spans)
        else:
            src = np.asarray(src_slots, dtype=np.int64)
            dst = np.asarray(dst_slots, dtype=np.int64)
            self._enqueue(stream, src_base, src, dst_base, dst, nbytes)
        event = self._torch.cuda.Event()
        event.record(stream)
        return event

    def _enqueue(
        self,
        stream: Any,
        src_base: int,
        src: npt.NDArray[np.int64],
        dst_base: int,
        dst: npt.NDArray[np.int64],
        nbytes: int,
    ) -> None:
        """Copy the pages by the method :meth:`_choose` picks. The slots go into the kernel's
        argument table while their runs are counted (one pass, :func:`copy_plan.pack`), so the
        common case, a launch, touches the arrays once before the GPU starts."""
        table = self._tables.take(2 * len(src), np.int32)
        # within the device only "at most MEMCPY_MAX_RUNS runs?" matters: stop counting past it
        cap = MEMCPY_MAX_RUNS + 1 if stream is self.streams["d2d"] and self.method == "auto" else -1
        method = self._choose(stream, len(src), pack(src, dst, table, cap), nbytes)
        if method == "kernel":
            if nbytes % 16 == 0 and not (src_base | dst_base) % 16 and self._load_kernel():
                self._launch(stream, src_base, dst_base, len(src), nbytes)
                return
            method = "batch" if stream is not self.streams["d2d"] and batch_memcpy() else "memcpy"
        if method == "batch":
            batch = batch_memcpy()
            if batch is not None:
                batch.enqueue(stream.cuda_stream, *spans(src, dst, src_base, dst_base, nbytes))
                return
        self._memcpy(stream, src_base, dst_base, nbytes, runs(src, dst))

    def _choose(self, stream: Any, count: int, num_runs: int, nbytes: int) -> str:
        """``memcpy`` (one cuMemcpyAsync per run), ``batch`` (:mod:`cuda_batch`, host <-> GPU
        only) or ``kernel``: ``RAYKV_GPU_COPY`` when set, else few runs go as DMA copies, host
        <-> GPU batches as batched DMA copies (else long runs as DMA copies, short ones by the
        kernel), except short runs to the host, which the kernel writes faster (posted writes);
        copies within the device by the kernel."""
        if self.method in ("memcpy", "kernel", "batch"):
            return self.method
        if num_runs <= MEMCPY_MAX_RUNS:
            return "memcpy"
        if stream is self.streams["d2d"]:
            return "kernel"
        if batch_memcpy() is not None:
            short = count * nbytes < num_runs * KERNEL_D2H_RUN_BYTES
            return "kernel" if short and stream is self.streams["d2h"] else "batch"
        return "memcpy" if count * nbytes >= num_runs * MEMCPY_MIN_RUN_BYTES else "kernel"

    @staticmethod
    def _memcpy(
        stream: Any, src_base: int, dst_base: int, nbytes: int, spans: list[tuple[int, int, int]]
    ) -> None:
        """One cuMemcpyAsync per run ``(first source slot, first destination slot, length)``."""
        drv = driver()
        handle = stream.cuda_stream
        for s, d, n in spans:
            check(
                drv.cuMemcpyAsync(dst_base + d * nbytes, src_base + s * nbytes, n * nbytes, handle),
                "cuMemcpyAsync",
            )

    def kernel_available(self) -> bool:
        """Whether the page-copy kernel compiled and loaded (compiles it on first use)."""
        return self._load_kernel()

    def _load_kernel(self) -> bool:
        if self._kernel is None and not self._kernel_failed:
            try:
                self._kernel = _compile_kernel(self.device)
                self._kernel_args = KernelArgs(int(self._kernel[1]), _ARG_TYPES)
            except (CudaError, ImportError, RuntimeError) as exc:
                log.warning("GPU tier: copy kernel unavailable (%s); using cuMemcpyAsync per run", exc)
                self._kernel_failed = True
        return self._kernel is not None

    def _launch(self, stream: Any, src_base: int, dst_base: int, count: int, nbytes: int) -> None:
        """One launch over the ``count`` pages whose slots :meth:`_enqueue` packed into the
        argument table (:class:`ArgTables`): ``blocks`` blocks per page along x, pages strided
        over ``grid_y`` rows; the table is uploaded on ``stream`` first."""
        nvec = nbytes // 16
        blocks = max(1, min(MAX_BLOCKS_PER_PAGE, -(-nvec // (THREADS * UNROLL))))
        grid_y = max(1, min(count, TARGET_BLOCKS // blocks))
        handle = stream.cuda_stream
        table = self._tables.send(handle, 8 * count)  # 2 x count int32 slots
        assert self._kernel_args is not None  # _load_kernel succeeded before any launch
        self._kernel_args.launch(
            (blocks, grid_y, 1), THREADS, handle, (table, count, src_base, dst_base, nbytes, nvec)
        )
        self._tables.record(handle)

    def synchronize(self) -> None:
        """Block until every copy enqueued on this copier's streams completed."""
        with torch_errors("synchronize copy streams"):
            for stream in self.streams.values():
                stream.synchronize()

    # ---- GPU <-> disk ----------------------------------------------------------------------------
    def to_disk(
        self,
        gpu_base: int,
        src_slots: Sequence[int],
        page_bytes: int,
        waits: Sequence[Any],
        write_rows: Callable[[list[int], list[npt.NDArray[np.uint8]]], None],
        dst_slots: Sequence[int],
    ) -> None:
        """Copy GPU pages to disk through the pinned staging buffer (done on return)."""
        staging = self._staging(page_bytes)
        chunks = staging.chunks(len(src_slots))
        if not chunks:
            return
        events: list[Any] = [None, None]
        half = 0

        def fill(lo: int, hi: int, h: int) -> Any:
            staging.wait(h)
            base = staging.address(h, self)
            return self.copy("d2h", gpu_base, src_slots[lo:hi], base, range(hi - lo), page_bytes, waits)

        events[0] = fill(*chunks[0], 0)
        for i, (lo, hi) in enumerate(chunks):
            if i + 1 < len(chunks):
                events[1 - half] = fill(*chunks[i + 1], 1 - half)
            with torch_errors("staging wait"):
                events[half].synchronize()
            rows = [staging.rows(half)[j] for j in range(hi - lo)]
            write_rows(list(dst_slots[lo:hi]), rows)
            half = 1 - half

    def from_disk(
        self,
        read_rows: Callable[[list[int], list[npt.NDArray[np.uint8]]], None],
        src_slots: Sequence[int],
        gpu_base: int,
        dst_slots: Sequence[int],
        page_bytes: int,
        waits: Sequence[Any],
    ) -> Any:
        """Copy disk pages to the GPU through the staging buffer; returns the last copy's event."""
        staging = self._staging(page_bytes)
        event = None
        for i, (lo, hi) in enumerate(staging.chunks(len(src_slots))):
            half = i % 2
            staging.wait(half)
            rows = [staging.rows(half)[j] for j in range(hi - lo)]
            read_rows(list(src_slots[lo:hi]), rows)
            base = staging.address(half, self)
            event = self.copy("h2d", base, range(hi - lo), gpu_base, dst_slots[lo:hi], page_bytes, waits)
            staging.events[half] = event
        return event

    def _staging(self, page_bytes: int) -> PinnedStaging:
        if self.staging is None or self.staging.page_bytes != page_bytes:
            if self.staging is not None:
                self.staging.close()
            self.staging = PinnedStaging(page_bytes)
        return self.staging

    def close(self) -> None:
        """Wait for every copy; drop the staging buffer (streams and kernel go with the object)."""
        self.synchronize()
        self._tables.close()
        if self._order_handle is not None:
            driver().cuEventDestroy(self._order_handle)
            self._order_handle = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None


class PinnedStaging:
    """Two pinned host halves of ``pages_per_half`` pages each, used alternately for disk I/O."""

    HALF_BYTES = 32 << 20

    def __init__(self, page_bytes: int) -> None:
        import torch

        self.page_bytes = page_bytes
        self.pages_per_half = max(1, self.HALF_BYTES // page_bytes)
        with torch_errors("pinned staging buffer"):
            self._buffer = torch.empty(
                (2, self.pages_per_half, page_bytes), dtype=torch.uint8, pin_memory=True
            )
        self._array: npt.NDArray[np.uint8] = self._buffer.numpy()
        self.events: list[Any] = [None, None]

    def chunks(self, count: int) -> list[tuple[int, int]]:
        step = self.pages_per_half
        return [(lo, min(lo + step, count)) for lo in range(0, count, step)]

    def rows(self, half: int) -> npt.NDArray[np.uint8]:
        return self._array[half]

    def address(self, half: int, copier: CudaCopier) -> int:
        address = copier.host_address(self._array, True)
        if address is None:
            raise CudaError("pinned staging buffer is not device-mapped", cuda_error="CUDA_ERROR_NOT_MAPPED")
        return address + half * self.pages_per_half * self.page_bytes

    def wait(self, half: int) -> None:
        """Block until the last copy out of ``half`` completed (it may be overwritten then)."""
        event = self.events[half]
        if event is not None:
            with torch_errors("staging wait"):
                event.synchronize()
            self.events[half] = None

    def close(self) -> None:
        for half in (0, 1):
            self.wait(half)

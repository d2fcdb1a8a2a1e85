"""The CUDA driver calls on a copy's critical path, bound once through ctypes.

A batch of page copies makes five to eight driver calls before the GPU starts (context, stream
ordering, argument table upload, launch, events). Through cuda-python each costs 5-20 us of
Python-side argument conversion; with a 1 GiB batch taking about 0.5 ms on the GPU, that alone
kept device-to-device batches under 0.8x of a raw copy. These are the same driver entry points
(looked up with ``cuGetProcAddress`` at a fixed ABI version, so the versioned symbol is the
right one) called through ctypes at 1-3 us each. Handles are plain integers: ``int()`` of a
cuda-python handle, a torch stream's ``cuda_stream``.

Everything else (NVRTC, module loading, memory registration, queries) stays on cuda-python
(:mod:`raykv.core.tiers.cuda_util`, which re-exports :func:`driver` and the error helpers defined
here). :func:`calls` raises CudaError where cuda-python or the driver is missing, as
:func:`driver` does.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from raykv import native
from raykv.core.errors import CudaError, OutOfMemoryError
from raykv.core.tiers.copy_plan import pack_ids

OOM_NAMES = frozenset({"CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation"})


def driver() -> Any:
    """The ``cuda.bindings.driver`` module (CudaError NO_CUDA_PYTHON when cuda-python is missing)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        try:
            from cuda import cuda as drv  # cuda-python < 12.6
        except ImportError:
            raise CudaError(
                "the GPU tier needs cuda-python (cuda.bindings)", cuda_error="NO_CUDA_PYTHON"
            ) from None
    return drv


def error_name(code: Any) -> str:
    """The driver's name for a CUresult (``"CUresult(N)"`` when the driver has none)."""
    drv = driver()
    err, name = drv.cuGetErrorName(code)
    if int(err) == 0 and name:
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"CUresult({int(code)})"


def make_error(name: str, message: str) -> CudaError | OutOfMemoryError:
    """CudaError (OutOfMemoryError for an out-of-memory name) carrying ``cuda_error=name``."""
    if name in OOM_NAMES:
        return OutOfMemoryError(message, tier="GPU", cuda_error=name)
    return CudaError(message, cuda_error=name)


_VERSION = 12000
_P, _U, _S = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuLaunchKernel": (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P),
    "cuMemcpyHtoDAsync": (ctypes.c_uint64, _P, _S, _P),
    "cuEventRecord": (_P, _P),
    "cuEventSynchronize": (_P,),
    "cuStreamWaitEvent": (_P, _P, _U),
    "cuCtxGetCurrent": (ctypes.POINTER(_P),),
    "cuCtxSetCurrent": (_P,),
    "cuStreamSynchronize": (_P,),
}


def failure(call: str, code: int) -> CudaError | OutOfMemoryError:
    """The typed error for driver result ``code`` returned by ``call`` (a ctypes call's int;
    ``CUresult(N)`` names a code this cuda-python does not know)."""
    try:
        label = error_name(driver().CUresult(code))
    except ValueError:
        label = f"CUresult({code})"
    return make_error(label, f"{call} failed: {label}")


def proc_address(name: str, version: int) -> int:
    """The driver's entry point ``name`` at ABI ``version`` (``cuGetProcAddress``), 0 when the
    driver lacks it. CudaError without cuda-python."""
    result = driver().cuGetProcAddress(name.encode(), version, 0)
    if not isinstance(result, tuple) or int(result[0]) != 0:
        return 0
    status = result[2] if len(result) > 2 else 0  # cuda-python < 12.5 returns no status
    return int(result[1]) if int(status) == 0 else 0


class Calls:
    """The bound entry points. Every method raises CudaError (OutOfMemoryError for
    out-of-memory) naming the call when the driver returns an error."""

    def __init__(self) -> None:
        drv = driver()
        init = drv.cuInit(0)
        if int(init[0] if isinstance(init, tuple) else init) != 0:
            raise CudaError("cuInit failed: no usable CUDA driver", cuda_error="CUDA_ERROR_NOT_INITIALIZED")
        self._fn: dict[str, Any] = {}
        self.addresses: dict[str, int] = {}
        """Each entry point's address (for compiled callers, :meth:`KernelArgs.launch_packed`)."""
        for name, argtypes in _SIGNATURES.items():
            pointer = proc_address(name, _VERSION)
            if not pointer:
                raise CudaError(f"the CUDA driver has no {name}", cuda_error="CUDA_ERROR_NOT_FOUND")
            self._fn[name] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(pointer)
            self.addresses[name] = pointer

    def call(self, name: str, *args: Any) -> None:
        """Call entry point ``name`` with ``args``; a typed error when it returns one."""
        code = self._fn[name](*args)
        if code != 0:
            raise failure(name, code)

    def htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cuMemcpyHtoDAsync``: ``nbytes`` from host ``src`` (page-locked) to device ``dst``."""
        self.call("cuMemcpyHtoDAsync", dst, src, nbytes, stream)

    def event_record(self, event: int, stream: int) -> None:
        self.call("cuEventRecord", event, stream)

    def event_synchronize(self, event: int) -> None:
        self.call("cuEventSynchronize", event)

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work enqueued on ``stream`` from now on waits for ``event``'s last record."""
        self.call("cuStreamWaitEvent", stream, event, 0)

    def stream_synchronize(self, stream: int) -> None:
        """Block until the work enqueued on ``stream`` completed."""
        self.call("cuStreamSynchronize", stream)

    def make_current(self, context: int) -> None:
        """Make ``context`` current on this thread (one ctypes call when it already is)."""
        current = _P()
        self.call("cuCtxGetCurrent", ctypes.byref(current))
        if (current.value or 0) != context:
            self.call("cuCtxSetCurrent", context)


class KernelArgs:
    """One kernel's argument block, built once: a box per argument (its ctypes type) and the
    pointer array ``cuLaunchKernel`` reads. :meth:`launch` fills the boxes and launches under a
    lock (the driver copies the arguments during the call), so a block serves every thread. Boxes
    are written only when a value changed since the last launch (a batch's arguments mostly
    repeat: 16 box writes were 3 us of a small copy's host time). Whether :meth:`launch_packed`
    packs in compiled code (``raykv.native._slots``, unless ``RAYKV_PURE_SLOTS=1``) is fixed when
    the block is built."""

    def __init__(self, function: int, types: Sequence[Any]) -> None:
        self.function = function
        self._compiled = native.load("_slots")
        self._boxes = [kind() for kind in types]
        self._params = (_P * len(self._boxes))(*[ctypes.addressof(b) for b in self._boxes])
        self._params_address = ctypes.addressof(self._params)
        self._values: tuple[int | None, ...] = ()
        self._lock = threading.Lock()

    def _fill(self, values: Sequence[int | None]) -> None:
        """Write ``values`` into the boxes (None: leave the box); skipped when they are the last
        ones written. The caller holds the lock."""
        values = tuple(values)
        if values != self._values:
            for box, value in zip(self._boxes, values):
                if value is not None:
                    box.value = value
            self._values = values

    def launch(
        self, grid: tuple[int, int, int], threads: int, stream: int, values: Sequence[int | None]
    ) -> None:
        """``cuLaunchKernel`` with ``values`` (one per type; None: keep the box's value),
        ``threads`` threads per block, on ``stream``; CudaError when the driver refuses."""
        run = calls()
        with self._lock:
            self._fill(values)
            run.call("cuLaunchKernel", self.function, *grid, threads, 1, 1, 0, stream, self._params, None)

    def launch_packed(
        self,
        grid: tuple[int, int],
        threads: int,
        stream: int,
        values: Sequence[int | None],
        ids: tuple[Sequence[int] | Any, Sequence[int] | Any],
        limits: tuple[int, int],
    ) -> None:
        """:meth:`launch` (``values[0]`` None) with argument 0, a ctypes int32 array passed by
        value, holding ``ids[0]`` then ``ids[1]`` as :func:`copy_plan.pack_ids` writes them:
        packed and launched in one compiled call where ``raykv.native._slots`` is built. Raises
        as ``pack_ids`` (ValueError, TypeError) before launching; CudaError when the driver
        refuses the launch."""
        run, compiled = calls(), self._compiled
        table = self._boxes[0]
        with self._lock:
            self._fill(values)
            if compiled is None:
                pack_ids(ids[0], ids[1], np.ctypeslib.as_array(table), *limits)
                run.call(
                    "cuLaunchKernel", self.function, *grid, 1, threads, 1, 1, 0, stream, self._params, None
                )
                return
            code = compiled.pack_launch(
                run.addresses["cuLaunchKernel"], self.function, *grid, threads, stream,
                self._params_address, ctypes.addressof(table), len(table), ids[0], ids[1], *limits,
            )  # fmt: skip
        if code != 0:
            raise failure("cuLaunchKernel", code)


def current_stream(device: int) -> int:
    """The raw handle of the calling thread's current torch stream on ``device`` (torch's
    ``_cuda_getCurrentRawStream``, a fraction of a microsecond, where torch has it; else through
    ``torch.cuda.current_stream``, 10-20 us)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


@functools.cache
def calls() -> Calls:
    """The process's :class:`Calls` (bound on first use; CudaError without cuda-python or with a
    driver lacking an entry point)."""
    return Calls()

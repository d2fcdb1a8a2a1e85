"""CUDA plumbing of the GPU tier: checked driver calls, typed errors, contexts, per-slot events.

cuda-python (``cuda.bindings``) and torch are imported lazily, inside functions: importing this
module costs nothing on a machine without CUDA.

Errors: :func:`check` turns a failed driver call into :class:`~raykv.core.errors.CudaError` whose
``cuda_error`` is the driver's error name (``"CUDA_ERROR_INVALID_VALUE"``...);
``CUDA_ERROR_OUT_OF_MEMORY`` becomes :class:`~raykv.core.errors.OutOfMemoryError` (with the same
``cuda_error`` attribute). :func:`torch_errors` does the same for torch's CUDA errors (their names
are the runtime's, ``"cudaErrorInvalidValue"``...).

Events: :class:`SlotEvents` remembers, per slot, the event recorded after the last asynchronous
copy that filled or drained the slot. Whoever touches the slot next waits on it first, on a
stream (no host block) or on the host.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.errors import CudaError
from raykv.core.tiers.base import is_run
from raykv.core.tiers.copy_plan import int64_array
from raykv.core.tiers.cuda_calls import OOM_NAMES, calls, driver, error_name, make_error

__all__ = ["OOM_NAMES", "driver", "error_name", "make_error"]  # re-exported: their home is cuda_calls


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(err, *values)``; raise a typed error when err != 0.

    Returns None (no values), the value, or a tuple of values.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if int(err) != 0:
        name = error_name(err)
        raise make_error(name, f"{call} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@functools.cache
def _runtime_names() -> dict[str, str]:
    """Runtime error string -> runtime error name (e.g. "invalid argument" -> cudaErrorInvalidValue)."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return {}
    names: dict[str, str] = {}
    for code in rt.cudaError_t:
        _err, text = rt.cudaGetErrorString(code)
        if isinstance(text, bytes):
            names.setdefault(text.decode(), code.name)
    return names


def torch_error_name(exc: BaseException) -> str | None:
    """The CUDA error name behind a torch exception, or None when it is not a CUDA error."""
    code = getattr(exc, "error_code", None)
    if code is not None:
        try:
            from cuda.bindings import runtime as rt

            return str(rt.cudaError_t(int(code)).name)
        except (ImportError, ValueError):
            return f"cudaError({int(code)})"
    if type(exc).__name__ == "OutOfMemoryError":
        return "cudaErrorMemoryAllocation"
    match = re.search(r"CUDA error: ([^\n]+)", str(exc))
    if match is None:
        return None
    text = match.group(1).strip()
    return _runtime_names().get(text, f"cudaError({text})")


@contextmanager
def torch_errors(call: str) -> Iterator[None]:
    """Re-raise torch's CUDA errors inside the block as CudaError / OutOfMemoryError."""
    try:
        yield
    except RuntimeError as exc:  # torch's CUDA errors (and OutOfMemoryError) subclass RuntimeError
        name = torch_error_name(exc)
        if name is None:
            raise
        raise make_error(name, f"{call} failed: {name}: {str(exc).splitlines()[0]}") from exc


@functools.cache
def primary_context(device: int) -> Any:
    """The device's primary context (the one torch uses), retained for the process's lifetime."""
    drv = driver()
    check(drv.cuInit(0), "cuInit")
    dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
    return check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")


def ensure_context(device: int) -> None:
    """Make the device's primary context current on this thread (driver calls need one); one
    ctypes call when it already is."""
    calls().make_current(int(primary_context(device)))


HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08


def host_register(address: int, nbytes: int, read_only: bool = False, device: int = 0) -> None:
    """Page-lock ``nbytes`` of host memory at ``address`` for every CUDA context of this process
    (``cuMemHostRegister``, portable), so device copies DMA it directly. ``read_only``: the
    memory is mapped without write access (a peer's tier mapped PROT_READ); devices only read it.
    Undo with :func:`host_unregister` before the memory is unmapped. CudaError when the driver
    refuses (no CUDA, the locked-memory limit, read-only registration unsupported)."""
    drv = driver()
    ensure_context(device)
    flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
    check(drv.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")


def try_host_register(address: int, nbytes: int, read_only: bool = False) -> str | None:
    """:func:`host_register`, for callers that go on without it: None when the memory is
    page-locked now, else why not (no CUDA, no cuda-python, the driver refused; nothing changed)."""
    try:
        host_register(address, nbytes, read_only=read_only)
    except (CudaError, OSError, RuntimeError) as exc:
        return str(exc)
    return None


def host_unregister(address: int, device: int = 0) -> None:
    """Undo :func:`host_register` of the memory at ``address`` (CudaError when not registered)."""
    drv = driver()
    ensure_context(device)
    check(drv.cuMemHostUnregister(address), "cuMemHostUnregister")


def device_count() -> int:
    """CUDA devices visible to this process (0 when the driver is missing)."""
    try:
        drv = driver()
        check(drv.cuInit(0), "cuInit")
        return int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    except (CudaError, OSError, RuntimeError):
        return 0


def device_uuid(device: int) -> str:
    """The device's UUID as hex (stable across processes, unlike the ordinal)."""
    drv = driver()
    check(drv.cuInit(0), "cuInit")
    dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
    getter = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
    raw = check(getter(dev), "cuDeviceGetUuid").bytes
    return (raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)).hex()


def device_by_uuid(uuid: str) -> int:
    """The ordinal of the visible device with this UUID (CudaError CUDA_ERROR_NOT_FOUND if none)."""
    for device in range(device_count()):
        if device_uuid(device) == uuid:
            return device
    raise CudaError(f"no visible CUDA device has UUID {uuid}", cuda_error="CUDA_ERROR_NOT_FOUND")


class SlotEvents:
    """Per-slot "ready" events: the last asynchronous copy that fills or drains each slot.

    Events are torch ``cuda.Event`` objects (anything with ``query`` and ``synchronize`` that
    ``stream.wait_event`` accepts). Bookkeeping is vectorized: each recorded event gets a token,
    ``_token[slot]`` names the slot's latest one, and a token whose event completed is forgotten
    (the slots still naming it count as ready).
    """

    def __init__(self) -> None:
        self._token = np.full(0, -1, dtype=np.int64)
        self._events: dict[int, Any] = {}
        self._next = 0

    def __len__(self) -> int:
        """Events recorded and not yet seen complete."""
        return len(self._events)

    def set(self, slots: SlotList, event: Any) -> None:
        """Slots ``slots`` are busy until ``event`` completes."""
        idx: npt.NDArray[np.int64] | slice
        if one_run(slots):  # the usual batch: a slice, no index array
            idx, top = slice(slots[0], slots[-1] + 1), slots[-1] + 1
        else:
            idx = slot_array(slots)
            if len(idx) == 0:
                return
            top = int(idx.max()) + 1
        if top > len(self._token):
            grown = np.full(max(top, 2 * len(self._token)), -1, dtype=np.int64)
            grown[: len(self._token)] = self._token
            self._token = grown
        token = self._next
        self._next += 1
        self._events[token] = event
        self._token[idx] = token
        if len(self._events) > 256:
            self._prune()

    def completed(self, event: Any) -> None:
        """``event`` is known to have completed (its caller synchronized it): forget it, so that
        later waits on its slots (e.g. handing them out again) skip it without a query."""
        for token in [t for t, e in self._events.items() if e is event]:
            del self._events[token]

    def _prune(self) -> None:
        for token in [t for t, e in self._events.items() if e.query()]:
            del self._events[token]

    def _tokens(self, slots: SlotList) -> list[int]:
        """Live tokens named by ``slots`` (a histogram over the live token span, no sort)."""
        if not self._events:
            return []
        idx = slot_array(slots)
        tokens = self._token[idx[idx < len(self._token)]]
        lo, hi = min(self._events), max(self._events)
        tokens = tokens[(tokens >= lo) & (tokens <= hi)]
        if len(tokens) == 0:
            return []
        if hi - lo > 4 * len(tokens) + 4096:  # a very old event still live: sort instead
            present = np.unique(tokens)
        else:
            present = np.flatnonzero(np.bincount(tokens - lo, minlength=hi - lo + 1)) + lo
        return [int(t) for t in present if int(t) in self._events]

    def pending(self, slots: SlotList) -> list[Any]:
        """Distinct events still in flight for ``slots`` (completed ones are forgotten)."""
        out = []
        for token in self._tokens(slots):
            event = self._events[token]
            if event.query():
                del self._events[token]
            else:
                out.append(event)
        return out

    def wait_stream(self, slots: SlotList, stream: Any) -> None:
        """Make ``stream`` wait for the pending copies of ``slots`` (the host does not block)."""
        for event in self.pending(slots):
            stream.wait_event(event)

    def wait_host(self, slots: SlotList) -> None:
        """Block the host until the pending copies of ``slots`` completed."""
        for token in self._tokens(slots):
            self._events.pop(token).synchronize()

    def wait_all(self) -> None:
        """Block the host until every pending copy completed; forget them all. The slots keep
        their old tokens: tokens only grow, so no later event is ever named by one (clearing
        them cost 12 us per call for a 2 GiB pool of 64 KiB pages)."""
        for event in self._events.values():
            event.synchronize()
        self._events.clear()

    def drop(self, slots: SlotList) -> None:
        """Forget ``slots`` (their memory is gone: the pool shrank)."""
        idx = slot_array(slots)
        self._token[idx[idx < len(self._token)]] = -1


SlotList = Sequence[int] | range | npt.NDArray[np.int64]


def slot_array(slots: SlotList) -> npt.NDArray[np.int64]:
    """``slots`` as a flat int64 array (no copy when it already is one; a list or tuple is read
    in compiled code where built, :func:`raykv.core.tiers.copy_plan.int64_array`)."""
    return int64_array(slots)


def one_run(slots: SlotList) -> bool:
    """Whether ``slots`` is a list forming one run (:func:`raykv.core.tiers.base.is_run`): the usual
    batch, slots allocated or committed together, is checked without numpy. False for anything
    else, including arrays (then :func:`raykv.core.tiers.cuda_copy.runs` finds the runs)."""
    return type(slots) is list and is_run(slots)


class ArgTables:
    """Kernel argument tables uploaded without allocating: a ring of page-locked host buffers and
    their device twins, each reused once the driver event recorded after the work that read it
    completed (so neither side is overwritten or freed while in use).

    Per launch: :meth:`take`, filling the table, :meth:`send` (one ``cuMemcpyHtoDAsync``), the
    launch on the same stream, then :meth:`record` on that stream.
    The ring comes round again ``RING`` tables later and waits for that event first."""

    RING = 4

    def __init__(self, device: int) -> None:
        self.device = device
        self._slots: list[dict[str, Any]] = [{} for _ in range(self.RING)]
        self._next = 0
        self._last: dict[str, Any] = {}

    def take(self, count: int, dtype: Any = np.int64) -> npt.NDArray[Any]:
        """The next ring buffer's page-locked host table, ``count`` items of ``dtype``, to fill
        before :meth:`send` (it waits first for the last work that read this buffer)."""
        import torch

        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.RING
        if "event" in slot:
            calls().event_synchronize(slot["event"])
        else:
            drv = driver()
            flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
            slot["handle"] = check(drv.cuEventCreate(flags), "cuEventCreate")
            slot["event"] = int(slot["handle"])
        nbytes = count * np.dtype(dtype).itemsize
        if slot.get("capacity", 0) < nbytes:
            capacity = max(nbytes, 2 * slot.get("capacity", 0), 8192)
            slot["host"] = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            slot["dev"] = torch.empty(capacity, dtype=torch.uint8, device=torch.device("cuda", self.device))
            slot["capacity"] = capacity
            slot["array"] = slot["host"].numpy()
        self._last = slot
        table: npt.NDArray[Any] = slot["array"][:nbytes].view(dtype)
        return table

    def send(self, stream_handle: int, nbytes: int) -> int:
        """Enqueue on ``stream_handle`` the upload of the first ``nbytes`` of the table
        :meth:`take` returned last; the device address of its first byte (the caller's thread
        must have the device's context)."""
        slot = self._last
        dev = int(slot["dev"].data_ptr())
        calls().htod_async(dev, int(slot["host"].data_ptr()), nbytes, stream_handle)
        return dev

    def record(self, stream_handle: int) -> None:
        """The last uploaded table is free once the work enqueued on ``stream_handle`` so far
        completed (call after the launch that reads it)."""
        calls().event_record(self._last["event"], stream_handle)

    def close(self) -> None:
        """Wait for the work reading the tables and free them."""
        drv = driver()
        for slot in self._slots:
            if "event" in slot:
                drv.cuEventSynchronize(slot["handle"])
                drv.cuEventDestroy(slot["handle"])
            slot.clear()

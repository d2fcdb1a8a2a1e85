"""The process-wide transfer runtime: one asyncio loop thread that owns every UCX call.

ucxx keeps one application context per process and ties its progress to an event loop, so every
page server and client of a process shares :func:`get_runtime`'s loop (a daemon thread). Blocking
callers use :meth:`TransferRuntime.run`; async callers already on the loop await directly.

UCX is imported lazily, on first use, after this module has put the configured UCX_* settings in
the environment (UCX reads them once, when its context starts). :func:`ucx_context` then logs the
active transports and warns loudly when device memory would have to go over TCP.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import re
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from raykv.core.errors import PageCorruptError, StateError, TransferError, TransferFailure
from raykv.core.threads import copy_threads, pieces

log = logging.getLogger(__name__)

T = TypeVar("T")

DEVICE_TRANSPORTS = ("cuda_ipc", "cuda_copy", "gdr_copy", "rc", "dc", "ud", "rocm_ipc", "rocm_copy")
_RESOURCE = re.compile(r"resource\s+\d+\s*:\s*md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)")


class TransferRuntime:
    """An event loop on a daemon thread. ``run``/``submit`` schedule coroutines on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="raykv-transfer", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def on_loop(self) -> bool:
        """True when called from the runtime's own thread."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        if not self.loop.is_running() and not self._thread.is_alive():
            coro.close()
            raise StateError("the transfer runtime has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (from any thread but the loop's own).

        On ``timeout`` the coroutine is cancelled (its cleanup runs) and TransferError is raised.
        """
        if self.on_loop:
            coro.close()
            raise StateError("TransferRuntime.run() called from the runtime's own loop; await instead")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TransferError(
                f"transfer did not finish within {timeout}s", reason=TransferFailure.TIMEOUT
            ) from None


_runtime: TransferRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> TransferRuntime:
    """The process's transfer runtime (started on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = TransferRuntime()
        return _runtime


INLINE_BYTES = 1 << 20
"""Copies and checksums of at most this many bytes run on the loop itself (a thread hop costs
more than they do); larger ones run in the default executor (zlib and numpy release the GIL)."""


async def within(coro: Coroutine[Any, Any, T], seconds: float) -> T:
    """``await coro``, cancelled after ``seconds`` (asyncio.TimeoutError); on 3.11+ without the
    extra task ``asyncio.wait_for`` makes (one per pull)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)


async def cancel_and_wait(fut: asyncio.Future[Any]) -> None:
    """Cancel ``fut`` and wait until it is done (its outcome dropped). A cancellation of the
    caller meanwhile still raises: awaiting ``fut`` under a suppress would swallow it, and the
    caller would run on as if never cancelled."""
    fut.cancel()
    await asyncio.wait({fut})
    if not fut.cancelled():
        fut.exception()  # retrieved


async def offload(nbytes: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: inline when ``nbytes`` is small, else in the loop's default executor."""
    if nbytes <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def map_rows(row_bytes: int, count: int, fn: Callable[[int, int], list[T]]) -> list[T]:
    """``fn(first, last)`` over rows ``0 .. count``, results concatenated in row order.

    Small jobs run inline; larger ones in pieces of at least PIECE_BYTES on the copy threads, in
    parallel (numpy copies and zlib checksums release the GIL). A cancelled caller does not stop
    pieces already running: ``fn`` must only touch memory that stays valid (it always does here:
    the pull's own buffer, or tier memory that lives as long as its manager).
    """
    total = row_bytes * count
    if total <= INLINE_BYTES:
        return fn(0, count)
    pool = copy_threads()
    loop = asyncio.get_running_loop()
    parts = await asyncio.gather(*(loop.run_in_executor(pool, fn, a, b) for a, b in pieces(total, count)))
    return [x for part in parts for x in part]


# ---- UCX --------------------------------------------------------------------------------------
_ucx_settings: dict[str, str] = {}


def configure_ucx(
    net_devices: str | None = None, tls: str | None = None, progress: str | None = None
) -> None:
    """Put UCX settings in the environment before UCX starts (an existing env var wins):
    UCX_NET_DEVICES, UCX_TLS and ucxx's UCXPY_PROGRESS_MODE (``TransferConfig.ucx_progress``).

    Also silences UCX's warning about unused UCX_* variables and, in ucxx's thread progress mode,
    has it complete requests through its notifier thread (``UCXPY_ENABLE_PYTHON_FUTURE=1``):
    without it every awaited UCX request polls the event loop until it completes, which costs
    about half a core per pending receive and delays everything else on the loop (control
    messages, copies). Settings asked for after UCX has started cannot apply any more; that is
    logged, not raised.
    """
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    settings = (("UCX_NET_DEVICES", net_devices), ("UCX_TLS", tls), ("UCXPY_PROGRESS_MODE", progress))
    for name, value in settings:
        if value is None:
            continue
        if _ucx_started():
            if os.environ.get(name) != value:
                log.warning("UCX already started; %s=%s cannot apply any more", name, value)
            continue
        os.environ.setdefault(name, value)
        _ucx_settings[name] = os.environ[name]
    if _ucx_started():
        return
    future = "UCXPY_ENABLE_PYTHON_FUTURE"
    if os.environ.get("UCXPY_PROGRESS_MODE", "thread").startswith("thread"):
        if future not in os.environ:
            os.environ[future] = _ucx_settings[future] = "1"
    elif _ucx_settings.get(future) == os.environ.get(future):  # ours, for the thread mode: drop it
        os.environ.pop(future, None)
        _ucx_settings.pop(future, None)


def _ucx_started() -> bool:
    core = __import__("sys").modules.get("ucxx.core")
    return core is not None and getattr(core, "_ctx", None) is not None


def active_transports(context_info: str) -> list[str]:
    """Transport/device pairs ("tcp/lo", "posix/memory", ...) listed in UCX's context info."""
    return [m.group(1) for m in _RESOURCE.finditer(context_info)]


def transport_warnings(transports: list[str], device_memory: bool) -> list[str]:
    """What is wrong with ``transports`` for this process's memory (empty list: nothing).

    With device (GPU) memory and none of UCX's GPU-capable transports active, device pages would be
    staged through host memory and cross the network over TCP: a large, silent slowdown.
    """
    names = {t.split("/", 1)[0] for t in transports}
    out = []
    if device_memory and not names & set(DEVICE_TRANSPORTS):
        out.append(
            "device memory would go over TCP: no CUDA/RDMA UCX transport is active "
            f"(active: {', '.join(transports) or 'none'}; UCX_TLS={os.environ.get('UCX_TLS', 'all')}). "
            "Install UCX with CUDA support and enable cuda_copy,cuda_ipc (and rc/dc for RDMA)."
        )
    if not transports:
        out.append("UCX lists no transports at all")
    return out


_ucx_ready = False
_futures_worker: Any = None


def ucx_context(device_memory: bool = False) -> Any:
    """The ucxx application context (started on first call; must run on the runtime loop).

    The first call logs the active transports; every call with ``device_memory`` checks them and
    logs a loud warning when device memory would go over TCP. Raises TransferError when ucxx is
    not installed.
    """
    global _ucx_ready, _futures_worker
    configure_ucx()
    try:
        import ucxx
    except ImportError as exc:
        raise TransferError(f"UCX transfers need ucxx ({exc})", reason=TransferFailure.UNAVAILABLE) from None
    ctx = ucxx.core._get_ctx()
    transports = active_transports(ctx.ucp_context_info)
    if not _ucx_ready:
        _ucx_ready = True
        if getattr(ctx.worker, "enable_python_future", False):
            _futures_worker = ctx.worker
            refill_futures()
        log.info(
            "UCX %s started: transports %s, %s progress (UCX_TLS=%s, UCX_NET_DEVICES=%s)",
            ucxx.__ucx_version__,
            ", ".join(transports),
            getattr(ctx, "progress_mode", "?"),
            os.environ.get("UCX_TLS", "all"),
            os.environ.get("UCX_NET_DEVICES", "all"),
        )
    for warning in transport_warnings(transports, device_memory):
        log.warning("!!! raykv transfer: %s", warning)
    return ctx


def refill_futures() -> None:
    """Top up ucxx's pool of request futures (100 at most; a no-op while it is half full).

    Its notifier thread refills the pool only between completions, and a request that finds it
    empty makes UCXX print a warning to stdout: a burst of requests (one per chunk) must refill
    right before each one (:func:`tag_send`, :func:`tag_recv`).
    """
    if _futures_worker is not None:
        _futures_worker.populate_python_futures_pool()


async def tag_send(endpoint: Any, buf: Any, tag: int) -> Any:
    """``endpoint.send(buf, tag)`` (forced tag), with a future ready for it."""
    refill_futures()
    return await endpoint.send(buf, tag=tag, force_tag=True)


async def tag_recv(endpoint: Any, buf: Any, tag: int) -> Any:
    """``endpoint.recv(buf, tag)`` (forced tag), with a future ready for it."""
    refill_futures()
    return await endpoint.recv(buf, tag=tag, force_tag=True)


def ucx_address(ctx: Any) -> bytes:
    """This process's UCX worker address (for a peer's endpoint back to us)."""
    return bytes(ctx.worker_address.tobytes())


async def ucx_endpoint(ctx: Any, address: bytes) -> Any:
    """An endpoint to the worker at ``address`` (error handling on: a dead peer fails requests)."""
    from ucxx._lib import libucxx

    return await ctx.create_endpoint_from_worker_address(libucxx.UCXAddress.create_from_buffer(address))


def abort_endpoint(ep: Any) -> None:
    """Close ``ep`` at once; its in-flight requests are cancelled, so buffers are free again."""
    if ep is None:
        return
    try:
        ep.abort(period=10**9)
    except Exception:  # already closed or errored: nothing left in flight
        log.debug("aborting a UCX endpoint failed", exc_info=True)


def as_transfer_error(exc: Exception) -> TransferError:
    """A TransferError for an OS or UCX error, or a source page that failed its checksum
    (anything else is a bug and is re-raised)."""
    if isinstance(exc, TransferError):
        return exc
    if isinstance(exc, PageCorruptError):
        return TransferError(
            f"a page failed its checksum at the source ({exc})", reason=TransferFailure.INTEGRITY
        )
    if isinstance(exc, TimeoutError):
        return TransferError("timed out", reason=TransferFailure.TIMEOUT)
    if isinstance(exc, (OSError, ConnectionError)):
        return TransferError(f"connection failed ({type(exc).__name__})", reason=TransferFailure.CLOSED)
    if type(exc).__module__.startswith("ucxx"):
        return TransferError(
            f"UCX transfer failed ({type(exc).__name__}: {str(exc)[:200]})", reason=TransferFailure.UCX
        )
    raise exc


# ---- backpressure -----------------------------------------------------------------------------
class ByteBudget:
    """An asyncio semaphore counted in bytes: at most ``capacity`` bytes held at once (FIFO).

    A request larger than the whole capacity is admitted only when nothing else is held (so it
    can never deadlock). ``release`` is synchronous (safe in ``finally`` during cancellation).
    ``peak`` records the most bytes ever held (tests check the bound). Loop-thread only.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        return self.in_use == 0 or self.in_use + nbytes <= self.capacity

    def _take(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit, then hold them. Cancellation leaves nothing held."""
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)  # granted just as we were cancelled
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, waiter = self._waiters.popleft()
            if not waiter.done():
                self._take(nbytes)
                waiter.set_result(None)

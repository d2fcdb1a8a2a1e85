"""Landing pulled pages: running the caller's ``land`` function (an import) in a worker thread.

``PageClient.pull_land`` hands the pages of a pull to ``land(pulled, confirm)``, which runs in the
loop's default executor (an import copies megabytes and takes the manager's lock; the loop must
stay free). ``confirm`` is a :class:`LeaseCheck`: the import calls it after writing the rows and
before inserting any block (``CacheManager.import_pages(confirm=...)``). On the shm path the rows
were read straight out of the peer's shared tier, so confirming sends ``done`` and waits for the
peer's ``ack`` (the lease lasted until the reading was over); on every path it fails once the pull
has been cancelled, so a cancelled or timed-out pull imports nothing unless the import had already
passed its confirm.

A ucx payload of several chunks streams when the ``land`` has a ``stream`` (:data:`StreamLand`,
``pull_into``'s import does; see :func:`streams`): the landing starts with the header, on a
thread of :data:`STREAM_THREADS`, and copies each chunk's rows into the destination tier as soon
as they arrived (:class:`Arrivals`) while the next chunks are still on the wire; it inserts the
blocks only once the whole payload arrived and was verified, so a failed pull still imports
nothing. The destination pages are allocated (evicting as needed) when the header arrives rather
than after the payload: a pull that then fails has given back its pages, but what it evicted
for them stays evicted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from raykv.core.errors import TransferError, TransferFailure
from raykv.transfer.pages.payload import usable_cores
from raykv.transfer.pages.results import PulledPages

T = TypeVar("T")

Land = Callable[[PulledPages, Callable[[], None]], T]
"""``land(pulled, confirm) -> result``: imports ``pulled``; must call ``confirm()`` (or have the
import call it) before the pages become visible, once their rows have been read."""

StreamLand = Callable[[PulledPages, "Arrivals", Callable[[], None]], T]
"""``land.stream(pulled, arrivals, confirm) -> result``: as a :data:`Land`, started before the
rows arrive: it reads row ``i`` of ``pulled.data`` only once ``arrivals`` says it arrived, and
makes nothing visible before :meth:`Arrivals.wait_done` and ``confirm()`` returned."""


class LeaseCheck:
    """The ``confirm`` of one landing; called from the worker thread, cancelled from the loop.

    ``finish`` (optional): a coroutine factory run on ``loop`` by the first call (the shm path's
    ``done``/``ack`` exchange), waited for at most ``timeout`` seconds. ``done`` says it ran.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        finish: Callable[[], Coroutine[Any, Any, None]] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.loop = loop
        self.finish = finish
        self.timeout = timeout
        self.done = finish is None
        self.cancelled = False
        self._future: concurrent.futures.Future[None] | None = None

    def __call__(self) -> None:
        """Raise unless the pages may become visible (see the module docstring)."""
        self._check()
        if not self.done:
            assert self.finish is not None
            self._future = asyncio.run_coroutine_threadsafe(self.finish(), self.loop)
            self._future.result(self.timeout)
            self.done = True
        self._check()

    def _check(self) -> None:
        if self.cancelled:
            raise TransferError(
                "the pull was cancelled while its pages were imported", reason=TransferFailure.CANCELLED
            )

    def cancel(self) -> None:
        """The pull was cancelled: make the next (or the pending) confirmation fail."""
        self.cancelled = True
        if self._future is not None:
            self._future.cancel()


class Arrivals:
    """How many leading rows of a payload have arrived, for a landing that copies them while the
    rest is received (``PageClient.pull_land`` with a ``land.stream``): the loop reports, the
    landing's thread waits.

    The loop calls :meth:`arrived` as chunks land, then exactly one of :meth:`finish` (every row
    arrived and was verified) or :meth:`fail`; until then :meth:`wait_rows`/:meth:`wait_done`
    block, at most ``timeout`` seconds each (then TransferError, reason "timeout").
    """

    def __init__(self, total: int, timeout: float | None) -> None:
        self.total = total
        self.timeout = timeout
        self.rows = 0
        self.done = False
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def arrived(self, rows: int) -> None:
        """Rows ``0 .. rows`` are final (later calls only move forward)."""
        with self._cond:
            self.rows = max(self.rows, min(rows, self.total))
            self._cond.notify_all()

    def finish(self) -> None:
        """Every row arrived and the payload was verified."""
        with self._cond:
            self.rows, self.done = self.total, True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The payload will not complete: waiters raise TransferError (a copy of ``error`` when it
        is one, else reason "cancelled")."""
        with self._cond:
            if self.error is None and not self.done:
                self.error = error
            self._cond.notify_all()

    def wait_rows(self, rows: int) -> int:
        """Block until more than ``rows`` rows arrived (or all); the number arrived."""
        self._wait(lambda: self.rows > min(rows, self.total - 1))
        return self.rows

    def wait_done(self) -> None:
        """Block until :meth:`finish`."""
        self._wait(lambda: self.done)

    def _wait(self, ready: Callable[[], bool]) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            while not ready():
                if self.error is not None:
                    raise _as_transfer_error(self.error)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferError("the payload did not arrive in time", reason=TransferFailure.TIMEOUT)
                self._cond.wait(left)


def _as_transfer_error(error: BaseException) -> TransferError:
    """A new error for the landing's thread (the loop raises ``error`` itself to the caller)."""
    if isinstance(error, TransferError):
        return TransferError(str(error), **error.__dict__)
    return TransferError("the pull stopped before its pages arrived", reason=TransferFailure.CANCELLED)


INLINE_LAND_BYTES = 1 << 20
"""A landing of at most this many bytes runs on the loop itself when its ``land`` says it is
quick (a true ``quick`` attribute: ``pull_into``'s import, a copy of at most 1 MiB and the
inserts) and its check waits for nothing (the ucx path): that costs less than the two thread hops
of the executor. Other lands may block (they run where blocking is allowed)."""


class StreamThreads:
    """The threads streamed landings run on, at most ``size`` at once. A streamed landing blocks
    its thread while rows arrive; in the loop's default executor enough of them could starve what
    the transfers themselves run there (a page server's gathers, other landings), so they have a
    pool of their own, and a landing that finds none free lands whole."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.busy = 0
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def take(self) -> bool:
        """Reserve a thread; False when all are busy."""
        with self._lock:
            if self.busy >= self.size:
                return False
            self.busy += 1
            return True

    def give(self) -> None:
        """Give back a thread :meth:`take` reserved."""
        with self._lock:
            self.busy -= 1

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="raykv-land")
            return self._pool


STREAM_THREADS = StreamThreads(8)

STREAM_FRESH_CORES = 8
"""Below this many usable cores, a payload that cannot land in a spare buffer (it lands in fresh
memory) lands whole: copying rows while the kernel still faults in the later ones measured 14%
slower on 2 cores (256 x 2 MiB), and 24% faster on 32."""


def streams(header: Any, spare_bytes: int) -> bool:
    """Whether a ucx payload (its ``wire.Header``) lands as it arrives: in two chunks or more
    (the first is copied while the next arrives) of more than :data:`INLINE_LAND_BYTES`, into a
    spare buffer (at most ``spare_bytes``) or on a host with :data:`STREAM_FRESH_CORES` cores."""
    nbytes = len(header.keys) * header.page_bytes
    if len(header.layout) < 2 or nbytes <= INLINE_LAND_BYTES:
        return False
    return nbytes <= spare_bytes or usable_cores() >= STREAM_FRESH_CORES


async def run_land(land: Land[T], pulled: PulledPages, check: LeaseCheck) -> T:
    """``land(pulled, check)`` in the default executor (on the loop when small, quick and
    waiting for nothing, see :data:`INLINE_LAND_BYTES`); its result or its exception.

    Cancelling the caller does not abandon the worker thread (it may be reading the peer's shared
    tier, which must stay leased until it stops): the check is cancelled, the thread is waited
    for, then CancelledError is raised.
    """
    if check.finish is None and pulled.nbytes <= INLINE_LAND_BYTES and getattr(land, "quick", False):
        return land(pulled, check)
    return await run_checked(lambda confirm: land(pulled, confirm), check)


async def run_streamed(
    stream: StreamLand[T], pulled: PulledPages, arrivals: Arrivals, receive: Awaitable[object]
) -> T:
    """``stream(pulled, arrivals, check)`` on a thread the caller took from
    :data:`STREAM_THREADS` (given back here) while ``receive`` (which reports to ``arrivals``)
    fills ``pulled.data``; its result once both are done.

    ``receive`` failing or cancelled (also when the cancellation was asked while it ran but never
    reached it): ``arrivals`` fails (the landing raises at its next wait, before anything became
    visible), the landing is waited for, then the receive's exception is raised. Cancelled after
    the receive: as :func:`run_land`.
    """
    check = LeaseCheck(asyncio.get_running_loop())
    work = functools.partial(stream, pulled, arrivals)
    task = asyncio.ensure_future(run_checked(work, check, STREAM_THREADS.executor()))
    try:
        try:
            await receive
            if _cancel_pending():  # asked while the receive never waited: the pages stay out
                raise asyncio.CancelledError
        except BaseException as exc:
            arrivals.fail(exc)
            check.cancel()
            if await _outlast(task):
                raise asyncio.CancelledError from exc
            raise
        arrivals.finish()
        return await task
    finally:
        STREAM_THREADS.give()


def _cancel_pending() -> bool:
    """Whether the current task was asked to cancel and has not seen it yet (a coroutine that
    never suspends after the request would otherwise run on to its end)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _outlast(task: asyncio.Future[Any], on_cancel: Callable[[], object] | None = None) -> bool:
    """Wait until ``task`` is done whatever cancels us meanwhile (``on_cancel`` runs each time);
    whether we were cancelled. Its exception counts as retrieved (the caller decides what to raise)."""
    interrupted = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            interrupted = True
            if on_cancel is not None:
                on_cancel()
    if not task.cancelled():
        task.exception()
    return interrupted


async def run_checked(
    work: Callable[[LeaseCheck], T], check: LeaseCheck, executor: concurrent.futures.Executor | None = None
) -> T:
    """``work(check)`` in ``executor`` (default: the loop's), with :func:`run_land`'s
    cancellation rules."""
    future = asyncio.get_running_loop().run_in_executor(executor, work, check)
    if await _outlast(future, check.cancel):
        raise asyncio.CancelledError  # the caller sees the cancellation instead of the result
    return future.result()

"""Landing pulled pages: running the caller's ``land`` function (an import) in a worker thread.

``PageClient.pull_land`` hands the pages of a pull to ``land(pulled, confirm)``, which runs in the
loop's default executor (an import copies megabytes and takes the manager's lock; the loop must
stay free). ``confirm`` is a :class:`LeaseCheck`: the import calls it after writing the rows and
before inserting any block (``CacheManager.import_pages(confirm=...)``). On the shm path the rows
were read straight out of the peer's shared tier, so confirming sends ``done`` and waits for the
peer's ``ack`` (the lease lasted until the reading was over); on every path it fails once the pull
has been cancelled, so a cancelled or timed-out pull imports nothing unless the import had already
passed its confirm.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from raykv.errors import TransferError
from raykv.transfer.results import PulledPages

T = TypeVar("T")

Land = Callable[[PulledPages, Callable[[], None]], T]
"""``land(pulled, confirm) -> result``: imports ``pulled``; must call ``confirm()`` (or have the
import call it) before the pages become visible, once their rows have been read."""


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
            raise TransferError("the pull was cancelled while its pages were imported", reason="cancelled")

    def cancel(self) -> None:
        """The pull was cancelled: make the next (or the pending) confirmation fail."""
        self.cancelled = True
        if self._future is not None:
            self._future.cancel()


INLINE_LAND_BYTES = 1 << 20
"""A landing of at most this many bytes runs on the loop itself when its ``land`` says it is
quick (a true ``quick`` attribute: ``pull_into``'s import, a copy of at most 1 MiB and the
inserts) and its check waits for nothing (the ucx path): that costs less than the two thread hops
of the executor. Other lands may block (they run where blocking is allowed)."""


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


async def run_checked(work: Callable[[LeaseCheck], T], check: LeaseCheck) -> T:
    """``work(check)`` in the default executor, with :func:`run_land`'s cancellation rules."""
    future = asyncio.get_running_loop().run_in_executor(None, work, check)
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
            check.cancel()
    if cancelled:
        if not future.cancelled():
            future.exception()  # retrieved: the caller sees the cancellation instead
        raise asyncio.CancelledError
    return future.result()

"""What keeps a page server's connections bounded: caps, waits with deadlines, paced logs, closes.

:class:`raykv.transfer.server.PageServer` admits each accepted connection through
:class:`ConnectionSlots` (at most ``max_connections_per_peer`` per peer host and
``max_connections`` in all; one over a cap is refused at once, never queued), waits for each
request with :func:`frame_start` (the idle timeout), logs what unauthenticated peers cause through
a :class:`LogLimiter` (a bounded number of lines per minute, whatever the peers send) and ends
every connection with :func:`close_stream` (its socket is released even when the peer stopped
reading). The deadlines themselves are ``TransferConfig`` fields (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from raykv.core.errors import TransferError, TransferFailure

CLOSE_GRACE_S = 1.0
"""How long a closed connection may take to flush what is left in its write buffer; after that
its socket is aborted (a peer that stopped reading cannot keep it open)."""


class ConnectionSlots:
    """The connections open now, per peer host and in total, under two caps.

    :meth:`admit` takes a slot or says no (never waits); every admitted connection gives its slot
    back with :meth:`release` exactly once. A host's entry exists only while it holds a slot, so
    the map never holds more than ``total_cap`` entries. Loop-thread only."""

    def __init__(self, per_peer: int, total_cap: int) -> None:
        self.per_peer = per_peer
        self.total_cap = total_cap
        self.total = 0
        self._by_host: dict[str, int] = {}

    def admit(self, host: str) -> bool:
        """Take a slot for a connection from ``host``; False (nothing taken) when a cap is reached."""
        held = self._by_host.get(host, 0)
        if held >= self.per_peer or self.total >= self.total_cap:
            return False
        self._by_host[host] = held + 1
        self.total += 1
        return True

    def release(self, host: str) -> None:
        """Give back a slot :meth:`admit` took for ``host``."""
        held = self._by_host[host] - 1
        if held:
            self._by_host[host] = held
        else:
            del self._by_host[host]
        self.total -= 1

    def held(self, host: str) -> int:
        """Connections open now from ``host``."""
        return self._by_host.get(host, 0)

    def by_host(self) -> dict[str, int]:
        """A copy of the open connections per peer host."""
        return dict(self._by_host)


class LogLimiter:
    """At most ``burst`` lines per ``interval_s`` through ``logger``; the first line of the next
    window says how many were dropped. Meant for events peers can cause at will (refused
    connections): the log stays bounded whatever they send. Callers pass only values they chose
    (reasons from :class:`TransferFailure`, addresses), never a peer's text."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 10,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self.dropped = 0
        """Lines dropped in the current window (reported and reset when the next one starts)."""
        self._window = -float("inf")
        self._used = 0

    def log(self, level: int, msg: str, *args: Any, exc_info: BaseException | None = None) -> bool:
        """Log one line (with ``exc_info``'s traceback when given) unless this window's ``burst``
        is spent; True when it was logged."""
        now = self.clock()
        if now - self._window >= self.interval_s:
            if self.dropped:
                self.logger.log(
                    level, "(%d similar lines dropped in %g s)", self.dropped, self.interval_s, stacklevel=2
                )
            self._window, self._used, self.dropped = now, 0, 0
        if self._used >= self.burst:
            self.dropped += 1
            return False
        self._used += 1
        self.logger.log(level, msg, *args, exc_info=exc_info, stacklevel=2)
        return True


async def frame_start(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """Wait up to ``seconds`` for the first byte of the peer's next message: that byte, or None
    when none came (the caller closes an idle connection). EOF raises TransferError "closed"."""
    try:
        async with asyncio.timeout(seconds):
            first = await reader.read(1)
    except TimeoutError:
        return None
    if not first:
        raise TransferError("connection closed by peer", reason=TransferFailure.CLOSED)
    return first


def close_stream(writer: asyncio.StreamWriter, grace_s: float = CLOSE_GRACE_S) -> None:
    """Close ``writer``'s connection: what it still has to send goes out first, but for at most
    ``grace_s`` seconds; then the socket is aborted (its fd released) whatever the peer does."""
    transport = writer.transport
    writer.close()
    if transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(grace_s, transport.abort)

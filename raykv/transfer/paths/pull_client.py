"""What the client side of a transfer path may use of a page client (:class:`PullClient`).

:class:`raykv.transfer.client.PageClient` is one; the path modules (:mod:`raykv.transfer.paths.base`)
name this Protocol instead of the class, so they sit below the client.
"""

from __future__ import annotations

from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from raykv.transfer.net.config import Peer, TransferConfig
from raykv.transfer.net.connection import ClientConn
from raykv.transfer.net.runtime import ByteBudget
from raykv.transfer.pages.landing import Land
from raykv.transfer.pages.results import ClientStats
from raykv.transfer.paths.peer_pools import PeerPools

T = TypeVar("T")


class PullClient(Protocol):
    """What the client side of a path uses of a page client (:class:`raykv.transfer.client.PageClient`)."""

    config: TransferConfig
    node_id: str
    stats: ClientStats
    gpu_pools: PeerPools

    @property
    def budget(self) -> ByteBudget:
        """The byte budget of this client's receive buffers (over all peers)."""
        ...

    async def checkout(self, peer: tuple[str, int]) -> ClientConn:
        """An idle authenticated connection to ``peer`` that is still open, or a new one; give it
        back with :meth:`checkin` after a clean exchange, else ``close()`` it."""
        ...

    def checkin(self, peer: tuple[str, int], conn: ClientConn) -> None:
        """Give ``conn`` back for later pulls from ``peer`` (no request may be in flight on it)."""
        ...

    def connection(self, peer: tuple[str, int]) -> AbstractAsyncContextManager[ClientConn]:
        """An authenticated connection to ``peer`` for one or more batches: back to the idle pool
        when the block ends normally, closed when it raises."""
        ...

    def new_request(self) -> int:
        """A request id not used before on this client."""
        ...

    async def guard(
        self, endpoint: tuple[str, int], timeout_s: float | None, coro: Coroutine[Any, Any, T]
    ) -> T:
        """``coro`` under the pull timeout; every failure counted and raised as a TransferError."""
        ...

    def count(self, path: str, peer: tuple[str, int], pages: int, nbytes: int) -> None:
        """Count one pull of ``pages`` pages on ``path`` from ``peer``."""
        ...

    async def pull_land(
        self,
        peer: Peer,
        keys: Any,
        land: Land[T],
        prefer_shm: bool = True,
        timeout_s: float | None = None,
        verify: bool | None = None,
        one_sided: bool = True,
    ) -> T:
        """Pull and land (see :meth:`raykv.transfer.client.PageClient.pull_land`)."""
        ...

    def land_local(self, peer: Peer, keys: Any, land: Land[T]) -> T | None:
        """A one-sided landing (see :meth:`raykv.transfer.client.PageClient.land_local`)."""
        ...

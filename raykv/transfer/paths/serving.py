"""The page server's side of one connection, as the transfer paths see it (:class:`ServerConn`).

:class:`raykv.transfer.server.PageServer` accepts and authenticates connections and leases the
blocks of each pull; the path that serves the pull (:mod:`raykv.transfer.paths.base`) talks to the
client only through a :class:`ServerConn`: control messages (:meth:`ServerConn.send`), the pull's
header (:meth:`ServerConn.send_header`), the test hooks between header and payload
(:meth:`ServerConn.after_header`), the client's ``done`` (:meth:`ServerConn.await_done`) and the
UCX endpoint to the client (:meth:`ServerConn.open_endpoint`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import raykv.transfer.net.wire as wire
from raykv.core.errors import TransferError, TransferFailure
from raykv.core.manager import CacheManager
from raykv.core.records import BlockLease, LeasedBlock
from raykv.transfer.net.config import TransferConfig
from raykv.transfer.net.runtime import abort_endpoint, ucx_endpoint


@dataclass
class ServerFaults:
    """Test hooks, all off by default.

    ``corrupt_payload``: flip one byte of each sent chunk (a copy; the tier is untouched); on the
    shm path, where the client reads the true bytes, spoil page 0's checksum (when it asks for
    checksums: without them there is nothing in transit to corrupt).
    ``drop_after_header``: close the connection right after the header (a peer dying mid-transfer).
    ``stall_after_header_s``: sleep after the header (a slow peer; lets a test cancel or kill).
    ``drop_after_chunks``: over ucx, close the connection once that many of the chunks sent after
    the header were delivered (a peer dying mid-payload; 0: off).
    """

    corrupt_payload: bool = False
    drop_after_header: bool = False
    stall_after_header_s: float = 0.0
    drop_after_chunks: int = 0


@dataclass(frozen=True)
class ServerSite:
    """What every connection of one page server shares: its manager, settings, test hooks, node id
    and UCX context (None without UCX)."""

    manager: CacheManager
    config: TransferConfig
    faults: ServerFaults
    node_id: str
    ucx_ctx: Any = None


class PullRequest(NamedTuple):
    """One pull being served: its id, the lease the server holds for it (ended by the server after
    the path returned or failed) and the base UCX tag of its payload messages."""

    request_id: int
    lease: BlockLease
    tag: int


@dataclass
class ServerConn:
    """One authenticated control connection, server side (see the module docstring).

    ``node`` and ``ucx_address`` are the client's (from its ``auth``); ``sums``, ``ack``,
    ``posted`` and ``split`` are what the current pull asked for (checksums on the shm path, an
    ``ack`` of its ``done``, a receive posted with the request for chunk 0, and chunk 1's too
    with chunk 0 taking up to ``split`` pages; 0: no split). ``endpoint``: the UCX endpoint to the
    client once opened (aborted by :meth:`drop_endpoint` and when the connection ends).
    """

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: str
    site: ServerSite
    node: str = ""
    ucx_address: bytes | None = None
    endpoint: Any = None
    sums: bool = True
    ack: bool = False
    posted: bool = False
    split: int = 0

    async def send(self, msg: dict[str, Any]) -> None:
        """Write one control message and wait until the stream took it (TransferError "limit" for
        a message over ``max_header_bytes``; a broken stream raises as asyncio does)."""
        self.writer.write(wire.encode(msg, self.site.config.max_header_bytes))
        await self.writer.drain()

    async def try_send(self, msg: dict[str, Any]) -> None:
        """:meth:`send`, at most one second, ignoring every failure (a last word to a peer that
        may be gone)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send(msg), 1.0)

    def header(
        self,
        pull: PullRequest,
        path: str,
        layout: Sequence[int],
        sums: Sequence[int] | None = None,
        blocks: Sequence[LeasedBlock] | None = None,
    ) -> dict[str, Any]:
        """The header message of ``pull`` on ``path``: ``blocks`` (default: every leased block),
        ``layout`` (chunk sizes or slots, as the path defines it) and the checksums if known."""
        blocks = pull.lease.blocks if blocks is None else blocks
        columns = list(zip(*blocks)) if blocks else [()] * 4  # key, parent, root flag, tokens, ...
        return wire.Header(
            pull.request_id,
            path,
            self.site.manager.layout.page_bytes,
            columns[0],
            columns[1],
            columns[2],
            columns[3],
            tuple(layout),
            tuple(sums) if sums is not None else None,
        ).to_msg()

    async def send_header(
        self,
        pull: PullRequest,
        path: str,
        layout: Sequence[int],
        sums: Sequence[int] | None = None,
        blocks: Sequence[LeasedBlock] | None = None,
    ) -> None:
        """Send :meth:`header` (same arguments)."""
        await self.send(self.header(pull, path, layout, sums, blocks))

    async def after_header(self) -> None:
        """Run the test hooks that go between header and payload (``ServerFaults``): a drop
        raises TransferError "fault", a stall sleeps and ends early with "closed" when the peer
        goes. Returns at once when the hooks are off."""
        faults = self.site.faults
        if faults.drop_after_header:
            raise TransferError(
                "connection dropped after the header (test hook)", reason=TransferFailure.FAULT
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + faults.stall_after_header_s
        while loop.time() < deadline:
            if self.peer_gone():
                raise TransferError("the peer went away", reason=TransferFailure.CLOSED)
            await asyncio.sleep(0.01)

    async def read(self) -> dict[str, Any]:
        """The client's next control message (at most ``max_header_bytes``; once it has started
        arriving, all of it within ``read_timeout_s``, else TransferError "timeout")."""
        config = self.site.config
        return await wire.read_message(self.reader, config.max_header_bytes, config.read_timeout_s)

    async def await_done(self, request_id: int, sends: asyncio.Future[Any] | None) -> None:
        """Wait for the client's ``done`` of ``request_id`` and for ``sends`` (our payload sends,
        None: nothing to wait for); a closed connection or a failed send raises at once (the
        sends and the read are then cancelled)."""
        if sends is None:  # nothing else to watch: read it directly
            msg = wire.expect_type(await self.read(), "done")
            if msg.get("id") != request_id:
                raise wire.protocol_error("'done' for another request")
            return
        done = asyncio.ensure_future(self.read())
        waiting: set[asyncio.Future[Any]] = {done, sends}
        try:
            while waiting:
                finished, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for fut in finished:
                    result = fut.result()
                    if fut is done:
                        msg = wire.expect_type(result, "done")
                        if msg.get("id") != request_id:
                            raise wire.protocol_error("'done' for another request")
        except BaseException:
            done.cancel()
            sends.cancel()
            raise

    async def open_endpoint(self) -> Any:
        """The UCX endpoint to the client, opened on first use (TransferError "unavailable" when
        either side has no UCX); valid until :meth:`drop_endpoint` or the connection ends."""
        if self.endpoint is None:
            if self.site.ucx_ctx is None or self.ucx_address is None:
                raise TransferError("no UCX path to this peer", reason=TransferFailure.UNAVAILABLE)
            self.endpoint = await ucx_endpoint(self.site.ucx_ctx, self.ucx_address)
        return self.endpoint

    def drop_endpoint(self) -> None:
        """Abort the UCX endpoint (UCX stops reading the pages of its sends, so a lease may end
        right after); the next :meth:`open_endpoint` opens a new one."""
        abort_endpoint(self.endpoint)
        self.endpoint = None

    def peer_gone(self) -> bool:
        """The peer closed the connection (EOF), or it broke (a reset while we wrote marks the
        transport closing and leaves the reader an exception, not EOF)."""
        return self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None


assert LeasedBlock._fields[:4] == ("key", "parent_key", "parent_is_root", "num_tokens")  # header's columns

"""PageServer: serves a CacheManager's committed pages to authenticated peers.

One server per manager. Its control listener (asyncio TCP) binds to ``TransferConfig.host`` (the
node's address in a deployment, 127.0.0.1 in tests); each connection first runs the token
challenge-response (:mod:`raykv.transfer.auth`), then serves any number of pulls, one at a time.
(ucxx's Python listener cannot bind to one interface, hence a plain TCP control listener; the
payload itself goes over UCX endpoints built from the peers' worker addresses.)

A pull leases the committed blocks among the requested keys (so the pages stay in place), sends a
header, the payload, and the per-page checksums, and ends the lease once the client reports
``done`` and the local sends have completed, or when anything fails: a dead or slow peer, a
timeout, cancellation, server shutdown. A failing endpoint is aborted *before* the lease ends, so
UCX never reads a page that has been released. Paths:

- ``shm``: the client runs on this node (same node id) and every leased page is on this manager's
  shared host tier: the header carries slot numbers and the client copies from its read-only
  mapping of the tier file. Checksums only when the client asks; otherwise the server
  acknowledges the client's ``done`` (the lease lasted while the client read).
- ``direct``: asked for by :func:`raykv.transfer.device.pull_direct`: a few large UCX messages
  from the pages' own device, per-page digests computed there (:mod:`raykv.transfer.device`).
- ``gpu_peer``: asked for by :func:`raykv.transfer.gpu_peer.pull_gpu_peer_into` from this node:
  slots in the header, the client maps this manager's GPU tier (exported once, on first use) and
  copies the leading run of GPU-resident leased pages device to device; ``ack`` as on ``shm``.
- ``ucx``: everything else; the payload goes as a few large UCX tag messages (``chunk_bytes``
  each) straight from tier memory where possible (:class:`raykv.transfer.payload.LeasedPayload`).

Backpressure: at most ``server_inflight_bytes`` of payload are being served at once (a byte
semaphore; further pulls wait their turn).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raykv.core.errors import RayKVError, TransferError, TransferFailure
from raykv.core.manager import CacheManager
from raykv.core.records import BlockLease, LeasedBlock, page_checksum
from raykv.core.tiers.host import HostPool
from raykv.core.types import TierKind
from raykv.transfer import wire
from raykv.transfer.auth import CLIENT_LABEL, NONCE_BYTES, SERVER_LABEL, AuthToken, new_nonce
from raykv.transfer.config import PeerAddress, TransferConfig
from raykv.transfer.gpu_peer import GpuPeerExport
from raykv.transfer.payload import LeasedPayload, payload_counts, settle_pages
from raykv.transfer.runtime import (
    INLINE_BYTES,
    ByteBudget,
    TransferRuntime,
    abort_endpoint,
    as_transfer_error,
    configure_ucx,
    get_runtime,
    map_rows,
    offload,
    tag_send,
    ucx_address,
    ucx_context,
    ucx_endpoint,
    within,
)

log = logging.getLogger(__name__)

MAX_UCX_ADDRESS = 1 << 16
_EMPTY = np.zeros(0, dtype=np.uint8)  # the message a posted receive gets when no page is for it


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


@dataclass
class ServerStats:
    """Counters of one page server (``pulls``/``pages``/``bytes`` are per path)."""

    connections: int = 0
    auth_failures: int = 0
    pulls: collections.Counter[str] = field(default_factory=collections.Counter)
    pages: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts (counters become ``{key: count}``), for logs and Ray replies."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(self).items()}


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: str
    node: str = ""
    ucx_address: bytes | None = None
    endpoint: Any = None
    sums: bool = True  # the current pull asked for checksums on the shm path
    ack: bool = False  # the current pull asked for an ``ack`` of its ``done`` on the shm path
    posted: bool = False  # the current pull's client posts its ucx receive for chunk 0 unasked
    split: int = 0  # ... and chunk 1's, chunk 0 taking up to this many pages (0: no split)


class PageServer:
    """Serves ``manager``'s committed pages to peers that hold ``token``. See the module docstring.

    ``start()`` binds and returns the :class:`PeerAddress`; ``close()`` stops listening, drops
    every connection and ends every lease (both idempotent; sync, callable from any thread but
    the runtime's loop, where ``astart``/``aclose`` are awaited instead).
    """

    def __init__(
        self,
        manager: CacheManager,
        token: AuthToken | bytes,
        config: TransferConfig | None = None,
        runtime: TransferRuntime | None = None,
    ) -> None:
        self.manager = manager
        self._token = AuthToken.coerce(token)
        self.config = config or TransferConfig()
        self.runtime = runtime or get_runtime()
        self.node_id = self.config.node
        self.faults = ServerFaults()
        self.stats = ServerStats()
        self.address: PeerAddress | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._leases: set[int] = set()
        self._budget: ByteBudget | None = None
        self._ucx_address: bytes | None = None
        self._ucx_ctx: Any = None
        self._shm_level, self._shm_info = _shared_tier(manager)
        self.gpu_peer = GpuPeerExport(manager, self.config.use_gpu_peer)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> PeerAddress:
        return self.runtime.run(self.astart(), self.config.connect_timeout_s + 30)

    async def astart(self) -> PeerAddress:
        """Start UCX (if available) and listen; returns where peers reach this server."""
        if self.address is not None:
            return self.address
        self._budget = ByteBudget(self.config.server_inflight_bytes)
        configure_ucx(self.config.ucx_net_devices, self.config.ucx_tls, self.config.ucx_progress)
        try:
            device = TierKind.GPU in self.manager.tier_kinds
            self._ucx_ctx = ucx_context(device_memory=device)
            self._ucx_address = ucx_address(self._ucx_ctx)
        except TransferError as exc:
            log.warning("page server: UCX unavailable (%s); only the shared-memory path works", exc)
        self._server = await asyncio.start_server(self._serve, self.config.host, self.config.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = PeerAddress(self.config.host, port, self.node_id)
        log.info(
            "page server listening on %s (node %s, shared tier: %s)",
            self.address,
            self.node_id,
            self._shm_info.path if self._shm_info else "none",
        )
        return self.address

    def close(self) -> None:
        if self.runtime.on_loop:
            raise TransferError(
                "PageServer.close() from the runtime loop; await aclose()", reason=TransferFailure.STATE
            )
        self.runtime.run(self.aclose(), 60)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        self._server = None
        self.gpu_peer.close()

    @property
    def open_leases(self) -> int:
        """Leases this server currently holds on the manager (0 when idle)."""
        return len(self._leases)

    @property
    def shm_path(self) -> str | None:
        """The shared host tier's file that same-node peers map (None without a shared tier)."""
        return self._shm_info.path if self._shm_info is not None else None

    @property
    def peak_inflight_bytes(self) -> int:
        return self._budget.peak if self._budget is not None else 0

    # ---- connections -----------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        conn = _Conn(reader, writer, f"{peer[0]}:{peer[1]}" if peer else "?")
        self.stats.connections += 1
        try:
            await asyncio.wait_for(self._handshake(conn), self.config.connect_timeout_s)
            while True:
                msg = await wire.read_message(reader, self.config.max_header_bytes)
                await self._pull(conn, wire.expect_type(msg, "pull"))
        except asyncio.CancelledError:
            pass
        except asyncio.TimeoutError:
            await self._refuse(conn, TransferError("timed out", reason=TransferFailure.TIMEOUT))
        except Exception as exc:
            try:
                error = as_transfer_error(exc)
            except Exception:
                self.stats.errors[TransferFailure.INTERNAL.value] += 1
                log.exception("page server %s: connection from %s failed", self.address, conn.peer)
            else:
                await self._refuse(conn, error)
        finally:
            abort_endpoint(conn.endpoint)
            writer.close()
            self._tasks.discard(task)

    async def _handshake(self, conn: _Conn) -> None:
        nonce = new_nonce()
        await self._send(conn, {"t": "hello", "v": wire.VERSION, "nonce": nonce})
        msg = wire.expect_type(await wire.read_message(conn.reader, 4096 + MAX_UCX_ADDRESS), "auth")
        mac = wire.field(msg, "mac", bytes, 32)
        client_nonce = wire.field(msg, "nonce", bytes, NONCE_BYTES)
        if not self._token.check(mac, CLIENT_LABEL, nonce, client_nonce):
            self.stats.auth_failures += 1
            log.warning("page server %s: refused %s (authentication failed)", self.address, conn.peer)
            raise TransferError("authentication failed", reason=TransferFailure.AUTH)
        conn.node = wire.field(msg, "node", str)
        ucx = msg.get("ucx")
        conn.ucx_address = ucx if isinstance(ucx, bytes) and 0 < len(ucx) <= MAX_UCX_ADDRESS else None
        await self._send(
            conn,
            {
                "t": "welcome",
                "mac": self._token.proof(SERVER_LABEL, client_nonce, nonce),
                "node": self.node_id,
                "page_bytes": self.manager.layout.page_bytes,
                "max_keys": self.config.max_keys,
                "max_payload": self.config.max_payload_bytes,
                "shm": self._shm_info.to_msg() if self._shm_info else None,
                "ucx": self._ucx_address,
                "gpu": self.gpu_peer.available,
            },
        )

    async def _refuse(self, conn: _Conn, error: TransferError) -> None:
        """Count and log a failed connection; tell the peer why unless it has gone."""
        reason = error.reason.value
        if error.reason is TransferFailure.CLOSED:
            return
        self.stats.errors[reason] += 1
        log.info("page server %s: connection from %s ended: %s", self.address, conn.peer, error)
        await self._try_send(conn, wire.error_message(None, reason, str(error) or reason))

    async def _send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        conn.writer.write(wire.encode(msg, self.config.max_header_bytes))
        await conn.writer.drain()

    async def _try_send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._send(conn, msg), 1.0)

    # ---- pulls -----------------------------------------------------------------------------------
    async def _pull(self, conn: _Conn, msg: dict[str, Any]) -> None:
        """Serve one pull; the lease ends in every case (after UCX stopped reading the pages)."""
        rid = wire.field(msg, "id", int)
        keys = wire.key_list(msg, "keys", self.config.max_keys)
        want = wire.field(msg, "path", str)
        tag = wire.field(msg, "tag", int)
        if not 0 <= tag < (1 << 62):
            raise wire.protocol_error("field 'tag' out of range")
        conn.sums = _flag(msg, "sums", True)
        conn.ack = _flag(msg, "ack", False)
        conn.posted = _flag(msg, "posted", False)
        conn.split = _split(msg, len(keys), conn.posted)
        try:
            lease = self.manager.lease_blocks(keys)
        except RayKVError as exc:
            raise TransferError(f"cannot lease blocks: {exc}", reason=TransferFailure.STATE) from None
        self._leases.add(lease.lease_id)
        nbytes = len(lease.blocks) * self.manager.layout.page_bytes
        try:
            if nbytes > self.config.max_payload_bytes:
                raise TransferError(f"{nbytes} payload bytes exceed the limit", reason=TransferFailure.LIMIT)
            assert self._budget is not None
            await self._budget.acquire(nbytes)
            try:
                path = "shm" if want == "shm" and self._shm_ok(conn, lease) else "ucx"
                path = want if want in ("direct", "gpu_peer") else path
                send = {
                    "shm": self._send_shm,
                    "ucx": self._send_ucx,
                    "direct": self._send_direct,
                    "gpu_peer": self._send_gpu_peer,
                }[path]
                await within(send(conn, rid, lease, tag), self.config.timeout_s)
            finally:
                self._budget.release(nbytes)
        finally:
            self.manager.release_lease(lease.lease_id)
            self._leases.discard(lease.lease_id)
        self.stats.pulls[path] += 1
        self.stats.pages[path] += len(lease.blocks)
        self.stats.bytes[path] += nbytes

    def _shm_ok(self, conn: _Conn, lease: BlockLease) -> bool:
        return (
            self._shm_info is not None
            and self.config.use_shm
            and conn.node == self.node_id
            and all(b.level == self._shm_level for b in lease.blocks)
        )

    def _header(
        self,
        rid: int,
        path: str,
        lease: BlockLease,
        layout: list[int],
        sums: list[int] | None = None,
        blocks: Sequence[LeasedBlock] | None = None,
    ) -> dict[str, Any]:
        """The header of a pull: ``blocks`` (default: every leased block) and the layout."""
        blocks = lease.blocks if blocks is None else blocks
        columns = list(zip(*blocks)) if blocks else [()] * 4  # key, parent, root flag, tokens, ...
        return wire.Header(
            rid,
            path,
            self.manager.layout.page_bytes,
            columns[0],
            columns[1],
            columns[2],
            columns[3],
            tuple(layout),
            tuple(sums) if sums is not None else None,
        ).to_msg()

    async def _after_header(self, conn: _Conn) -> None:
        """Test hooks between header and payload (a stall ends early when the peer goes)."""
        if self.faults.drop_after_header:
            raise TransferError(
                "connection dropped after the header (test hook)", reason=TransferFailure.FAULT
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.faults.stall_after_header_s
        while loop.time() < deadline:
            if _peer_gone(conn):
                raise TransferError("the peer went away", reason=TransferFailure.CLOSED)
            await asyncio.sleep(0.01)

    async def _send_shm(self, conn: _Conn, rid: int, lease: BlockLease, tag: int) -> None:
        """Slots in the header; the client copies from its mapping. Checksums only when the pull
        asked for them (computed while the client copies; a small payload's go in the header);
        an ``ack`` of the client's ``done`` when asked, sent before the lease ends."""
        pool = self.manager.pools[self._shm_level]
        assert isinstance(pool, HostPool)
        slots = [b.slot for b in lease.blocks]
        settle_pages(self.manager, lease.blocks)  # the client reads these slots right after the header
        nbytes = len(slots) * pool.page_bytes
        corrupt = self.faults.corrupt_payload
        inline = conn.sums and nbytes <= INLINE_BYTES
        sums = _page_sums(pool, slots, 0, len(slots), corrupt) if inline else None
        await self._send(conn, self._header(rid, "shm", lease, slots, sums))
        await self._after_header(conn)
        if conn.sums and sums is None:
            sums = await map_rows(
                pool.page_bytes, len(slots), lambda a, b: _page_sums(pool, slots, a, b, corrupt)
            )
            await self._send(conn, {"t": "sums", "id": rid, "sums": sums})
        await self._await_done(conn, rid, None)
        if conn.ack:
            await self._send(conn, {"t": "ack", "id": rid})

    async def _send_ucx(self, conn: _Conn, rid: int, lease: BlockLease, tag: int) -> None:
        """Header, then every chunk as one UCX message (tag ``tag + i``), then the checksums.
        Checksums computed by an earlier send of the same blocks go in the header (nothing to
        compute); so do a small payload's, computed first. Otherwise every send is posted before
        any checksum is computed, so UCX always has the whole payload queued and the checksums
        overlap with the transfer; they are remembered for the next sends
        (``CacheManager.remember_checksums``).

        When the client posts its receive with the request (``posted``), the chunks go first,
        before the header is built: every chunk of an in-place payload (UCX holds those the client
        has no receive for yet until it posts one), else chunk 0 (the others are gathered one by
        one after the header), and an empty message for each posted receive no page is for, so
        every one completes. A payload of at most ``chunk_bytes`` is one chunk then: it is on the
        wire while the header is built, sent and read. With a ``split`` the client posted chunk
        1's receive too: chunk 0 holds up to ``split`` pages, chunk 1 the rest."""
        corrupt, early, split = self.faults.corrupt_payload, conn.posted, conn.split
        page, chunk = self.manager.layout.page_bytes, self.config.chunk_bytes
        counts = payload_counts(len(lease.blocks), page, chunk, early, split)
        payload = LeasedPayload(self.manager, lease.blocks, chunk, corrupt, counts)
        endpoint: Any = await self._endpoint(conn) if lease.blocks or early else None
        chunks = range(len(payload.counts))
        sends: list[asyncio.Future[Any]] = []
        try:
            ahead = 0  # chunks posted before the header
            if early:
                ahead = len(chunks) if payload.in_place else min(1, len(chunks))
                for i in range(ahead):
                    buf = await _chunk_buf(payload, i)
                    sends.append(asyncio.ensure_future(tag_send(endpoint, buf, tag + i)))
                for i in range(len(chunks), 2 if split else 1):  # a posted receive no page is for
                    sends.append(asyncio.ensure_future(tag_send(endpoint, _EMPTY, tag + i)))
                await asyncio.sleep(0)  # the sends post now, so the pages move while the header is built
            sums = known_sums(lease)
            small = sums is None and payload.nbytes <= INLINE_BYTES
            ready = [payload.chunk(i) for i in chunks[ahead:]] if small else []
            if small:
                sums = [s for i in chunks for s in payload.checksums(i)]
                self.manager.remember_checksums(lease.blocks, sums)
            if early:
                await self._after_header(conn)  # the test hooks: here, before the header
            await self._send(conn, self._header(rid, "ucx", lease, payload.counts, sums))
            if not early:
                await self._after_header(conn)
            for k, i in enumerate(chunks[ahead:]):
                buf = ready[k] if small else await _chunk_buf(payload, i)
                sends.append(asyncio.ensure_future(tag_send(endpoint, buf, tag + i)))
                if k + 1 == self.faults.drop_after_chunks:  # the test hook
                    await asyncio.gather(*sends)
                    raise TransferError(
                        "connection dropped mid-payload (test hook)", reason=TransferFailure.FAULT
                    )
            if sums is None:
                await self._send_trailer(conn, rid, lease, payload)
            await self._await_done(conn, rid, asyncio.gather(*sends) if sends else None)
        except BaseException:
            # Stop UCX reading the pages before the caller ends the lease.
            abort_endpoint(conn.endpoint)
            conn.endpoint = None
            for s in sends:
                s.cancel()
            raise

    async def _send_trailer(self, conn: _Conn, rid: int, lease: BlockLease, payload: LeasedPayload) -> None:
        """Checksum every chunk (on the copy threads), send them as ``sums``, remember them."""
        trailer: list[int] = []
        for i in range(len(payload.counts)):
            trailer.extend(await map_rows(payload.page_bytes, payload.counts[i], payload.sums_of(i)))
        await self._send(conn, {"t": "sums", "id": rid, "sums": trailer})
        self.manager.remember_checksums(lease.blocks, trailer)

    async def _send_direct(self, conn: _Conn, rid: int, lease: BlockLease, tag: int) -> None:
        """The ``direct`` path (:mod:`raykv.transfer.device`): pages stay on their device."""
        from raykv.transfer.device import send_direct

        await send_direct(self, conn, rid, lease, tag)

    async def _send_gpu_peer(self, conn: _Conn, rid: int, lease: BlockLease, tag: int) -> None:
        """The ``gpu_peer`` path (:mod:`raykv.transfer.gpu_peer`): the peer copies from our GPU tier."""
        await self.gpu_peer.serve(self, conn, rid, lease)

    async def _await_done(self, conn: _Conn, rid: int, sends: asyncio.Future[Any] | None) -> None:
        """Wait for the client's ``done`` and for our sends; a closed connection fails at once."""
        if sends is None:  # nothing else to watch: read it directly
            msg = wire.expect_type(await wire.read_message(conn.reader, self.config.max_header_bytes), "done")
            if msg.get("id") != rid:
                raise wire.protocol_error("'done' for another request")
            return
        done = asyncio.ensure_future(wire.read_message(conn.reader, self.config.max_header_bytes))
        waiting: set[asyncio.Future[Any]] = {done} if sends is None else {done, sends}
        try:
            while waiting:
                finished, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for fut in finished:
                    result = fut.result()
                    if fut is done:
                        msg = wire.expect_type(result, "done")
                        if msg.get("id") != rid:
                            raise wire.protocol_error("'done' for another request")
        except BaseException:
            done.cancel()
            if sends is not None:
                sends.cancel()
            raise

    async def _endpoint(self, conn: _Conn) -> Any:
        if conn.endpoint is None:
            if self._ucx_ctx is None or conn.ucx_address is None:
                raise TransferError("no UCX path to this peer", reason=TransferFailure.UNAVAILABLE)
            conn.endpoint = await ucx_endpoint(self._ucx_ctx, conn.ucx_address)
        return conn.endpoint


assert LeasedBlock._fields[:4] == ("key", "parent_key", "parent_is_root", "num_tokens")  # _header's columns


async def _chunk_buf(payload: LeasedPayload, index: int) -> Any:
    """Chunk ``index``'s buffer: in place, or gathered on the loop's executor when large."""
    nbytes = 0 if payload.in_place else payload.counts[index] * payload.page_bytes
    return await offload(nbytes, payload.chunk, index)


def known_sums(lease: BlockLease) -> list[int] | None:
    """The leased pages' checksums when an earlier send computed every one, else None."""
    sums = [b.checksum for b in lease.blocks]
    return None if None in sums else sums  # type: ignore[return-value]


def _page_sums(pool: HostPool, slots: list[int], first: int, last: int, corrupt: bool) -> list[int]:
    """Checksums of the pages at ``slots[first:last]`` (``corrupt``: the test hook spoils page 0's,
    since the shm path copies the true bytes and only a wrong checksum can make them look bad)."""
    sums = [page_checksum(memoryview(pool.array[s])) for s in slots[first:last]]
    if corrupt and first == 0 and sums:
        sums[0] ^= 1
    return sums


def _peer_gone(conn: _Conn) -> bool:
    """The peer closed the connection (EOF), or it broke (a reset while we wrote marks the
    transport closing and leaves the reader an exception, not EOF)."""
    return conn.reader.at_eof() or conn.writer.is_closing() or conn.reader.exception() is not None


def _split(msg: dict[str, Any], num_keys: int, posted: bool) -> int:
    """A pull's optional ``split`` (0 when absent): 0 < split < keys, only with ``posted``."""
    if msg.get("split") is None:
        return 0
    split = wire.field(msg, "split", int)
    if not (posted and 0 < split < num_keys):
        raise wire.protocol_error("field 'split' out of range")
    return split


def _flag(msg: dict[str, Any], name: str, default: bool) -> bool:
    """An optional bool field of a pull (``default`` when absent)."""
    return default if msg.get(name) is None else bool(wire.field(msg, name, bool))


def _shared_tier(manager: CacheManager) -> tuple[int, wire.ShmInfo | None]:
    """The level and file of the manager's shared host tier, if it has one."""
    for level, pool in enumerate(manager.pools):
        if isinstance(pool, HostPool) and pool.shm_path is not None:
            return level, wire.ShmInfo(pool.shm_path, pool.num_slots, pool.page_bytes)
    return -1, None

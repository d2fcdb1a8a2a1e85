"""PageClient: pulls committed blocks by key from peers' page servers.

A pull connects (or reuses an idle authenticated connection to that peer), sends the keys, and
receives the header, the payload and the checksums (protocol: :mod:`raykv.transfer.wire`). The
result is a :class:`PulledPages` whose every page matched its checksum; anything else (bad token,
malformed or oversized message, corrupt page, dead or slow peer, timeout) raises
:class:`raykv.errors.TransferError` with a ``reason`` and leaves nothing behind: the connection is
dropped, UCX receives are cancelled (their endpoint is aborted) and the server ends its lease when
it sees the connection go. Cancelling the calling task cleans up the same way.

Keys the peer does not have are not an error: they are listed in ``PulledPages.missing``.

Paths: ``shm`` when the server runs on this node (same node id), has a shared host tier that this
process can map, and every page is on it; ``ucx`` otherwise. ``ClientStats`` counts pulls, pages
and bytes per path; each result says which path it used.

Backpressure: at most ``client_inflight_bytes`` of receive buffers are being filled at once, over
all peers; :meth:`PageClient.pull_many` pulls from several peers concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.errors import InvalidArgumentError, TransferError
from raykv.records import page_checksum
from raykv.transfer import wire
from raykv.transfer.auth import CLIENT_LABEL, NONCE_BYTES, SERVER_LABEL, AuthToken, new_nonce
from raykv.transfer.config import PeerAddress, TransferConfig
from raykv.transfer.results import ClientStats, PulledPages, check_out, merge
from raykv.transfer.runtime import (
    ByteBudget,
    TransferRuntime,
    abort_endpoint,
    as_transfer_error,
    configure_ucx,
    get_runtime,
    map_rows,
    ucx_address,
    ucx_context,
    ucx_endpoint,
)
from raykv.transfer.shm import ShmMapping
from raykv.types import BlockKey, check_block_key

log = logging.getLogger(__name__)

Peer = PeerAddress | tuple[str, int]


@dataclass
class _Conn:
    peer: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    node: str
    page_bytes: int
    max_keys: int
    max_payload: int
    shm: wire.ShmInfo | None
    server_ucx: bytes | None
    endpoint: Any = None

    def close(self) -> None:
        abort_endpoint(self.endpoint)
        self.endpoint = None
        self.writer.close()


@dataclass(frozen=True)
class _Options:
    prefer_shm: bool
    verify: bool
    out: npt.NDArray[np.uint8] | None


class PageClient:
    """Pulls pages from page servers that share ``token``. See the module docstring.

    Async API (``pull``, ``pull_many``, ``aclose``) runs on the transfer runtime's loop; the
    ``*_sync`` twins call it from any other thread.
    """

    def __init__(
        self,
        token: AuthToken | bytes,
        config: TransferConfig | None = None,
        runtime: TransferRuntime | None = None,
    ) -> None:
        self._token = AuthToken.coerce(token)
        self.config = config or TransferConfig()
        self.runtime = runtime or get_runtime()
        self.node_id = self.config.node
        self.stats = ClientStats()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._maps: dict[str, ShmMapping | None] = {}
        self._budget: ByteBudget | None = None
        self._ucx_ctx: Any = None
        self._ids = 0

    # ---- public API ------------------------------------------------------------------------------
    async def pull(
        self,
        peer: Peer,
        keys: Sequence[bytes],
        prefer_shm: bool = True,
        timeout_s: float | None = None,
        out: npt.NDArray[np.uint8] | None = None,
        verify: bool = True,
    ) -> PulledPages:
        """Pull the committed blocks among ``keys`` from ``peer`` (see module docstring).

        ``verify``: compare every page with the sender's checksum here (TransferError with
        reason "integrity" and ``bad_keys`` on a mismatch). ``verify=False`` skips that pass when
        the caller imports the pages anyway: ``CacheManager.import_blocks`` checks every page
        against the same checksums and rejects the whole batch on a mismatch.

        ``out`` (optional): a writable C-contiguous uint8 array of at least ``len(keys)`` rows of
        the peer's page size; the pages land in its leading rows (no allocation) and
        ``PulledPages.data`` is a view of them. Raises ValueError for malformed or duplicate keys
        or a bad ``out``, TransferError for any failure (``out`` may then hold partial bytes).
        """
        checked = [check_block_key(k) for k in keys]
        if len(set(checked)) != len(checked):
            raise InvalidArgumentError("keys", "duplicate keys in one pull")
        endpoint = peer.endpoint if isinstance(peer, PeerAddress) else (str(peer[0]), int(peer[1]))
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        if not checked:
            return merge([], [], 0.0)
        try:
            opts = _Options(prefer_shm, verify, out)
            parts = await asyncio.wait_for(self._pull_all(endpoint, checked, opts), timeout)
        except asyncio.TimeoutError:
            self.stats.failures["timeout"] += 1
            raise TransferError(
                f"pull from {endpoint[0]}:{endpoint[1]} timed out", reason="timeout"
            ) from None
        except TransferError as exc:
            self.stats.failures[getattr(exc, "reason", "unknown")] += 1
            raise
        except Exception as exc:
            wrapped = as_transfer_error(exc)
            self.stats.failures[getattr(wrapped, "reason", "unknown")] += 1
            raise wrapped from None
        return merge(parts, checked, time.perf_counter() - start, out, verify)

    async def pull_many(
        self, requests: Mapping[Peer, Sequence[bytes]], prefer_shm: bool = True
    ) -> dict[Peer, PulledPages | TransferError]:
        """Pull from several peers concurrently; each peer's result or its TransferError."""
        peers = list(requests)
        results = await asyncio.gather(
            *(self.pull(p, requests[p], prefer_shm) for p in peers), return_exceptions=True
        )
        out: dict[Peer, PulledPages | TransferError] = {}
        for peer, result in zip(peers, results):
            if isinstance(result, BaseException) and not isinstance(result, TransferError):
                raise result
            out[peer] = result
        return out

    def pull_sync(self, peer: Peer, keys: Sequence[bytes], prefer_shm: bool = True) -> PulledPages:
        return self.runtime.run(self.pull(peer, keys, prefer_shm), self.config.timeout_s + 5)

    def pull_many_sync(
        self, requests: Mapping[Peer, Sequence[bytes]], prefer_shm: bool = True
    ) -> dict[Peer, PulledPages | TransferError]:
        return self.runtime.run(self.pull_many(requests, prefer_shm), self.config.timeout_s + 5)

    async def aclose(self) -> None:
        """Drop idle connections and shared-memory mappings (pulls in flight keep theirs)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for mapping in self._maps.values():
            if mapping is not None:
                mapping.close()
        self._maps.clear()

    def close(self) -> None:
        self.runtime.run(self.aclose(), 30)

    # ---- connections -----------------------------------------------------------------------------
    async def _connect(self, peer: tuple[str, int]) -> _Conn:
        """Open and authenticate a connection (mutual challenge-response, module auth)."""
        if self._ucx_ctx is None:
            configure_ucx(self.config.ucx_net_devices, self.config.ucx_tls)
            with contextlib.suppress(TransferError):
                self._ucx_ctx = ucx_context()
        try:
            reader, writer = await asyncio.open_connection(*peer, limit=self.config.max_header_bytes + 8)
        except OSError as exc:
            raise TransferError(
                f"cannot connect to {peer[0]}:{peer[1]} ({exc.strerror})", reason="connect"
            ) from None
        try:
            return await self._handshake(peer, reader, writer)
        except BaseException:
            writer.close()
            raise

    async def _handshake(self, peer: tuple[str, int], reader: asyncio.StreamReader, writer: Any) -> _Conn:
        hello = wire.expect_type(await wire.read_message(reader, 4096), "hello")
        if hello.get("v") != wire.VERSION:
            raise wire.protocol_error(f"unsupported protocol version {str(hello.get('v'))[:10]}")
        server_nonce = wire.field(hello, "nonce", bytes, NONCE_BYTES)
        nonce = new_nonce()
        auth = {
            "t": "auth",
            "mac": self._token.proof(CLIENT_LABEL, server_nonce, nonce),
            "nonce": nonce,
            "node": self.node_id,
            "ucx": ucx_address(self._ucx_ctx) if self._ucx_ctx is not None else None,
        }
        writer.write(wire.encode(auth, 1 << 17))
        await writer.drain()
        welcome = wire.expect_type(await wire.read_message(reader, self.config.max_header_bytes), "welcome")
        if not self._token.check(welcome.get("mac"), SERVER_LABEL, nonce, server_nonce):
            raise TransferError("the server failed authentication", reason="auth")
        ucx = welcome.get("ucx")
        return _Conn(
            peer,
            reader,
            writer,
            wire.field(welcome, "node", str),
            wire.field(welcome, "page_bytes", int),
            max(1, min(wire.field(welcome, "max_keys", int), self.config.max_keys)),
            max(1, min(wire.field(welcome, "max_payload", int), self.config.max_payload_bytes)),
            wire.ShmInfo.from_msg(welcome.get("shm")),
            ucx if isinstance(ucx, bytes) and ucx else None,
        )

    async def _checkout(self, peer: tuple[str, int]) -> _Conn:
        """An idle connection to ``peer`` that is still open, or a new one."""
        idle = self._idle.get(peer, [])
        while idle:
            conn = idle.pop()
            if not (conn.reader.at_eof() or conn.writer.is_closing()):
                return conn
            conn.close()  # the server closed it meanwhile (restart, shutdown)
        return await asyncio.wait_for(self._connect(peer), self.config.connect_timeout_s)

    # ---- pulls -----------------------------------------------------------------------------------
    async def _pull_all(
        self, peer: tuple[str, int], keys: list[BlockKey], opts: _Options
    ) -> list[tuple[wire.Header, npt.NDArray[np.uint8], list[int]]]:
        """Pull ``keys`` in batches that respect the server's key and payload limits."""
        conn = await self._checkout(peer)
        parts = []
        try:
            out = opts.out
            check_out(out, len(keys), conn.page_bytes)
            per_batch = max(1, min(conn.max_keys, conn.max_payload // max(1, conn.page_bytes)))
            used = 0
            for first in range(0, len(keys), per_batch):
                dest = out[used:] if out is not None else None
                part = await self._pull_batch(conn, keys[first : first + per_batch], opts, dest)
                used += len(part[1])
                parts.append(part)
        except BaseException:
            conn.close()
            raise
        self._idle.setdefault(peer, []).append(conn)
        return parts

    async def _pull_batch(
        self, conn: _Conn, keys: list[BlockKey], opts: _Options, dest: npt.NDArray[np.uint8] | None
    ) -> tuple[wire.Header, npt.NDArray[np.uint8], list[int]]:
        """One request/response on ``conn``: header, payload (verified), done."""
        self._ids += 1
        rid, tag = self._ids, secrets.randbits(48) << 12
        mapping = self._mapping(conn) if opts.prefer_shm else None
        path = "shm" if mapping is not None else "ucx"
        await self._send(conn, {"t": "pull", "id": rid, "keys": list(keys), "path": path, "tag": tag})
        limit = min(conn.max_payload, self.config.max_payload_bytes)
        msg = await wire.read_message(conn.reader, self.config.max_header_bytes)
        header = wire.Header.from_msg(msg, list(keys), limit)
        if header.request_id != rid or header.page_bytes != conn.page_bytes:
            raise wire.protocol_error("header does not answer this request")
        if header.path == "shm" and mapping is None:
            raise wire.protocol_error("server chose the shm path without being asked")
        n = len(header.keys)
        if self._budget is None:
            self._budget = ByteBudget(self.config.client_inflight_bytes)
        await self._budget.acquire(n * header.page_bytes)
        try:
            data = dest[:n] if dest is not None else np.empty((n, header.page_bytes), dtype=np.uint8)
            if header.path == "shm":
                assert mapping is not None
                sums = await self._receive_shm(conn, header, mapping, data, opts.verify)
            else:
                sums = await self._receive_ucx(conn, header, tag, data, opts.verify)
        finally:
            self._budget.release(n * header.page_bytes)
        self.stats.pulls[header.path] += 1
        self.stats.pages[header.path] += n
        self.stats.bytes[header.path] += data.nbytes
        self.stats.last_path[f"{conn.peer[0]}:{conn.peer[1]}"] = header.path
        return header, data, sums

    def _mapping(self, conn: _Conn) -> ShmMapping | None:
        """A read-only mapping of the peer's shared tier when the shm path is possible."""
        info = conn.shm
        if info is None or not self.config.use_shm or conn.node != self.node_id:
            return None
        if info.path not in self._maps:
            try:
                self._maps[info.path] = ShmMapping(info.path, info.num_slots, info.page_bytes)
            except TransferError as exc:
                log.warning("shared-memory path to %s unavailable (%s); using UCX", conn.peer, exc)
                self._maps[info.path] = None
        return self._maps[info.path]

    async def _receive_shm(
        self, conn: _Conn, header: wire.Header, mapping: ShmMapping, data: npt.NDArray[np.uint8], verify: bool
    ) -> list[int]:
        """Copy the leased slots from the mapping (one memcpy for a consecutive run), say done."""
        slots = list(header.layout)

        def copy_and_sum(first: int, last: int) -> list[int]:
            mapping.copy(slots[first:last], data[first:last])
            return _checksums(data[first:last]) if verify else []

        sums = await map_rows(header.page_bytes, len(slots), copy_and_sum)
        mine = sums if verify else None
        theirs = list(header.sums) if header.sums is not None else await self._read_sums(conn, header)
        await self._send(conn, {"t": "done", "id": header.request_id})  # the lease may end now
        return self._compare(header, mine, theirs)

    async def _receive_ucx(
        self, conn: _Conn, header: wire.Header, tag: int, data: npt.NDArray[np.uint8], verify: bool
    ) -> list[int]:
        """Post one receive per chunk into ``data``; checksum each chunk as it lands."""
        if header.sums is not None:
            sums_task: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
            sums_task.set_result(list(header.sums))
        else:
            sums_task = asyncio.ensure_future(self._read_sums(conn, header))
        recvs: list[asyncio.Future[Any]] = []
        try:
            if header.keys:
                endpoint = await self._endpoint(conn)
                first = 0
                for i, count in enumerate(header.layout):
                    rows = data[first : first + count]
                    recvs.append(asyncio.ensure_future(endpoint.recv(rows, tag=tag + i, force_tag=True)))
                    first += count
            mine, theirs = await self._checksum_as_received(conn, data, header, recvs, sums_task, verify)
        except BaseException:
            # Abort the endpoint first: it cancels the posted receives, so nothing lands in `data`.
            abort_endpoint(conn.endpoint)
            conn.endpoint = None
            for fut in (*recvs, sums_task):
                fut.cancel()
            raise
        await self._send(conn, {"t": "done", "id": header.request_id})
        return self._compare(header, mine, theirs)

    async def _checksum_as_received(
        self,
        conn: _Conn,
        data: npt.NDArray[np.uint8],
        header: wire.Header,
        recvs: list[asyncio.Future[Any]],
        sums_task: asyncio.Future[list[int]],
        verify: bool,
    ) -> tuple[list[int] | None, list[int]]:
        """Await each chunk and checksum it; returns (our checksums or None, the server's).

        The control stream is watched meanwhile: first for the server's checksums (or its error),
        then for EOF (the server sends nothing else until our ``done``), so a peer that dies
        mid-transfer fails the pull at once instead of at the timeout.
        """
        mine: list[int] | None = [] if verify else None
        theirs: list[int] | None = None
        watch: asyncio.Future[Any] = sums_task
        first = 0
        try:
            for recv, count in zip(recvs, header.layout):
                while not recv.done():
                    await asyncio.wait({recv, watch}, return_when=asyncio.FIRST_COMPLETED)
                    if watch.done() and not recv.done():
                        theirs, watch = _next_watch(conn, watch, theirs)
                recv.result()
                rows = data[first : first + count]
                if mine is not None:
                    mine.extend(await map_rows(header.page_bytes, count, _row_sums(rows)))
                first += count
            if theirs is None:
                theirs = await sums_task
        finally:
            if watch is not sums_task:
                # Let the EOF watch finish cancelling before anything reads the stream again.
                watch.cancel()
                with contextlib.suppress(BaseException):
                    await watch
        return mine, theirs

    async def _read_sums(self, conn: _Conn, header: wire.Header) -> list[int]:
        msg = wire.expect_type(await wire.read_message(conn.reader, self.config.max_header_bytes), "sums")
        if msg.get("id") != header.request_id:
            raise wire.protocol_error("checksums for another request")
        return wire.int_list(msg, "sums", len(header.keys), 0, 0xFFFFFFFF)

    @staticmethod
    def _compare(header: wire.Header, mine: list[int] | None, theirs: list[int]) -> list[int]:
        """``theirs`` when every page matches (or there is nothing to compare); else raise."""
        if mine is None:
            return theirs
        bad = [header.keys[i] for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
        if bad:
            raise TransferError(
                f"{len(bad)} of {len(mine)} page(s) failed their checksum; nothing was imported",
                reason="integrity",
                bad_keys=tuple(bad),
            )
        return theirs

    async def _endpoint(self, conn: _Conn) -> Any:
        if conn.endpoint is None:
            if self._ucx_ctx is None or conn.server_ucx is None:
                raise TransferError("no UCX path to this peer", reason="unavailable")
            conn.endpoint = await ucx_endpoint(self._ucx_ctx, conn.server_ucx)
        return conn.endpoint

    async def _send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        conn.writer.write(wire.encode(msg, self.config.max_header_bytes))
        await conn.writer.drain()


def _checksums(rows: npt.NDArray[np.uint8]) -> list[int]:
    return [page_checksum(memoryview(row)) for row in rows]


def _row_sums(rows: npt.NDArray[np.uint8]) -> Callable[[int, int], list[int]]:
    return lambda first, last: _checksums(rows[first:last])


def _next_watch(
    conn: _Conn, watch: asyncio.Future[Any], sums: list[int] | None
) -> tuple[list[int] | None, asyncio.Future[Any]]:
    """The control stream finished ``watch``: keep the checksums, then watch for EOF."""
    result = watch.result()  # the peer's error, or EOF, raises here
    if sums is None:
        return result, asyncio.ensure_future(conn.reader.read(1))
    if result == b"":
        raise TransferError("the peer closed the connection mid-transfer", reason="closed")
    raise wire.protocol_error("unexpected bytes from the peer during the payload")

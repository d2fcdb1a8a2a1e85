"""PageServer: serves a CacheManager's committed pages to authenticated peers.

One server per manager. Its control listener (asyncio TCP) binds to ``TransferConfig.host`` (the
node's address in a deployment, 127.0.0.1 in tests); each connection first runs the token
challenge-response (:mod:`raykv.transfer.net.auth`), then serves any number of pulls, one at a time.
(ucxx's Python listener cannot bind to one interface, hence a plain TCP control listener; the
payload itself goes over UCX endpoints built from the peers' worker addresses.)

A pull leases the committed blocks among the requested keys (so the pages stay in place) and hands
them to the path the request names (:mod:`raykv.transfer.paths.base`; the registry is
:mod:`raykv.transfer.paths.registry`), or to ``ucx`` when that path does not accept the pull; the path
sends the header, the payload, and the checksums or an ``ack`` through a
:class:`raykv.transfer.paths.serving.ServerConn`. The lease ends once the path returns (the client
reported ``done`` and the local sends have completed) or when anything fails: a dead or slow
peer, a timeout, cancellation, server shutdown. A path aborts its failing endpoint *before* the
lease ends, so UCX never reads a page that has been released.

Backpressure: at most ``server_inflight_bytes`` of payload are being served at once (a byte
semaphore; further pulls wait their turn).

Guards (:mod:`raykv.transfer.net.guard`; docs/security.md): a connection over
``max_connections_per_peer`` (per peer host) or ``max_connections`` (in all) is refused at once
with reason ``busy`` and counted in ``connections_refused``. An admitted connection must
authenticate within ``auth_timeout_s``; until it has, nothing it sends reaches the stats beyond
the one counter ``preauth_rejected``, nor the log beyond a rate-limited line naming the reason
this server chose (never the peer's text or its ``error`` reason as sent). Once a control
message starts arriving, all of it must arrive within ``read_timeout_s``; an authenticated
connection with no pull in flight is closed after ``idle_timeout_s`` without a request (counted
in ``idle_closed``; the client retires idle connections before that, see ``welcome``'s
``idle_s``). Failures of authenticated connections count in ``errors`` under their
:class:`TransferFailure` value (a peer's reason mapped by ``TransferFailure.from_peer``). Every
end of a connection releases its slot, its lease, its UCX endpoint and its socket (aborted when
the peer does not read its last bytes within a second).

UCX has no accept path to guard: this server opens no UCX listener. It opens at most one
endpoint per authenticated control connection, to the worker address the client sent in
``auth``, and aborts it when that connection ends, so the caps and deadlines above bound the
endpoints too. Its own worker address goes out only in ``welcome``, after the client proved the
token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import raykv.transfer.net.wire as wire
from raykv.core.errors import InvalidArgumentError, RayKVError, TransferError, TransferFailure
from raykv.core.manager import CacheManager
from raykv.core.tiers.host import HostPool
from raykv.core.types import TierKind
from raykv.transfer.net.auth import CLIENT_LABEL, NONCE_BYTES, SERVER_LABEL, AuthToken, new_nonce
from raykv.transfer.net.config import PeerAddress, TransferConfig, check_config
from raykv.transfer.net.guard import ConnectionSlots, LogLimiter, close_stream, frame_start
from raykv.transfer.net.runtime import (
    ByteBudget,
    TransferRuntime,
    abort_endpoint,
    as_transfer_error,
    configure_ucx,
    get_runtime,
    ucx_address,
    ucx_context,
    within,
)
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.gpu_peer import GpuPeerExport
from raykv.transfer.paths.registry import server_paths
from raykv.transfer.paths.serving import PullRequest, ServerConn, ServerFaults, ServerSite

log = logging.getLogger(__name__)

MAX_UCX_ADDRESS = 1 << 16


@dataclass
class ServerStats:
    """Counters of one page server (``pulls``/``pages``/``bytes`` per path, ``errors`` per
    :class:`TransferFailure` value and nothing else).

    ``connections``: connections admitted; ``preauth_rejected``: admitted connections that ended
    before they authenticated (wrong token, deadline, malformed or ``error`` message, EOF): the
    only trace an unauthenticated peer leaves here; ``connections_refused``: connections refused
    over a cap (reason ``busy``); ``idle_closed``: authenticated connections closed after
    ``idle_timeout_s`` without a request. ``errors``: authenticated connections that failed.
    """

    connections: int = 0
    preauth_rejected: int = 0
    connections_refused: int = 0
    idle_closed: int = 0
    pulls: collections.Counter[str] = field(default_factory=collections.Counter)
    pages: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts (counters become ``{key: count}``), for logs and Ray replies."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(self).items()}


class PageServer:
    """Serves ``manager``'s committed pages to peers that hold ``token``. See the module docstring.

    ``start()`` binds and returns the :class:`PeerAddress`; ``close()`` stops listening, drops
    every connection and ends every lease (both idempotent; sync, callable from any thread but
    the runtime's loop, where ``astart``/``aclose`` are awaited instead). Raises
    InvalidArgumentError ``manager`` for a non-CacheManager, ``token`` for a token shorter than
    16 bytes, ``config`` for a non-TransferConfig.
    """

    def __init__(
        self,
        manager: CacheManager,
        token: AuthToken | bytes,
        config: TransferConfig | None = None,
        runtime: TransferRuntime | None = None,
    ) -> None:
        if not isinstance(manager, CacheManager):
            raise InvalidArgumentError("manager", f"must be a CacheManager, got {type(manager).__name__}")
        self.manager = manager
        self._token = AuthToken.coerce(token)
        self.config = check_config(config)
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
        shm_level, self._shm_info = _shared_tier(manager)
        self.gpu_peer = GpuPeerExport(manager, self.config.use_gpu_peer)
        self.paths: dict[str, TransferPath] = server_paths(shm_level, self.config, self.gpu_peer)
        """The paths this server answers on, by name (see :mod:`raykv.transfer.paths.registry`)."""
        self._site: ServerSite | None = None
        self._slots = ConnectionSlots(self.config.max_connections_per_peer, self.config.max_connections)
        self._refusals = LogLimiter(log)  # connections refused or rejected before authentication
        self._failures = LogLimiter(log)  # authenticated connections that failed

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
        self._site = ServerSite(self.manager, self.config, self.faults, self.node_id, self._ucx_ctx)
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
    def open_connections(self) -> int:
        """Connections admitted and not yet closed (0 when idle)."""
        return self._slots.total

    @property
    def connections_by_peer(self) -> dict[str, int]:
        """Open connections per peer host (a copy; hosts with none are absent)."""
        return self._slots.by_host()

    @property
    def shm_path(self) -> str | None:
        """The shared host tier's file that same-node peers map (None without a shared tier)."""
        return self._shm_info.path if self._shm_info is not None else None

    @property
    def peak_inflight_bytes(self) -> int:
        return self._budget.peak if self._budget is not None else 0

    # ---- connections -----------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One accepted connection: admit it (or refuse it at once), authenticate it before the
        deadline, serve its pulls until it ends; its slot, endpoint and socket are freed in every
        case."""
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        if not self._slots.admit(host):
            self._turn_away(writer, host)
            return
        task = asyncio.current_task()
        assert task is not None and self._site is not None
        self._tasks.add(task)
        conn = ServerConn(reader, writer, f"{host}:{peer[1]}" if peer else "?", self._site)
        self.stats.connections += 1
        try:
            if await self._authenticate(conn):
                await self._serve_pulls(conn)
        except asyncio.CancelledError:
            pass
        finally:
            abort_endpoint(conn.endpoint)
            close_stream(writer)
            self._slots.release(host)
            self._tasks.discard(task)

    def _turn_away(self, writer: asyncio.StreamWriter, host: str) -> None:
        """Refuse a connection over a cap: count it, tell the peer ``busy`` (no waiting), close."""
        self.stats.connections_refused += 1
        self._refusals.log(
            logging.WARNING,
            "page server %s: refused a connection from %s (%d open from it, %d in all)",
            self.address,
            host,
            self._slots.held(host),
            self._slots.total,
        )
        with contextlib.suppress(Exception):
            writer.write(
                wire.encode(
                    wire.error_message(None, TransferFailure.BUSY.value, "too many connections"), 4096
                )
            )
        close_stream(writer)

    async def _authenticate(self, conn: ServerConn) -> bool:
        """Run the challenge-response within ``auth_timeout_s``; False when the connection ends
        before it succeeded. Whatever the peer sent then (its ``error`` reason, its text, a
        malformed frame) counts only in ``preauth_rejected`` and reaches the log only as the
        reason this server chose, through the rate-limited :class:`LogLimiter`."""
        try:
            async with asyncio.timeout(self.config.auth_timeout_s):
                await self._handshake(conn)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._reject(conn, exc)
            return False

    async def _reject(self, conn: ServerConn, exc: Exception) -> None:
        """Count, log (rate-limited, the reason only) and answer a connection that failed
        before it authenticated."""
        reason = _preauth_reason(exc)
        self.stats.preauth_rejected += 1
        self._refusals.log(
            logging.WARNING if reason is TransferFailure.AUTH else logging.INFO,
            "page server %s: closed %s before authentication (%s)",
            self.address,
            conn.peer,
            reason.value,
            exc_info=exc if reason is TransferFailure.INTERNAL else None,
        )
        if reason not in (TransferFailure.CLOSED, TransferFailure.REFUSED):
            text = _PREAUTH_TEXT.get(reason, reason.value)
            await conn.try_send(wire.error_message(None, reason.value, text))

    async def _serve_pulls(self, conn: ServerConn) -> None:
        """Serve pulls one at a time until the peer goes, fails, or stays idle ``idle_timeout_s``."""
        try:
            while True:
                first = await frame_start(conn.reader, self.config.idle_timeout_s)
                if first is None:
                    self.stats.idle_closed += 1
                    log.debug("page server %s: closed idle connection from %s", self.address, conn.peer)
                    return
                msg = await wire.read_message(
                    conn.reader, self.config.max_header_bytes, self.config.read_timeout_s, first
                )
                await self._pull(conn, wire.expect_type(msg, "pull"))
        except asyncio.CancelledError:
            raise
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

    async def _handshake(self, conn: ServerConn) -> None:
        nonce = new_nonce()
        await conn.send({"t": "hello", "v": wire.VERSION, "nonce": nonce})
        limit, frame_s = 4096 + MAX_UCX_ADDRESS, self.config.read_timeout_s
        msg = wire.expect_type(await wire.read_message(conn.reader, limit, frame_s), "auth")
        mac = wire.field(msg, "mac", bytes, 32)
        client_nonce = wire.field(msg, "nonce", bytes, NONCE_BYTES)
        if not self._token.check(mac, CLIENT_LABEL, nonce, client_nonce):
            raise TransferError("authentication failed", reason=TransferFailure.AUTH)
        conn.node = wire.field(msg, "node", str)
        ucx = msg.get("ucx")
        conn.ucx_address = ucx if isinstance(ucx, bytes) and 0 < len(ucx) <= MAX_UCX_ADDRESS else None
        await conn.send(
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
                "idle_s": self.config.idle_timeout_s,
            },
        )

    async def _refuse(self, conn: ServerConn, error: TransferError) -> None:
        """Count and log a failed authenticated connection (its reason is a TransferFailure: a
        peer's own reason was mapped by :meth:`TransferFailure.from_peer`); tell the peer why
        unless it has gone."""
        reason = error.reason.value
        if error.reason is TransferFailure.CLOSED:
            return
        self.stats.errors[reason] += 1
        self._failures.log(
            logging.INFO, "page server %s: connection from %s ended: %s", self.address, conn.peer, error
        )
        await conn.try_send(wire.error_message(None, reason, str(error) or reason))

    # ---- pulls -----------------------------------------------------------------------------------
    async def _pull(self, conn: ServerConn, msg: dict[str, Any]) -> None:
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
        conn.split = split_field(msg, len(keys), conn.posted)
        try:
            lease = self.manager.lease_blocks(keys)
        except RayKVError as exc:
            raise TransferError(f"cannot lease blocks: {exc}", reason=TransferFailure.STATE) from None
        self._leases.add(lease.lease_id)
        nbytes = len(lease.blocks) * self.manager.layout.page_bytes
        pull = PullRequest(rid, lease, tag)
        try:
            if nbytes > self.config.max_payload_bytes:
                raise TransferError(f"{nbytes} payload bytes exceed the limit", reason=TransferFailure.LIMIT)
            assert self._budget is not None
            await self._budget.acquire(nbytes)
            try:
                path = self.paths.get(want)
                if path is None or not path.accepts(conn, pull):
                    path = self.paths["ucx"]
                await within(path.serve(conn, pull), self.config.timeout_s)
            finally:
                self._budget.release(nbytes)
        finally:
            self.manager.release_lease(lease.lease_id)
            self._leases.discard(lease.lease_id)
        self.stats.pulls[path.name] += 1
        self.stats.pages[path.name] += len(lease.blocks)
        self.stats.bytes[path.name] += nbytes


_PREAUTH_TEXT = {
    TransferFailure.AUTH: "authentication failed",
    TransferFailure.TIMEOUT: "authentication not complete in time",
    TransferFailure.PROTOCOL: "malformed or unexpected message",
    TransferFailure.LIMIT: "message too large",
}
"""What an unauthenticated peer is told, per reason (fixed text: nothing of what it sent)."""


def _preauth_reason(exc: Exception) -> TransferFailure:
    """Why a connection ended before it authenticated: the TransferError's reason (a peer's
    ``error`` already mapped onto the enum, so ``refused`` for anything unknown), ``timeout`` at
    the deadline, ``closed`` for a broken socket, ``internal`` for anything else (a bug)."""
    if isinstance(exc, TransferError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return TransferFailure.TIMEOUT
    if isinstance(exc, (OSError, ConnectionError)):
        return TransferFailure.CLOSED
    return TransferFailure.INTERNAL


def split_field(msg: dict[str, Any], num_keys: int, posted: bool) -> int:
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

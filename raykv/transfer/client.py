"""PageClient: pulls committed blocks by key from peers' page servers.

A pull connects (or reuses an idle authenticated connection to that peer), sends the keys, and
receives the header, the payload and the checksums or the server's acknowledgement (protocol:
:mod:`raykv.transfer.net.wire`). The result is a :class:`PulledPages` whose every page is intact
(see its ``verified``); anything else (bad token, malformed or oversized message, corrupt page,
dead or slow peer, a lease that ended early, timeout) raises
:class:`raykv.core.errors.TransferError` with a ``reason`` and leaves nothing behind: the connection is
dropped, UCX receives are cancelled (their endpoint is aborted) and the server ends its lease when
it sees the connection go. Cancelling the calling task cleans up the same way.

Keys the peer does not have are not an error: they are listed in ``PulledPages.missing``.

Paths (one :class:`raykv.transfer.paths.base.TransferPath` each): ``shm_read`` once this client has
connected to a same-node server whose shared host tier and slot directory it could map, when the
directory lists every key (a one-sided read in the calling task's thread, no request:
:mod:`raykv.transfer.paths.shm_read`); ``shm`` when the server runs on this node (same node id), has a
shared host tier that this process can map, and every page is on it; ``ucx`` otherwise. A batch
is received and landed by the path its header names (:data:`raykv.transfer.paths.registry.REQUEST_PATHS`,
:mod:`raykv.transfer.paths.host`). ``ClientStats`` counts pulls, pages and bytes per path; each
result says which path it used. Checksums: always on ``ucx`` (the receiver's pass overlaps with
the transfer); on ``shm`` only with ``verify`` (default ``TransferConfig.verify_shm``, off): the
pages are copied straight out of the owner's memory under its lease, and the owner acknowledges
that the lease lasted (:mod:`raykv.transfer.net.wire`).

:meth:`PageClient.pull_land` hands the pages to an import instead of returning them: over ``shm``
the import reads the rows from the mapping itself (one copy, into the destination tier), over
``ucx`` from the one buffer they were received into, each chunk as soon as it arrived when the
land can (:mod:`raykv.transfer.pages.landing`).

Backpressure: at most ``client_inflight_bytes`` of receive buffers are being filled at once, over
all peers; :meth:`PageClient.pull_many` pulls from several peers concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

import raykv.transfer.paths.gpu_land as gpu_land
import raykv.transfer.paths.shm_read as shm_read
from raykv.core.errors import TransferError, TransferFailure
from raykv.core.types import BlockKey
from raykv.transfer.net.auth import AuthToken
from raykv.transfer.net.config import Peer, TransferConfig, check_config, check_timeout, pull_request
from raykv.transfer.net.connection import ClientConn, handshake
from raykv.transfer.net.runtime import (
    ByteBudget,
    TransferRuntime,
    as_transfer_error,
    configure_ucx,
    get_runtime,
    ucx_context,
    within,
)
from raykv.transfer.pages.landing import Land, LeaseCheck, run_land
from raykv.transfer.pages.payload import early_split
from raykv.transfer.pages.receive import SpareBuffers, post_first, read_header
from raykv.transfer.pages.results import ClientStats, Part, PulledPages, check_out, merge
from raykv.transfer.pages.shm import ShmMapping
from raykv.transfer.paths.gpu_land import GpuLand, GpuLanding
from raykv.transfer.paths.host import Batch, checks
from raykv.transfer.paths.peer_pools import PeerPools
from raykv.transfer.paths.registry import REQUEST_PATHS

log = logging.getLogger(__name__)

T = TypeVar("T")
SPARE_BYTES = 256 << 20
"""The most receive-buffer bytes a client keeps for reuse by landings (see SpareBuffers)."""


@dataclass(frozen=True)
class _Options:
    prefer_shm: bool
    verify: bool | None  # None: the path's default (see PageClient.pull)
    out: npt.NDArray[np.uint8] | None = None
    land: Land[Any] | None = None  # pull_land with a single batch: land it in _pull_batch


@dataclass(frozen=True)
class _Landed:
    value: Any


class PageClient:
    """Pulls pages from page servers that share ``token``. See the module docstring.

    Async API (``pull``, ``pull_many``, ``aclose``) runs on the transfer runtime's loop; the
    ``*_sync`` twins call it from any other thread. Raises InvalidArgumentError ``token`` for a
    token shorter than 16 bytes, ``config`` for a non-TransferConfig.
    """

    def __init__(
        self,
        token: AuthToken | bytes,
        config: TransferConfig | None = None,
        runtime: TransferRuntime | None = None,
    ) -> None:
        self._token = AuthToken.coerce(token)
        self.config = check_config(config)
        self.runtime = runtime or get_runtime()
        self.node_id = self.config.node
        self.stats = ClientStats()
        self._idle: dict[tuple[str, int], list[ClientConn]] = {}
        self._maps: dict[str, ShmMapping | None] = {}
        self._budget: ByteBudget | None = None
        self.spare = SpareBuffers(min(SPARE_BYTES, self.config.client_inflight_bytes))
        """Receive buffers kept for reuse by landings (see :class:`SpareBuffers`)."""
        self._ucx_ctx: Any = None
        self._ids = 0
        self._local: dict[tuple[str, int], shm_read.LocalPeer] = {}
        self._retired_local: list[shm_read.LocalPeer] = []
        self._labels: dict[tuple[str, int], str] = {}  # endpoint -> "host:port" (stats keys)
        self._pin_local = False
        self.gpu_pools = PeerPools()
        """Owners' GPU tiers mapped by gpu_peer pulls (:mod:`raykv.transfer.paths.gpu_peer`)."""

    # ---- public API ------------------------------------------------------------------------------
    async def pull(
        self,
        peer: Peer,
        keys: Sequence[bytes],
        prefer_shm: bool = True,
        timeout_s: float | None = None,
        out: npt.NDArray[np.uint8] | None = None,
        verify: bool | None = None,
        one_sided: bool = True,
    ) -> PulledPages:
        """Pull the committed blocks among ``keys`` from ``peer`` (see module docstring).

        ``one_sided``: first try a one-sided read (with ``prefer_shm``, unless ``verify``); a
        caller that already tried one itself (a step of :mod:`raykv.transfer.planner`) passes
        False so the directory is not searched again.

        ``verify``: compare every page with the sender's checksum here (TransferError with
        reason "integrity" and ``bad_keys`` on a mismatch). None (default): on over ``ucx``, and
        over ``shm`` as ``TransferConfig.verify_shm`` says (off: see the module docstring).
        ``verify=False`` over ``ucx`` skips the pass (``PulledPages.verified`` is then False and
        ``CacheManager.import_pages`` checks the pages against the same checksums).

        ``out`` (optional): a writable C-contiguous uint8 array of at least ``len(keys)`` rows of
        the peer's page size; the pages land in its leading rows (no allocation) and
        ``PulledPages.data`` is a view of them.

        Raises InvalidArgumentError (a ValueError) naming ``key``/``keys`` (malformed or
        duplicate keys), ``peer`` (not a PeerAddress or (host, port) pair), ``timeout_s`` (not
        None or finite seconds > 0) or ``out``; TransferError for any failure (``out`` may then
        hold partial bytes): reason ``connect`` when nothing accepts a connection at ``peer``
        within ``TransferConfig.connect_timeout_s``, ``timeout`` past ``timeout_s``.
        """
        checked, endpoint = pull_request(peer, keys)
        check_timeout("timeout_s", timeout_s)
        start = time.perf_counter()
        if not checked:
            return merge([], [], 0.0)
        if one_sided and prefer_shm and verify is not True:
            fast = self._read_local(endpoint, checked, out)
            if fast is not None:
                return fast
        parts, _ = await self.guard(
            endpoint, timeout_s, self._pull_all(endpoint, checked, _Options(prefer_shm, verify, out))
        )
        return merge(parts, checked, time.perf_counter() - start, out)

    async def pull_land(
        self,
        peer: Peer,
        keys: Sequence[bytes],
        land: Land[T],
        prefer_shm: bool = True,
        timeout_s: float | None = None,
        verify: bool | None = None,
        one_sided: bool = True,
    ) -> T:
        """Pull like :meth:`pull` (``one_sided`` too) and return ``land(pulled, confirm)``, run in
        a worker thread.

        ``pulled.data`` is valid during the call only: over ``shm`` the peer's shared tier itself
        (a read-only view of one run of slots, else a gathered copy), leased until ``confirm()``
        returned; over ``ucx`` the buffer the pages were received into. ``pulled.verified`` False:
        ``land`` checks ``pulled.checksums``. ``land`` makes nothing visible before ``confirm()``
        returned, as ``CacheManager.import_pages(..., confirm=confirm)`` does. A pull of several
        batches (over the peer's limits) lands once, after the last one.
        """
        checked, endpoint = pull_request(peer, keys)
        check_timeout("timeout_s", timeout_s)
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        if not checked:
            return await run_land(land, merge([], [], 0.0), LeaseCheck(loop))
        if one_sided and prefer_shm and verify is not True:
            local = await shm_read.land_on_loop(self._local.get(endpoint), checked, land)
            if local is not None:
                self.count(shm_read.PATH, endpoint, len(checked), local[1])
                return local[0]
        opts = _Options(prefer_shm, verify, None, land)
        parts, landed = await self.guard(endpoint, timeout_s, self._pull_all(endpoint, checked, opts))
        if landed is not None:
            return landed.value  # type: ignore[no-any-return]
        return await run_land(land, merge(parts, checked, time.perf_counter() - start), LeaseCheck(loop))

    async def guard(
        self, endpoint: tuple[str, int], timeout_s: float | None, coro: Coroutine[Any, Any, T]
    ) -> T:
        """``coro`` under the pull timeout; every failure counted and raised as a TransferError."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        try:
            return await within(coro, timeout)
        except asyncio.TimeoutError:
            self.stats.failures[TransferFailure.TIMEOUT.value] += 1
            raise TransferError(
                f"pull from {endpoint[0]}:{endpoint[1]} timed out", reason=TransferFailure.TIMEOUT
            ) from None
        except TransferError as exc:
            self.stats.failures[exc.reason.value] += 1
            raise
        except Exception as exc:
            wrapped = as_transfer_error(exc)
            self.stats.failures[wrapped.reason.value] += 1
            raise wrapped from None

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

    def pull_sync(
        self,
        peer: Peer,
        keys: Sequence[bytes],
        prefer_shm: bool = True,
        verify: bool | None = None,
        out: npt.NDArray[np.uint8] | None = None,
        one_sided: bool = True,
    ) -> PulledPages:
        """:meth:`pull` from any other thread; a one-sided same-node read (``one_sided``) runs in
        this thread, and the request, if one is needed, on the runtime loop."""
        if one_sided and prefer_shm and verify is not True:
            checked, endpoint = pull_request(peer, keys)
            fast = self._read_local(endpoint, checked, out) if checked else None
            if fast is not None:
                return fast
        pull = self.pull(peer, keys, prefer_shm, verify=verify, out=out, one_sided=False)
        return self.runtime.run(pull, self.config.timeout_s + 5)

    def pull_many_sync(
        self, requests: Mapping[Peer, Sequence[bytes]], prefer_shm: bool = True
    ) -> dict[Peer, PulledPages | TransferError]:
        return self.runtime.run(self.pull_many(requests, prefer_shm), self.config.timeout_s + 5)

    async def aclose(self) -> None:
        """Drop idle connections and shared-memory mappings (pulls in flight keep theirs)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.flush()  # a pending done: the server counts the pull as served
                conn.close()
        self._idle.clear()
        for mapping in self._maps.values():
            if mapping is not None:
                mapping.close()
        self._maps.clear()
        self.gpu_pools.close()
        for local in [*self._local.values(), *self._retired_local]:
            local.close()
        self._local.clear()
        self._retired_local.clear()

    def close(self) -> None:
        self.runtime.run(self.aclose(), 30)

    # ---- connections -----------------------------------------------------------------------------
    async def _connect(self, peer: tuple[str, int]) -> ClientConn:
        """Open and authenticate a connection (mutual challenge-response, module auth), both
        within ``connect_timeout_s``: TransferError ``connect`` when nothing accepts the
        connection in time (or it is refused), ``timeout`` when the handshake runs past it."""
        deadline = time.monotonic() + self.config.connect_timeout_s
        if self._ucx_ctx is None:
            configure_ucx(self.config.ucx_net_devices, self.config.ucx_tls, self.config.ucx_progress)
            with contextlib.suppress(TransferError):
                self._ucx_ctx = ucx_context()
        opening = asyncio.open_connection(*peer, limit=self.config.max_header_bytes + 8)
        try:
            reader, writer = await within(opening, max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:  # before OSError: TimeoutError subclasses it
            raise TransferError(
                f"cannot connect to {peer[0]}:{peer[1]} (no answer within "
                f"{self.config.connect_timeout_s:g} s)",
                reason=TransferFailure.CONNECT,
            ) from None
        except OSError as exc:
            raise TransferError(
                f"cannot connect to {peer[0]}:{peer[1]} ({exc.strerror or exc})",
                reason=TransferFailure.CONNECT,
            ) from None
        try:
            shaking = handshake(self._token, self.config, self.node_id, self._ucx_ctx, peer, reader, writer)
            return await within(shaking, max(deadline - time.monotonic(), 0.001))
        except BaseException:
            writer.close()
            raise

    async def checkout(self, peer: tuple[str, int]) -> ClientConn:
        """An idle authenticated connection to ``peer`` that is still open, or a new one
        (TransferError "connect"/"auth"/"timeout"/... when none can be made). Give it back with
        :meth:`checkin` after a clean exchange, else ``close()`` it."""
        idle = self._idle.get(peer, [])
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed() and not conn.stale(now):
                return conn
            conn.flush()  # a pending done: the server counts the pull as served
            conn.close()  # the server closed it meanwhile (restart, shutdown) or soon will (idle)
        conn = await self._connect(peer)  # bounded by connect_timeout_s
        self._register_local(peer, conn)
        return conn

    def checkin(self, peer: tuple[str, int], conn: ClientConn) -> None:
        """Keep ``conn`` for later pulls from ``peer`` (no request may be in flight on it; it is
        retired at the next checkout once idle for half the server's idle timeout)."""
        conn.idle_since = time.monotonic()
        self._idle.setdefault(peer, []).append(conn)

    @contextlib.asynccontextmanager
    async def connection(self, peer: tuple[str, int]) -> AsyncIterator[ClientConn]:
        """:meth:`checkout` for the block: checked in when it ends normally, closed when it
        raises (a failed exchange leaves the stream in an unknown state)."""
        conn = await self.checkout(peer)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self.checkin(peer, conn)

    def new_request(self) -> int:
        """A request id not used before on this client."""
        self._ids += 1
        return self._ids

    @property
    def budget(self) -> ByteBudget:
        """The byte budget of this client's receive buffers, over all peers (made on first use)."""
        if self._budget is None:
            self._budget = ByteBudget(self.config.client_inflight_bytes)
        return self._budget

    @property
    def peak_inflight_bytes(self) -> int:
        """The most receive-buffer bytes held at once so far (0 before the first request)."""
        return self._budget.peak if self._budget is not None else 0

    # ---- one-sided same-node reads (raykv.transfer.paths.shm_read) -----------------------------------
    def _register_local(self, peer: tuple[str, int], conn: ClientConn) -> None:
        """Map a same-node peer's shared tier and directory for one-sided reads (once per file)."""
        config = self.config
        allowed = conn.node == self.node_id and config.use_shm and config.use_shm_read
        shm_read.register(self._local, self._retired_local, peer, conn.shm, allowed)
        local = self._local.get(peer)
        if self._pin_local and local is not None:
            local.mapping.pin_for_cuda()

    def _read_local(
        self, peer: tuple[str, int], keys: list[BlockKey], out: npt.NDArray[np.uint8] | None
    ) -> PulledPages | None:
        """The pages read one-sided from a mapped same-node peer, or None (then ask the peer).
        InvalidArgumentError for a bad ``out`` (see :meth:`pull`)."""
        local = self._local.get(peer)
        if local is None:
            return None
        pulled = shm_read.read(local, keys, out)  # checks `out`
        if pulled is not None:  # self._count, in one call: a small pull is ~3 us
            n, stats, path = len(keys), self.stats, shm_read.PATH
            local.tally((stats.pulls, stats.pages, stats.bytes), path, (1, n, n * local.page_bytes))
            stats.last_path[local.label] = path
        return pulled

    def land_local(self, peer: Peer, keys: Sequence[bytes], land: Land[T]) -> T | None:
        """``land(pulled, confirm)`` for a one-sided read, in this thread (no loop, no request);
        None, with nothing landed, when that path cannot serve every key or a page changed
        meanwhile (then use :meth:`pull_land`). ``confirm`` fails if any page changed."""
        checked, endpoint = pull_request(peer, keys)
        landed = shm_read.land_on(self._local.get(endpoint), checked, land)
        if landed is None:
            return None
        self.count(shm_read.PATH, endpoint, len(checked), landed[1])
        return landed[0]

    def land_gpu(
        self,
        peer: Peer,
        keys: Sequence[bytes],
        device: int,
        land: GpuLand,
        one_sided: bool = True,
        request: bool = True,
    ) -> GpuLanding:
        """Land the pages of ``keys`` from a same-node ``peer``'s GPU tier straight into this
        process's device memory (``land``: :data:`raykv.transfer.paths.gpu_land.GpuLand`, on CUDA
        device ``device``): one-sided (``gpu_read``, when ``one_sided``) if the owner's directory
        lists every key, else, when ``request``, one ``gpu_peer`` request per batch. Returns how
        many leading keys landed and by which path (0 and None when the path is not available:
        another node, no GPU tier, switched off). TransferError when a request failed or its lease
        did not hold: nothing ``land`` wrote may be used then."""
        checked, endpoint = pull_request(peer, keys)
        if not checked or endpoint in self.gpu_pools.refused:  # no GPU path to this peer
            return GpuLanding(0, None)
        if one_sided and gpu_land.land_gpu_local(self, endpoint, checked, device, land):
            return GpuLanding(len(checked), gpu_land.LOCAL_PATH)
        if not request:
            return GpuLanding(0, None)
        got = gpu_land.land_gpu_request(self, endpoint, checked, device, land)
        landed = int(self.runtime.run(self.guard(endpoint, None, got), self.config.timeout_s + 5) or 0)
        return GpuLanding(landed, gpu_land.PATH if landed else None)

    def pin_for_cuda(self) -> None:
        """Page-lock (read-only ``cudaHostRegister``) every same-node peer's shared tier this
        client maps, now and later, so that device copies from one-sided reads DMA the mapping
        directly. Changes nothing else; without CUDA (or when the driver refuses) the mappings
        stay pageable and device copies stage through pinned buffers."""
        self._pin_local = True
        for local in self._local.values():
            local.mapping.pin_for_cuda()

    def count(self, path: str, peer: tuple[str, int], pages: int, nbytes: int) -> None:
        """Count one pull of ``pages`` pages (``nbytes``) on ``path`` from ``peer`` (stats)."""
        stats = self.stats
        stats.pulls[path] += 1
        stats.pages[path] += pages
        stats.bytes[path] += nbytes
        label = self._labels.get(peer)
        if label is None:
            label = self._labels[peer] = f"{peer[0]}:{peer[1]}"
        stats.last_path[label] = path

    # ---- pulls -----------------------------------------------------------------------------------
    async def _pull_all(
        self, peer: tuple[str, int], keys: list[BlockKey], opts: _Options
    ) -> tuple[list[Part], _Landed | None]:
        """Pull ``keys`` in batches that respect the server's key and payload limits; a
        ``pull_land`` that fits in one batch lands it (its result comes back as ``_Landed``)."""
        conn = await self.checkout(peer)
        parts: list[Part] = []
        landed = None
        try:
            out = opts.out
            check_out(out, len(keys), conn.page_bytes)
            per_batch = max(1, min(conn.max_keys, conn.max_payload // max(1, conn.page_bytes)))
            used = 0
            for first in range(0, len(keys), per_batch):
                dest = out[used:] if out is not None else None
                batch = keys[first : first + per_batch]
                got = await self._pull_batch(conn, batch, opts, dest, len(batch) == len(keys))
                if isinstance(got, _Landed):
                    landed = got
                else:
                    used += len(got.data)
                    parts.append(got)
        except BaseException:
            conn.close()
            raise
        self.checkin(peer, conn)
        return parts, landed

    async def _pull_batch(
        self,
        conn: ClientConn,
        keys: list[BlockKey],
        opts: _Options,
        dest: npt.NDArray[np.uint8] | None,
        whole: bool,
    ) -> Part | _Landed:
        """One request/response on ``conn``: header, payload (verified or confirmed), done."""
        rid, tag = self.new_request(), secrets.randbits(48) << 12
        mapping = self._mapping(conn) if opts.prefer_shm else None
        land = opts.land if whole else None
        sums = checks("shm", opts.verify, self.config)  # checksums over shm; else the server acknowledges
        request = {"t": "pull", "id": rid, "keys": list(keys), "tag": tag, "sums": sums}
        request.update(path="shm" if mapping is not None else "ucx", ack=land is not None or not sums)
        budget = self.budget
        early = mapping is None and self.config.post_receives and self._ucx_ctx is not None
        early = early and conn.server_ucx is not None  # else no endpoint: the pull says so later
        # Held before asking, for every requested page (a posted receive may take them all), the
        # unfound ones given back with the header: a pull never waits for this budget while its
        # server holds its own for it, so pulls and servers cannot wait on each other in a cycle.
        held = len(keys) * conn.page_bytes
        await budget.acquire(held)
        try:
            endpoint = await conn.open_endpoint() if early else None
            config, split = self.config, 0
            if early:
                split = early_split(len(keys), conn.page_bytes, config.early_split_bytes, config.chunk_bytes)
            request.update(posted=early, **({"split": split} if split else {}))
            await conn.send(request)  # first: UCX keeps chunk 0 if it comes before its receive
            first = None
            if early:  # into rows for every requested page
                flat, data = self.spare.rows(len(keys), conn.page_bytes, dest, land is not None)
                first = post_first(endpoint, data, flat, tag, split)
            limits = (min(conn.max_payload, self.config.max_payload_bytes), self.config.max_header_bytes)
            header = await read_header(conn, rid, keys, conn.page_bytes, limits, mapping is not None, first)
            n = len(header.keys)
            budget.release(held - n * header.page_bytes)
            held = n * header.page_bytes
            path = REQUEST_PATHS[header.path]  # read_header took only these
            batch = Batch(conn, header, tag, mapping, opts.verify, first)
            got: Part | _Landed
            if land is not None:
                got = _Landed(await path.land(self, batch, land, keys))
            else:
                data = (
                    first.data[:n]
                    if first is not None
                    else self.spare.rows(n, header.page_bytes, dest, False)[1]
                )
                got = await path.receive(self, batch, data)
        finally:
            budget.release(held)
        self.count(header.path, conn.peer, n, n * header.page_bytes)
        return got

    def _mapping(self, conn: ClientConn) -> ShmMapping | None:
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

"""The two request paths into host memory: ``shm`` (:class:`ShmPath`) and ``ucx`` (:class:`UcxPath`).

- ``shm``: the client runs on the server's node (same node id) and every leased page is on the
  server's shared host tier: the header carries slot numbers and the client copies from its
  read-only mapping of the tier file. Checksums only when the client asks; otherwise the server
  acknowledges the client's ``done`` (the lease lasted while the client read).
- ``ucx``: everything else; the payload goes as a few large UCX tag messages (``chunk_bytes``
  each) straight from tier memory where possible (:class:`raykv.transfer.pages.payload.LeasedPayload`),
  checksummed on both sides.

Server side, :meth:`serve` (called by the page server, which holds the lease). Client side,
:meth:`receive` (the pages into rows the client owns) and :meth:`land` (the pages handed to a
landing, :mod:`raykv.transfer.pages.landing`), called by :class:`raykv.transfer.client.PageClient` for
the path the server's header names.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

import raykv.transfer.net.wire as wire
from raykv.core.errors import TransferError, TransferFailure
from raykv.core.records import BlockLease, page_checksum
from raykv.core.tiers.host import HostPool
from raykv.core.types import BlockKey
from raykv.transfer.net.config import TransferConfig
from raykv.transfer.net.connection import ClientConn
from raykv.transfer.net.runtime import INLINE_BYTES, map_rows, offload, tag_send
from raykv.transfer.pages.landing import (
    STREAM_THREADS,
    Arrivals,
    Land,
    LeaseCheck,
    run_land,
    run_streamed,
    streams,
)
from raykv.transfer.pages.payload import LeasedPayload, payload_counts, settle_pages
from raykv.transfer.pages.receive import FirstChunk, SpareBuffers, compare, copy_shm, read_sums, receive_ucx
from raykv.transfer.pages.results import Part, merge
from raykv.transfer.pages.shm import ShmMapping
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.serving import PullRequest, ServerConn

_EMPTY = np.zeros(0, dtype=np.uint8)  # the message a posted receive gets when no page is for it


class HostClient(Protocol):
    """What the host paths use of a page client: its settings and its spare receive buffers."""

    config: TransferConfig
    spare: SpareBuffers


class Batch(NamedTuple):
    """One batch of a pull, client side, once its header arrived: the connection, the header, the
    payload's base UCX tag, the mapping of the server's shared tier (shm only), the caller's
    ``verify`` and the receives posted with the request (ucx only, else None)."""

    conn: ClientConn
    header: wire.Header
    tag: int
    mapping: ShmMapping | None
    verify: bool | None
    first: FirstChunk | None = None


def checks(path: str, verify: bool | None, config: TransferConfig) -> bool:
    """Whether the client compares the pages of ``path`` with the sender's checksums: ``verify``
    when given, else always over ``ucx`` and as ``config.verify_shm`` says over ``shm``."""
    if verify is not None:
        return verify
    return path != ShmPath.name or config.verify_shm


# ---- shm ------------------------------------------------------------------------------------------
class ShmPath(TransferPath):
    """The ``shm`` path (see the module docstring). ``level``: the server's shared host tier (-1:
    none, then the path accepts nothing)."""

    name: ClassVar[str] = "shm"

    def __init__(self, level: int = -1, enabled: bool = True) -> None:
        self.level = level
        self.enabled = enabled

    def accepts(self, conn: ServerConn, pull: PullRequest) -> bool:
        """Same node, the path on, and every leased page on the shared tier."""
        return (
            self.level >= 0
            and self.enabled
            and conn.node == conn.site.node_id
            and all(b.level == self.level for b in pull.lease.blocks)
        )

    async def serve(self, conn: ServerConn, pull: PullRequest) -> None:
        """Slots in the header; the client copies from its mapping. Checksums only when the pull
        asked for them (computed while the client copies; a small payload's go in the header);
        an ``ack`` of the client's ``done`` when asked, sent before the lease ends."""
        manager, lease, rid = conn.site.manager, pull.lease, pull.request_id
        pool = manager.pools[self.level]
        assert isinstance(pool, HostPool)
        slots = [b.slot for b in lease.blocks]
        settle_pages(manager, lease.blocks)  # the client reads these slots right after the header
        nbytes = len(slots) * pool.page_bytes
        corrupt = conn.site.faults.corrupt_payload
        inline = conn.sums and nbytes <= INLINE_BYTES
        sums = _page_sums(pool, slots, 0, len(slots), corrupt) if inline else None
        await conn.send_header(pull, self.name, slots, sums)
        await conn.after_header()
        if conn.sums and sums is None:
            sums = await map_rows(
                pool.page_bytes, len(slots), lambda a, b: _page_sums(pool, slots, a, b, corrupt)
            )
            await conn.send({"t": "sums", "id": rid, "sums": sums})
        await conn.await_done(rid, None)
        if conn.ack:
            await conn.send({"t": "ack", "id": rid})

    async def receive(self, client: HostClient, batch: Batch, data: npt.NDArray[np.uint8]) -> Part:
        """Copy the leased slots from the mapping into ``data``, then either compare them with the
        server's checksums (when :func:`checks`) or have the server acknowledge the lease."""
        conn, header, mapping = batch.conn, batch.header, batch.mapping
        assert mapping is not None
        sums = checks(self.name, batch.verify, client.config)
        mine = await copy_shm(mapping, header, data, sums)
        if not sums:
            await conn.finish(header.request_id)
            return Part(header, data, None, True)
        theirs = await server_sums(conn, header)
        await conn.send({"t": "done", "id": header.request_id})  # the lease may end now
        return Part(header, data, compare(header, mine, theirs), True)

    async def land(self, client: HostClient, batch: Batch, land: Land[Any], keys: list[BlockKey]) -> Any:
        """``land`` the pages straight from the mapping (gathered first when not one run of
        slots), confirmed by the server's ``ack``; the landing's result."""
        start = time.perf_counter()
        conn, header, mapping = batch.conn, batch.header, batch.mapping
        assert mapping is not None
        flat = None
        rows = mapping.run(list(header.layout))
        if rows is None:  # not one run of slots: gather them first
            flat, rows = client.spare.take(len(header.keys), header.page_bytes)
            await copy_shm(mapping, header, rows, False)
        sums: list[int] | None = None
        if checks(self.name, batch.verify, client.config):  # the import checks them (it reads the rows)
            sums = await server_sums(conn, header)
        pulled = merge([Part(header, rows, sums, sums is None)], keys, time.perf_counter() - start)
        loop = asyncio.get_running_loop()
        lease = LeaseCheck(loop, lambda: conn.finish(header.request_id), client.config.timeout_s)
        return await land_then_finish(client, batch, land, pulled, lease, flat)


async def server_sums(conn: ClientConn, header: wire.Header) -> list[int]:
    """The server's checksums: from the header, or the ``sums`` message that follows it."""
    if header.sums is not None:
        return list(header.sums)
    return await read_sums(conn, header, conn.max_header_bytes)


async def land_then_finish(
    client: HostClient, batch: Batch, land: Land[Any], pulled: Any, lease: LeaseCheck, flat: Any
) -> Any:
    """``run_land(land, pulled, lease)``; then ``flat`` back to the spare buffers and, when the
    landing never confirmed, the lease's ``done``/``ack`` (the shm path's lease ends with it)."""
    try:
        result = await run_land(land, pulled, lease)  # returns once the worker thread is done
    finally:
        if flat is not None:
            client.spare.give(flat)
    if not lease.done:
        await batch.conn.finish(batch.header.request_id)
    return result


def _page_sums(pool: HostPool, slots: list[int], first: int, last: int, corrupt: bool) -> list[int]:
    """Checksums of the pages at ``slots[first:last]`` (``corrupt``: the test hook spoils page 0's,
    since the shm path copies the true bytes and only a wrong checksum can make them look bad)."""
    sums = [page_checksum(memoryview(pool.array[s])) for s in slots[first:last]]
    if corrupt and first == 0 and sums:
        sums[0] ^= 1
    return sums


# ---- ucx ------------------------------------------------------------------------------------------
class UcxPath(TransferPath):
    """The ``ucx`` path (see the module docstring); every server answers on it."""

    name: ClassVar[str] = "ucx"

    async def serve(self, conn: ServerConn, pull: PullRequest) -> None:
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
        site, lease, tag = conn.site, pull.lease, pull.tag
        manager, faults, early, split = site.manager, site.faults, conn.posted, conn.split
        page, chunk = manager.layout.page_bytes, site.config.chunk_bytes
        counts = payload_counts(len(lease.blocks), page, chunk, early, split)
        payload = LeasedPayload(manager, lease.blocks, chunk, faults.corrupt_payload, counts)
        endpoint: Any = await conn.open_endpoint() if lease.blocks or early else None
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
                manager.remember_checksums(lease.blocks, sums)
            if early:
                await conn.after_header()  # the test hooks: here, before the header
            await conn.send_header(pull, self.name, payload.counts, sums)
            if not early:
                await conn.after_header()
            for k, i in enumerate(chunks[ahead:]):
                buf = ready[k] if small else await _chunk_buf(payload, i)
                sends.append(asyncio.ensure_future(tag_send(endpoint, buf, tag + i)))
                if k + 1 == faults.drop_after_chunks:  # the test hook
                    await asyncio.gather(*sends)
                    raise TransferError(
                        "connection dropped mid-payload (test hook)", reason=TransferFailure.FAULT
                    )
            if sums is None:
                await _send_trailer(conn, pull, payload)
            await conn.await_done(pull.request_id, asyncio.gather(*sends) if sends else None)
        except BaseException:
            conn.drop_endpoint()  # UCX stops reading the pages before the caller ends the lease
            for s in sends:
                s.cancel()
            raise

    async def receive(self, client: HostClient, batch: Batch, data: npt.NDArray[np.uint8]) -> Part:
        """The payload into ``data``, checked as it lands when :func:`checks` (else the sender's
        checksums come along for the import); ``done`` is said two loop turns later."""
        check = checks(self.name, batch.verify, client.config)
        theirs = await receive_payload(batch, data, check, defer=True)
        return Part(batch.header, data, theirs, check)

    async def land(self, client: HostClient, batch: Batch, land: Land[Any], keys: list[BlockKey]) -> Any:
        """``land`` the pages from the buffer they were received (and verified) into; a payload of
        several chunks streams into a ``land.stream`` when it has one (:func:`streams`)."""
        start = time.perf_counter()
        header, first = batch.header, batch.first
        if first is not None:
            flat, data = first.flat, first.data[: len(header.keys)]
        else:
            flat, data = client.spare.take(len(header.keys), header.page_bytes)
        check = checks(self.name, batch.verify, client.config)
        stream = getattr(land, "stream", None) if check else None
        if stream is not None and streams(header, client.spare.limit) and STREAM_THREADS.take():
            arrivals = Arrivals(len(header.keys), client.config.timeout_s)
            receive = receive_payload(batch, data, True, on_rows=arrivals.arrived)
            pulled = merge([Part(header, data, None, True)], keys, time.perf_counter() - start)
            result = await run_streamed(stream, pulled, arrivals, receive)  # failed: `flat` dropped
            if flat is not None:
                client.spare.give(flat)
            return result
        theirs = await receive_payload(batch, data, check)  # failed: `flat` dropped
        pulled = merge([Part(header, data, theirs, check)], keys, time.perf_counter() - start)
        return await land_then_finish(
            client, batch, land, pulled, LeaseCheck(asyncio.get_running_loop()), flat
        )


async def receive_payload(
    batch: Batch,
    data: npt.NDArray[np.uint8],
    verify: bool,
    on_rows: Any = None,
    defer: bool = False,
) -> list[int]:
    """Receive the payload into ``data`` (checksummed as it lands when ``verify``; chunk 0
    through ``batch.first``'s receive when posted early; ``on_rows`` as in :func:`receive_ucx`),
    say ``done`` (``defer``: two loop turns later, so the caller gets the pages first; the
    server's lease lasts until then); the server's checksums (compared with ours when
    ``verify``)."""
    conn, header = batch.conn, batch.header
    limit = conn.max_header_bytes
    posted = batch.first.recvs if batch.first is not None else ()
    mine, theirs = await receive_ucx(
        conn, conn.open_endpoint, header, batch.tag, data, verify, limit, posted, on_rows
    )
    done = {"t": "done", "id": header.request_id}
    if defer:  # written once the caller has the pages, or before the next message on conn
        conn.pending = wire.encode(done, limit)
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, conn.flush)  # after the pull's result is set
    else:
        await conn.send(done)
    return compare(header, mine, theirs)


async def _send_trailer(conn: ServerConn, pull: PullRequest, payload: LeasedPayload) -> None:
    """Checksum every chunk (on the copy threads), send them as ``sums``, remember them."""
    trailer: list[int] = []
    for i in range(len(payload.counts)):
        trailer.extend(await map_rows(payload.page_bytes, payload.counts[i], payload.sums_of(i)))
    await conn.send({"t": "sums", "id": pull.request_id, "sums": trailer})
    conn.site.manager.remember_checksums(pull.lease.blocks, trailer)


async def _chunk_buf(payload: LeasedPayload, index: int) -> Any:
    """Chunk ``index``'s buffer: in place, or gathered on the loop's executor when large."""
    nbytes = 0 if payload.in_place else payload.counts[index] * payload.page_bytes
    return await offload(nbytes, payload.chunk, index)


def known_sums(lease: BlockLease) -> list[int] | None:
    """The leased pages' checksums when an earlier send computed every one, else None."""
    sums = [b.checksum for b in lease.blocks]
    return None if None in sums else sums  # type: ignore[return-value]

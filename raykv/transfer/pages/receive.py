"""The client's receiving side of one pull: UCX chunks checksummed as they land, shm row copies,
and the comparison with the sender's checksums. Used by :class:`raykv.transfer.client.PageClient`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

import raykv.transfer.net.wire as wire
from raykv.core.errors import TransferError, TransferFailure
from raykv.core.records import page_checksum
from raykv.transfer.net.runtime import abort_endpoint, cancel_and_wait, map_rows, tag_recv
from raykv.transfer.pages.payload import split_counts
from raykv.transfer.pages.shm import ShmMapping


class Connection(Protocol):
    """What receiving needs of a client connection."""

    reader: asyncio.StreamReader
    endpoint: Any


class SpareBuffers:
    """Receive buffers kept for reuse by landings (``PageClient.pull_land``), whose rows are copied
    into the destination tier before the landing returns. Fresh memory costs a page fault per
    4 KiB on first touch, about as much as that copy; at most ``limit`` bytes are kept (the
    largest buffers go first). Used on the loop thread only.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[npt.NDArray[np.uint8]] = []

    def take(self, rows: int, row_bytes: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
        """(a flat buffer to give back later, its first ``rows`` rows of ``row_bytes``)."""
        need = rows * row_bytes
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= need]
        best = min(fits, key=lambda i: self._free[i].nbytes) if fits else None
        flat = self._free.pop(best) if best is not None else np.empty(need, dtype=np.uint8)
        return flat, flat[:need].reshape(rows, row_bytes)

    def rows(
        self, count: int, page_bytes: int, dest: npt.NDArray[np.uint8] | None, landing: bool
    ) -> tuple[npt.NDArray[np.uint8] | None, npt.NDArray[np.uint8]]:
        """(the spare buffer to give back or None, ``count`` rows to receive into): a spare buffer
        for a landing, else ``dest``'s leading rows, else a new array."""
        if landing:
            return self.take(count, page_bytes)
        return None, dest[:count] if dest is not None else np.empty((count, page_bytes), dtype=np.uint8)

    def give(self, flat: npt.NDArray[np.uint8]) -> None:
        """Keep ``flat`` for a later :meth:`take` (nothing may use it any more)."""
        self._free.append(flat)
        while sum(b.nbytes for b in self._free) > self.limit:
            self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].nbytes))


@dataclass(frozen=True)
class FirstChunk:
    """A ucx pull's receives posted with the request (``TransferConfig.post_receives``): its rows
    (room for every requested page), the spare buffer they belong to (landings, else None), the
    receives (chunk 0's into all rows; with a ``split``, chunk 0's into the first ``split`` rows
    and chunk 1's into the rest) and the split (0: none)."""

    data: npt.NDArray[np.uint8]
    flat: npt.NDArray[np.uint8] | None
    recvs: tuple[asyncio.Future[Any], ...]
    split: int = 0


def post_first(
    endpoint: Any, data: npt.NDArray[np.uint8], flat: npt.NDArray[np.uint8] | None, tag: int, split: int = 0
) -> FirstChunk:
    """Post the receive of chunk 0 into ``data`` at ``tag``, or with a ``split`` (0 < split <
    rows) chunk 0's into ``data[:split]`` and chunk 1's into the rest at ``tag + 1``. They post
    at the loop's next turn; UCX holds a message that arrives first until then."""
    if not split:
        return FirstChunk(data, flat, (asyncio.ensure_future(tag_recv(endpoint, data, tag)),))
    parts = (data[:split], data[split:])
    recvs = tuple(asyncio.ensure_future(tag_recv(endpoint, rows, tag + i)) for i, rows in enumerate(parts))
    return FirstChunk(data, flat, recvs, split)


async def read_header(
    conn: Connection,
    rid: int,
    keys: Sequence[bytes],
    page_bytes: int,
    limits: tuple[int, int],
    mapped: bool,
    first: FirstChunk | None,
) -> wire.Header:
    """The server's header for request ``rid``, checked against the request: its keys, page
    size, payload limit, and a path the client can take (shm only when ``mapped``; ucx when
    chunk 0's receive was posted). ``limits``: (max payload, max header bytes)."""
    msg = await wire.read_message(conn.reader, limits[1])
    header = wire.Header.from_msg(msg, list(keys), limits[0])
    if header.request_id != rid or header.page_bytes != page_bytes:
        raise wire.protocol_error("header does not answer this request")
    if (header.path == "shm" and not mapped) or header.path not in ("shm", "ucx"):
        raise wire.protocol_error(f"server chose the {header.path} path without being asked")
    if first is not None and header.path != "ucx":
        raise wire.protocol_error("the server did not answer a posted receive over ucx")
    split = first.split if first is not None else 0
    if split and list(header.layout) != split_counts(len(header.keys), split):
        raise wire.protocol_error("the server did not split the payload as asked")
    return header


async def read_sums(conn: Connection, header: wire.Header, max_bytes: int) -> list[int]:
    """The server's ``sums`` message for ``header`` (one CRC-32 per page)."""
    msg = wire.expect_type(await wire.read_message(conn.reader, max_bytes), "sums")
    if msg.get("id") != header.request_id:
        raise wire.protocol_error("checksums for another request")
    return wire.int_list(msg, "sums", len(header.keys), 0, 0xFFFFFFFF)


def compare(header: wire.Header, mine: list[int] | None, theirs: list[int]) -> list[int]:
    """``theirs`` when every page matches (or there is nothing to compare); else raise
    TransferError(reason="integrity") naming the bad keys."""
    if mine is None:
        return theirs
    bad = [header.keys[i] for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    if bad:
        raise TransferError(
            f"{len(bad)} of {len(mine)} page(s) failed their checksum; nothing was imported",
            reason=TransferFailure.INTEGRITY,
            bad_keys=tuple(bad),
        )
    return theirs


def checksums(rows: npt.NDArray[np.uint8]) -> list[int]:
    """CRC-32 of each row."""
    return [page_checksum(memoryview(row)) for row in rows]


async def copy_shm(
    mapping: ShmMapping, header: wire.Header, out: npt.NDArray[np.uint8], sums: bool
) -> list[int]:
    """Copy the pages at the header's slots out of ``mapping`` into ``out`` (one memcpy per run
    of consecutive slots; in pieces on the copy threads when large); with ``sums`` the CRC-32 of
    each copied page (else an empty list). TransferError for a slot outside the mapping."""
    slots = list(header.layout)
    mapping.check(slots)

    def copy(first: int, last: int) -> list[int]:
        mapping.copy(slots[first:last], out[first:last])
        return checksums(out[first:last]) if sums else []

    return await map_rows(header.page_bytes, len(slots), copy)


async def receive_ucx(
    conn: Connection,
    endpoint: Callable[[], Awaitable[Any]],
    header: wire.Header,
    tag: int,
    data: npt.NDArray[np.uint8],
    verify: bool,
    max_bytes: int,
    posted: Sequence[asyncio.Future[Any]] = (),
    on_rows: Callable[[int], object] | None = None,
) -> tuple[list[int] | None, list[int]]:
    """Post one receive per chunk into ``data`` (tags ``tag + i``) and checksum each chunk as it
    lands (``verify``); returns (our checksums or None, the server's). ``posted``: the receives
    of the first chunks, posted with the request (:func:`post_first`; a chunk with no pages
    comes as an empty message, awaited too). ``on_rows(n)``: called on the loop once rows
    ``0 .. n`` landed (each chunk, before its checksums). On any failure the endpoint is
    aborted first, which cancels the posted receives: nothing lands in ``data`` afterwards."""
    if header.sums is not None:
        sums_task: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        sums_task.set_result(list(header.sums))
    else:
        sums_task = asyncio.ensure_future(read_sums(conn, header, max_bytes))
    recvs = list(posted[: len(header.layout)])
    empty = posted[len(recvs) :]  # chunks with no pages: their empty messages
    try:
        if header.keys and len(recvs) < len(header.layout):
            ep = await endpoint()
            first = sum(header.layout[: len(recvs)])
            for i, count in enumerate(header.layout[len(recvs) :], start=len(recvs)):
                rows = data[first : first + count]
                recvs.append(asyncio.ensure_future(tag_recv(ep, rows, tag + i)))
                first += count
        counts = [*header.layout, *[0] * len(empty)]
        every = [*recvs, *empty]
        return await _checksum_as_received(conn, data, header, every, counts, sums_task, verify, on_rows)
    except BaseException:
        abort_endpoint(conn.endpoint)
        conn.endpoint = None
        for fut in (*recvs, *empty, sums_task):
            fut.cancel()
        raise


async def _checksum_as_received(
    conn: Connection,
    data: npt.NDArray[np.uint8],
    header: wire.Header,
    recvs: list[asyncio.Future[Any]],
    counts: list[int],
    sums_task: asyncio.Future[list[int]],
    verify: bool,
    on_rows: Callable[[int], object] | None = None,
) -> tuple[list[int] | None, list[int]]:
    """Await each chunk (``counts`` pages each, in order from ``data``'s first row; 0: an empty
    message), report it (``on_rows``) and checksum it; returns (our checksums or None, the
    server's).

    The control stream is watched meanwhile: first for the server's checksums (or its error),
    then for EOF (the server sends nothing else until our ``done``), so a peer that dies
    mid-transfer fails the pull at once instead of at the timeout.
    """
    mine: list[int] | None = [] if verify else None
    theirs: list[int] | None = None
    watch: asyncio.Future[Any] = sums_task
    first = 0
    try:
        for recv, count in zip(recvs, counts):
            while not recv.done():
                await asyncio.wait({recv, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch.done() and not recv.done():
                    theirs, watch = _next_watch(conn, watch, theirs)
            recv.result()
            if on_rows is not None and count:
                on_rows(first + count)
            rows = data[first : first + count]
            if mine is not None:
                mine.extend(await map_rows(header.page_bytes, count, _row_sums(rows)))
            first += count
        if theirs is None:
            theirs = await sums_task
    finally:
        if watch is not sums_task:
            await cancel_and_wait(watch)  # before anything reads the stream again
    return mine, theirs


def _row_sums(rows: npt.NDArray[np.uint8]) -> Callable[[int, int], list[int]]:
    return lambda first, last: checksums(rows[first:last])


def _next_watch(
    conn: Connection, watch: asyncio.Future[Any], sums: list[int] | None
) -> tuple[list[int] | None, asyncio.Future[Any]]:
    """The control stream finished ``watch``: keep the checksums, then watch for EOF."""
    result = watch.result()  # the peer's error, or EOF, raises here
    if sums is None:
        return result, asyncio.ensure_future(conn.reader.read(1))
    if result == b"":
        raise TransferError("the peer closed the connection mid-transfer", reason=TransferFailure.CLOSED)
    raise wire.protocol_error("unexpected bytes from the peer during the payload")

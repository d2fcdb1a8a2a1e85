"""The ``direct`` pull path: pages land in the receiver's top-tier memory and are imported there.

The ``ucx`` path lands every page in host memory and checks it with a host CRC-32 on both sides,
so a GPU-to-GPU pull is bounded by device-to-host copies and CRC speed. The ``direct`` path keeps
the bytes where the tiers keep them:

- sender (:meth:`DirectPath.serve`, called by :class:`~raykv.transfer.server.PageServer` when a
  client asks for ``"direct"``): the leased pages in place (one consecutive run on one tier) or gathered
  into one staging buffer on the tier's device, sent as at most ``MAX_PIECES`` large UCX messages
  (UCX's per-message cost is high; GPU buffers go over cuda_ipc / NVLink). The header carries a
  :func:`page_digests` value per page, computed where the bytes are (on the GPU for GPU pages).
- receiver (:func:`pull_direct`): one buffer on the receiving manager's top-tier device (a CUDA
  tensor for a GPU tier, host memory else), the digests recomputed there and compared before
  anything is imported; :func:`import_direct` then imports them with the one import procedure
  of every path (:func:`raykv.core.export_import.import_written`: validated, room made, slots
  allocated, blocks inserted, all or nothing), its writer copying the pages into the new
  top-tier slots with one device-side index copy (``CacheManager.import_pages`` needs host rows).

The digest is not a CRC: per page, 64-bit wrapping sums of each 512-byte row (as int64 words),
weighted by fixed odd constants per row and folded to 32 bits. Any single changed word changes it,
and so do rows moved within the page; it detects transport and staging faults, the same job the
CRC does on the host paths (the token guards authenticity). It runs at memory bandwidth on the
device and gives the same value on every device, since integer sums do not depend on order.

torch is needed on both sides (imported lazily); no other path changes.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import raykv.transfer.net.wire as wire
from raykv.core.errors import InvalidArgumentError, TransferError, TransferFailure
from raykv.core.export_import import import_written
from raykv.core.manager import CacheManager
from raykv.core.records import BlockLease, BlockRecords
from raykv.core.types import DEFAULT_PRIORITY, BlockKey, PageId, TierKind, check_block_key, check_priority
from raykv.transfer.net.config import Peer, PeerAddress
from raykv.transfer.net.connection import ClientConn
from raykv.transfer.net.runtime import cancel_and_wait
from raykv.transfer.pages.payload import LeasedPayload
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.importer import PullOutcome, import_outcome, importable_prefix, refusals
from raykv.transfer.paths.pull_client import PullClient
from raykv.transfer.paths.serving import PullRequest, ServerConn

PATH = "direct"
SPLIT_BYTES = 64 << 20
"""A payload up to this size goes as one UCX message; a larger one in up to MAX_PIECES."""
MAX_PIECES = 4
ROW_WORDS = 64
"""Digest rows: 64 int64 words (512 bytes)."""


def direct_counts(num_pages: int, page_bytes: int, max_pieces: int = MAX_PIECES) -> list[int]:
    """Pages per UCX message: one message up to SPLIT_BYTES, else ``max_pieces`` about equal ones."""
    if num_pages == 0:
        return []
    pieces = 1 if num_pages * page_bytes <= SPLIT_BYTES else max(1, min(max_pieces, num_pages))
    per = -(-num_pages // pieces)
    return [min(per, num_pages - first) for first in range(0, num_pages, per)]


# ---- digests ----------------------------------------------------------------------------------
_weights: dict[tuple[str, int], Any] = {}


def _row_weights(torch: Any, device: Any, rows: int) -> Any:
    key = (str(device), rows)
    if key not in _weights:
        raw = np.random.default_rng(0x7261796B76).integers(-(1 << 62), 1 << 62, rows, dtype=np.int64)
        _weights[key] = torch.from_numpy(raw | 1).to(device)
    return _weights[key]


def page_digests(rows: Any) -> list[int]:
    """A 32-bit digest of each page of ``rows`` (uint8 ``[n, page_bytes]``, a torch tensor on any
    device or a numpy array), computed where the bytes are. See the module docstring."""
    import torch

    t = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows
    n, page = int(t.shape[0]), int(t.shape[1])
    if n == 0:
        return []
    if page % 8 == 0 and t.is_contiguous():
        words = t.view(torch.int64).view(n, page // 8)
    else:
        words = t.to(torch.int64)  # odd page sizes: one word per byte (slow, exact)
    width = int(words.shape[1])
    per_row = ROW_WORDS if width % ROW_WORDS == 0 else 1
    sums = words.view(n, width // per_row, per_row).sum(dim=2) if per_row > 1 else words
    weights = _row_weights(torch, t.device, int(sums.shape[1]))
    mixed = (sums * weights).sum(dim=1).tolist()
    out = []
    for value in mixed:
        v = int(value) & 0xFFFFFFFFFFFFFFFF
        out.append((v ^ (v >> 32)) & 0xFFFFFFFF)
    return out


def _ucx_buffer(t: Any) -> Any:
    """What ucxx takes for ``t``: the tensor itself on a GPU, a numpy view on the host."""
    return t if isinstance(t, np.ndarray) or t.is_cuda else t.numpy()


def _bind(device: Any) -> None:
    """Make ``device``'s CUDA context current on this thread (UCX's copies run on it)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)


# ---- sender -----------------------------------------------------------------------------------
class _DirectPayload(LeasedPayload):
    """A LeasedPayload cut into a few large messages (``direct_counts``) instead of chunk_bytes.

    ``in_place``: send one consecutive run straight from the tier. None (the default) does so for
    host tiers only: a GPU tier's CUDA virtual-memory chunks cannot be mapped by UCX's cuda_ipc
    (measured on 2x H200 with UCX 1.21: 0.5 GB/s in place, against 66+ GB/s from a plain device
    allocation), so GPU pages are gathered into a staging buffer first (a device copy)."""

    def __init__(
        self, manager: CacheManager, lease: BlockLease, corrupt: bool, in_place: bool | None, pieces: int
    ) -> None:
        super().__init__(manager, lease.blocks, 1 << 62, corrupt)
        self.counts = direct_counts(len(lease.blocks), self.page_bytes, pieces)
        if in_place is None:
            in_place = not self.device
        self.starts = [0, *itertools.accumulate(self.counts)][: len(self.counts)]
        if self.in_place and not in_place:
            # One consecutive run: one plain copy (a memcpy on the device); chunks are its slices.
            # (Ordered before UCX reads it: page_digests waits for the stream.)
            self._buf = self._buf.copy() if isinstance(self._buf, np.ndarray) else self._buf.clone()

    def _gather(self, first: int, rows: Any) -> None:
        """Device pages: one index_select over 8-byte words (byte-wise indexing is several times
        slower on the GPU); anything else as LeasedPayload does it."""
        group = self.blocks[first : first + len(rows)]
        if not self.device or self.page_bytes % 8:
            super()._gather(first, rows)
            return
        import torch

        memory = self.manager.pools[group[0].level].tensor  # type: ignore[attr-defined]
        index = torch.as_tensor([b.slot for b in group], dtype=torch.long, device=rows.device)
        torch.index_select(memory.view(torch.int64), 0, index, out=rows.view(torch.int64))

    def true_rows(self) -> Any:
        """All pages, uncorrupted (after every chunk() call: the staging buffer is then full)."""
        return self._buf


class DirectPath(TransferPath):
    """The ``direct`` path (see the module docstring). ``in_place`` and ``pieces``: the sender's
    knobs for tests and benchmarks (see :class:`_DirectPayload`; default: in place for host tiers
    only, :data:`MAX_PIECES`)."""

    name: ClassVar[str] = PATH

    def __init__(self, in_place: bool | None = None, pieces: int = MAX_PIECES) -> None:
        self.in_place = in_place
        self.pieces = pieces

    async def serve(self, conn: ServerConn, pull: PullRequest) -> None:
        """Serve one ``direct`` pull (the server holds the lease): digests in the header, then
        at most ``pieces`` UCX messages from the pages' own device."""
        lease, rid, tag = pull.lease, pull.request_id, pull.tag
        corrupt = conn.site.faults.corrupt_payload
        payload = _DirectPayload(conn.site.manager, lease, corrupt, self.in_place, self.pieces)
        device = getattr(payload.true_rows(), "device", None)
        _bind(device)
        endpoint: Any = await conn.open_endpoint() if lease.blocks else None
        chunks = [payload.chunk(i) for i in range(len(payload.counts))]
        sums = page_digests(payload.true_rows()) if lease.blocks else []  # syncs the device
        await conn.send_header(pull, PATH, payload.counts, sums)
        await conn.after_header()
        sends: list[asyncio.Future[Any]] = []
        try:
            for i, buf in enumerate(chunks):
                send = endpoint.send(_ucx_buffer(buf), tag=tag + i, force_tag=True)
                sends.append(asyncio.ensure_future(send))
            await conn.await_done(rid, asyncio.gather(*sends) if sends else None)
        except BaseException:
            conn.drop_endpoint()  # UCX stops reading the pages before the lease ends
            for s in sends:
                s.cancel()
            raise


# ---- receiver ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DirectPages:
    """The pages of one direct pull, verified, in request order, in one buffer on ``device``
    (``data[i]`` is the page of ``keys[i]``; a torch tensor)."""

    keys: tuple[BlockKey, ...]
    parent_keys: tuple[BlockKey, ...]
    parent_is_root: tuple[bool, ...]
    num_tokens: tuple[int, ...]
    data: Any
    missing: tuple[BlockKey, ...]
    seconds: float
    path: str = PATH
    phases: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Seconds from the request to the header (the sender's gather and digests included), of the
    payload, and of the digest check here; summed over batches."""

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


def top_device(manager: CacheManager) -> Any:
    """Where a direct pull for ``manager`` lands: its top GPU tier's device, else the host."""
    import torch

    pool = manager.top_pool
    return pool.device if pool.kind is TierKind.GPU else torch.device("cpu")  # type: ignore[attr-defined]


async def pull_direct(
    client: PullClient, peer: Peer, keys: Sequence[bytes], device: Any, timeout_s: float | None = None
) -> DirectPages:
    """Pull the committed blocks among ``keys`` from ``peer`` into one buffer on ``device``.

    Every page is compared with the sender's digest before this returns (TransferError with
    reason "integrity" and ``bad_keys`` otherwise). Failures as for :meth:`PageClient.pull`.
    """
    import torch

    checked = [check_block_key(k) for k in keys]
    if len(set(checked)) != len(checked):
        raise InvalidArgumentError("keys", "duplicate keys in one pull")
    device = torch.device(device)
    endpoint = peer.endpoint if isinstance(peer, PeerAddress) else (str(peer[0]), int(peer[1]))
    start = time.perf_counter()
    parts: list[tuple[wire.Header, Any, tuple[float, float, float]]] = []
    if checked:
        _bind(device)
        # the client's guard: timeout, failure counting, errors wrapped as TransferError
        parts = await client.guard(endpoint, timeout_s, _pull_all(client, endpoint, checked, device))
    headers = [h for h, _, _ in parts]
    found = [BlockKey(k) for h in headers for k in h.keys]
    have = set(found)
    page_bytes = headers[0].page_bytes if headers else 0
    datas = [d for _, d, _ in parts]
    if len(datas) == 1:
        data = datas[0]
    elif datas:
        data = torch.cat(datas)
    else:
        data = torch.empty((0, page_bytes), dtype=torch.uint8, device=device)
    return DirectPages(
        keys=tuple(found),
        parent_keys=tuple(BlockKey(p) for h in headers for p in h.parents),
        parent_is_root=tuple(r for h in headers for r in h.roots),
        num_tokens=tuple(t for h in headers for t in h.tokens),
        data=data,
        missing=tuple(k for k in checked if k not in have),
        seconds=time.perf_counter() - start,
        phases=(
            sum(p[0] for _, _, p in parts),
            sum(p[1] for _, _, p in parts),
            sum(p[2] for _, _, p in parts),
        ),
    )


async def _pull_all(
    client: PullClient, peer: tuple[str, int], keys: list[BlockKey], device: Any
) -> list[tuple[wire.Header, Any, tuple[float, float, float]]]:
    parts = []
    async with client.connection(peer) as conn:
        per_batch = max(1, min(conn.max_keys, conn.max_payload // max(1, conn.page_bytes)))
        for first in range(0, len(keys), per_batch):
            parts.append(await _pull_batch(client, conn, keys[first : first + per_batch], device))
    return parts


async def _pull_batch(
    client: PullClient, conn: ClientConn, keys: list[BlockKey], device: Any
) -> tuple[wire.Header, Any, tuple[float, float, float]]:
    import torch

    t0 = time.perf_counter()
    rid, tag = client.new_request(), secrets.randbits(48) << 12
    await conn.send({"t": "pull", "id": rid, "keys": list(keys), "path": PATH, "tag": tag})
    limit = min(conn.max_payload, client.config.max_payload_bytes)
    msg = await conn.read()
    header = wire.Header.from_msg(msg, list(keys), limit)
    if header.request_id != rid or header.page_bytes != conn.page_bytes:
        raise wire.protocol_error("header does not answer this request")
    if header.path != PATH or header.sums is None:
        raise wire.protocol_error("the server did not answer on the direct path")
    n = len(header.keys)
    budget = client.budget
    await budget.acquire(n * header.page_bytes)
    try:
        data = torch.empty((n, header.page_bytes), dtype=torch.uint8, device=device)
        t1 = time.perf_counter()
        await _receive(conn, header, tag, data)
        t2 = time.perf_counter()
        mine = page_digests(data)
        bad = [header.keys[i] for i, (a, b) in enumerate(zip(mine, header.sums)) if a != b]
        if bad:
            raise TransferError(
                f"{len(bad)} of {n} page(s) failed their digest; nothing was imported",
                reason=TransferFailure.INTEGRITY,
                bad_keys=tuple(bad),
            )
        await conn.send({"t": "done", "id": rid})
        t3 = time.perf_counter()
    finally:
        budget.release(n * header.page_bytes)
    client.count(PATH, conn.peer, n, n * header.page_bytes)
    return header, data, (t1 - t0, t2 - t1, t3 - t2)


async def _receive(conn: ClientConn, header: wire.Header, tag: int, data: Any) -> None:
    """Post one receive per message into ``data``; a peer that errs or goes fails it at once."""
    recvs: list[asyncio.Future[Any]] = []
    watch: asyncio.Future[Any] | None = None
    try:
        if header.keys:
            endpoint = await conn.open_endpoint()
            first = 0
            for i, count in enumerate(header.layout):
                rows = _ucx_buffer(data[first : first + count])
                recvs.append(asyncio.ensure_future(endpoint.recv(rows, tag=tag + i, force_tag=True)))
                first += count
            watch = asyncio.ensure_future(conn.read())
            for recv in recvs:
                while not recv.done():
                    await asyncio.wait({recv, watch}, return_when=asyncio.FIRST_COMPLETED)
                    if watch.done() and not recv.done():
                        wire.expect_type(watch.result(), "done")  # an error message raises here
                        raise wire.protocol_error("unexpected message during the payload")
                recv.result()
    except BaseException:
        conn.drop_endpoint()  # cancels the posted receives: nothing lands in `data` later
        for fut in recvs:
            fut.cancel()
        raise
    finally:
        if watch is not None:
            await cancel_and_wait(watch)


# ---- import -----------------------------------------------------------------------------------
def import_direct(manager: CacheManager, pages: DirectPages, priority: int = DEFAULT_PRIORITY) -> PullOutcome:
    """Import the importable prefix of ``pages`` (parents first) as committed top-tier blocks.

    This is the one import procedure of every path (:func:`raykv.core.export_import.import_written`:
    its rules, its result), with :func:`_write_top` as the writer: the new pages are copied
    device-side into newly allocated top-tier slots (a host copy only when the buffer is not on
    the top tier's device). The importable prefix is
    :func:`raykv.transfer.paths.importer.importable_prefix`; the blocks after it are ``dropped``.

    All or nothing: TransferError(reason "rejected") for pages whose size (or number) differs
    from the manager's and for any record the procedure refuses (ImportRejectedError: a partial
    block, a key repeated in the prefix); OutOfPagesError propagates; StateError after shutdown.
    Nothing is imported in any of these cases.

    Since this import became the shared procedure (issue 39): a key repeated within ``pages``
    (``pull_direct`` never returns one) is refused like that, where it used to be imported once;
    a block the salt's quota refuses (``max_blocks_per_salt``) is reported in ``refused``, as on
    every other path.
    """
    prio = check_priority(priority)
    page = manager.layout.page_bytes
    if pages.keys and tuple(pages.data.shape) != (len(pages.keys), page):
        text = (
            "page size differs from this manager's"
            if int(pages.data.shape[-1]) != page
            else f"{int(pages.data.shape[0])} pages for {len(pages.keys)} keys"
        )
        raise TransferError(f"import refused: {text}", reason=TransferFailure.REJECTED)
    records = BlockRecords(pages.keys, pages.parent_keys, pages.parent_is_root, pages.num_tokens)

    def write(slots: list[PageId], new: list[int]) -> None:
        _write_top(manager, slots, pages.data, new)

    with manager.locked():  # re-entrant: the prefix stays importable until the import
        n = importable_prefix(manager, records)
        with refusals(pages.keys, n):
            result = import_written(manager, records.head(n), write, prio)
    return import_outcome(pages, result, n, None)


def _write_top(manager: CacheManager, slots: list[PageId], data: Any, rows: list[int]) -> None:
    """Rows ``rows`` of ``data`` into top-tier ``slots`` (the writer of :func:`import_direct`,
    under the manager's lock): a device index copy (queued on the current stream) where possible."""
    import torch

    pool: Any = manager.pools[0]
    if rows != list(range(int(data.shape[0]))):
        data = data.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=data.device))
    if pool.kind is TierKind.GPU and data.is_cuda and data.device == pool.device:
        pool.wait_ready(slots)
        first = int(slots[0])
        if [int(s) for s in slots] == list(range(first, first + len(slots))):
            pool.tensor[first : first + len(slots)].copy_(data)  # one memcpy
        elif data.shape[1] % 8 == 0:  # 8-byte words: several times faster than byte indexing
            index = torch.as_tensor([int(s) for s in slots], dtype=torch.long, device=pool.device)
            pool.tensor.view(torch.int64).index_copy_(0, index, data.view(torch.int64))
        else:
            index = torch.as_tensor([int(s) for s in slots], dtype=torch.long, device=pool.device)
            pool.tensor.index_copy_(0, index, data)
    else:
        manager.copy.write(0, slots, np.ascontiguousarray(data.cpu().numpy()))


async def pull_direct_into(
    client: PullClient,
    peer: Peer,
    manager: CacheManager,
    keys: Sequence[bytes],
    timeout_s: float | None = None,
) -> PullOutcome:
    """Pull ``keys`` from ``peer`` on the direct path and import them into ``manager`` (on the
    runtime loop). TransferError for any failure: nothing is imported, the caller recomputes."""
    pages = await pull_direct(client, peer, keys, top_device(manager), timeout_s)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, import_direct, manager, pages)

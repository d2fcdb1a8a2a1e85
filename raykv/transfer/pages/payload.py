"""The sender's view of a lease: the leased pages, in request order, as contiguous chunks.

Zero copy where possible: when every leased page sits on one host (or GPU) tier in consecutive
slots, the chunks are slices of the tier's own memory and go to UCX as they are (a GPU tier's
slices are device tensors, which ucxx sends with its CUDA transports; untested on this CPU-only
project machine). Otherwise the pages are *not one contiguous run*, so they are gathered into one
staging buffer (on the device when all of them are on the GPU tier, in host memory else), filled
chunk by chunk right before each chunk is sent, so gathering overlaps with the transfer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from raykv.core.records import LeasedBlock, page_checksum
from raykv.core.types import PageId, TierKind
from raykv.transfer.pages.shm import consecutive

if TYPE_CHECKING:
    from raykv.core.manager import CacheManager


MIN_CHUNK_BYTES = 256 << 10


def chunk_counts(num_pages: int, page_bytes: int, chunk_bytes: int) -> list[int]:
    """Pages per chunk: whole pages, about a quarter of the payload per chunk (so checksums of
    one chunk overlap with the transfer of the next), at least 256 KiB (or one page), at most
    ``chunk_bytes``."""
    target = min(chunk_bytes, max(MIN_CHUNK_BYTES, num_pages * page_bytes // 4))
    per = max(1, target // page_bytes)
    return [min(per, num_pages - first) for first in range(0, num_pages, per)]


AUTO_SPLIT_BYTES = 512 << 10
AUTO_SPLIT_CORES = 8


@functools.cache
def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; read once)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def early_split(num_pages: int, page_bytes: int, split_bytes: int | None, chunk_bytes: int) -> int:
    """Where a ucx client that posts its receives with the request splits the payload: chunk 0
    gets up to the first ``returned`` pages, chunk 1 the rest, both receives posted at once, so
    the receiver checksums the first while the second arrives; 0: no split (one receive).

    Payloads of 4 pages or more, of at least ``split_bytes`` and at most ``chunk_bytes``, are split
    three quarters, then a quarter. ``split_bytes`` None: :data:`AUTO_SPLIT_BYTES` when this
    process may use :data:`AUTO_SPLIT_CORES` cores or more, else never (with fewer cores both
    sides' kernel copies keep every core busy, and the extra message costs more than the overlap
    saves); 0: never."""
    if split_bytes is None:
        split_bytes = AUTO_SPLIT_BYTES if usable_cores() >= AUTO_SPLIT_CORES else 0
    nbytes = num_pages * page_bytes
    if split_bytes <= 0 or num_pages < 4 or not split_bytes <= nbytes <= chunk_bytes:
        return 0
    return num_pages - num_pages // 4


def split_counts(num_pages: int, split: int) -> list[int]:
    """The chunks of a payload of ``num_pages`` split at ``split`` (see :func:`early_split`): up
    to ``split`` pages, then the rest; empty chunks left out."""
    return [c for c in (min(num_pages, split), num_pages - split) if c > 0]


def payload_counts(num_pages: int, page_bytes: int, chunk_bytes: int, posted: bool, split: int) -> list[int]:
    """Pages per chunk of a ucx payload of ``num_pages``: with a ``split`` (the client posted two
    receives, see :func:`early_split`) up to ``split`` pages then the rest, empty chunks left out
    (their messages still go, empty); ``posted`` (one receive posted) and at most ``chunk_bytes``:
    one chunk; else :func:`chunk_counts`."""
    if split:
        return split_counts(num_pages, split)
    if posted and 0 < num_pages * page_bytes <= chunk_bytes:
        return [num_pages]
    return chunk_counts(num_pages, page_bytes, chunk_bytes)


def settle_pages(manager: CacheManager, blocks: tuple[LeasedBlock, ...]) -> None:
    """Block until asynchronous copies into or out of the leased pages have completed.

    Anything that reads tier memory directly (the in-place send, the gather, a same-node peer
    copying from the shared tier) must call this first: with a GPU tier the copy engine moves
    pages asynchronously (``CopyEngine.settle`` for host slots; the GPU pool's slot events for
    device slots, waited for on the host because UCX reads device memory on its own streams).
    """
    if TierKind.GPU not in manager.tier_kinds:
        return  # host and disk copies are synchronous (raykv.core.copy): nothing can be in flight
    by_level: dict[int, list[PageId]] = {}
    for block in blocks:
        by_level.setdefault(block.level, []).append(PageId(block.slot))
    settle = getattr(manager.copy, "settle", None)
    for level, slots in by_level.items():
        if settle is not None:
            settle(level, slots)
        events = getattr(manager.pools[level], "events", None)
        if events is not None and len(events):
            events.wait_host(slots)


def host_array(buf: Any) -> npt.NDArray[np.uint8]:
    """``buf`` as a host numpy array (a device tensor is copied to the host)."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.cpu().numpy()  # type: ignore[no-any-return]


class LeasedPayload:
    """Chunks of the pages of ``blocks`` (held by a lease: they do not move while this lives):
    ``counts`` pages each (default: :func:`chunk_counts`).

    ``corrupt`` is a test hook: each chunk is copied and one byte flipped in the copy (the tier is
    never touched); checksums still describe the true pages, so the receiver must notice.
    """

    def __init__(
        self,
        manager: CacheManager,
        blocks: tuple[LeasedBlock, ...],
        chunk_bytes: int,
        corrupt: bool = False,
        counts: list[int] | None = None,
    ) -> None:
        self.manager = manager
        self.blocks = blocks
        self.page_bytes = manager.layout.page_bytes
        n, page = len(blocks), self.page_bytes
        self.counts = chunk_counts(n, page, chunk_bytes) if counts is None else counts
        assert sum(self.counts) == n, "chunk sizes must cover the pages"
        self.starts = [sum(self.counts[:i]) for i in range(len(self.counts))]
        self.corrupt = corrupt
        settle_pages(manager, blocks)
        levels = {b.level for b in blocks}
        slots = [b.slot for b in blocks]
        pool = manager.pools[blocks[0].level] if blocks else None
        memory = _pool_memory(pool) if len(levels) == 1 else None
        self.device = pool is not None and pool.kind is TierKind.GPU and len(levels) == 1
        if memory is not None and consecutive(slots):
            # One contiguous run of the tier's own memory: send it in place, no copy.
            self.in_place = True
            self._buf: Any = memory[slots[0] : slots[0] + len(slots)]
        else:
            # Not one contiguous run: gather into one staging buffer, chunk by chunk (see chunk()).
            self.in_place = False
            self._buf = _staging(memory, len(blocks), self.page_bytes, self.device)

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.page_bytes

    def chunk(self, index: int) -> Any:
        """The bytes of chunk ``index`` as one contiguous buffer (numpy, or a device tensor)."""
        first, count = self.starts[index], self.counts[index]
        rows = self._buf[first : first + count]
        if not self.in_place:
            self._gather(first, rows)
        if self.corrupt:
            rows = host_array(rows).copy()
            rows[0, 0] ^= 0xFF
        return rows

    def checksums(self, index: int) -> list[int]:
        """CRC-32 of each true page of chunk ``index`` (read from the tier or the staging copy)."""
        first, count = self.starts[index], self.counts[index]
        rows = host_array(self._buf[first : first + count])
        return [page_checksum(memoryview(rows[i])) for i in range(count)]

    def sums_of(self, index: int) -> Callable[[int, int], list[int]]:
        """``f(a, b)``: the checksums of pages ``a .. b`` of chunk ``index`` (for parallel use)."""
        first = self.starts[index]
        rows = host_array(self._buf[first : first + self.counts[index]])
        return lambda a, b: [page_checksum(memoryview(rows[i])) for i in range(a, b)]

    def _gather(self, first: int, rows: Any) -> None:
        """Fill staging ``rows`` with the pages of blocks ``first ..`` (grouped per tier)."""
        group = self.blocks[first : first + len(rows)]
        by_level: dict[int, list[int]] = {}
        for i, block in enumerate(group):
            by_level.setdefault(block.level, []).append(i)
        for level, idx in by_level.items():
            pool = self.manager.pools[level]
            slots = [PageId(group[i].slot) for i in idx]
            memory = _pool_memory(pool)
            if self.device:
                import torch

                index = torch.as_tensor(slots, device=rows.device)
                rows[torch.as_tensor(idx, device=rows.device)] = memory.index_select(0, index)
                # UCX reads device memory on its own streams: the gather must be done first.
                torch.cuda.current_stream(rows.device).synchronize()
            elif memory is not None and pool.kind is TierKind.HOST and len(idx) == len(rows):
                np.take(memory, np.asarray(slots, dtype=np.intp), axis=0, out=rows, mode="clip")
            else:
                rows[idx] = self.manager.copy.read(level, slots)


def _pool_memory(pool: Any) -> Any:
    """The [num_slots, page_bytes] memory of a host (numpy) or GPU (torch) pool; None for disk."""
    if pool is None:
        return None
    if pool.kind is TierKind.HOST:
        return pool.array
    if pool.kind is TierKind.GPU:
        return pool.tensor
    return None


def _staging(memory: Any, num_pages: int, page_bytes: int, device: bool) -> Any:
    if device:
        import torch

        return torch.empty((num_pages, page_bytes), dtype=torch.uint8, device=memory.device)
    return np.empty((num_pages, page_bytes), dtype=np.uint8)

"""The sender's view of a lease: the leased pages, in request order, as contiguous chunks.

Zero copy where possible: when every leased page sits on one host (or GPU) tier in consecutive
slots, the chunks are slices of the tier's own memory and go to UCX as they are (a GPU tier's
slices are device tensors, which ucxx sends with its CUDA transports; untested on this CPU-only
project machine). Otherwise the pages are *not one contiguous run*, so they are gathered into one
staging buffer (on the device when all of them are on the GPU tier, in host memory else), filled
chunk by chunk right before each chunk is sent, so gathering overlaps with the transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from raykv.records import LeasedBlock, page_checksum
from raykv.transfer.shm import consecutive
from raykv.types import PageId, TierKind

if TYPE_CHECKING:
    from raykv.manager import CacheManager


MIN_CHUNK_BYTES = 256 << 10


def chunk_counts(num_pages: int, page_bytes: int, chunk_bytes: int) -> list[int]:
    """Pages per chunk: whole pages, about a quarter of the payload per chunk (so checksums of
    one chunk overlap with the transfer of the next), at least 256 KiB (or one page), at most
    ``chunk_bytes``."""
    target = min(chunk_bytes, max(MIN_CHUNK_BYTES, num_pages * page_bytes // 4))
    per = max(1, target // page_bytes)
    return [min(per, num_pages - first) for first in range(0, num_pages, per)]


def settle_pages(manager: CacheManager, blocks: tuple[LeasedBlock, ...]) -> None:
    """Block until asynchronous copies into or out of the leased pages have completed.

    Anything that reads tier memory directly (the in-place send, the gather, a same-node peer
    copying from the shared tier) must call this first: with a GPU tier the copy engine moves
    pages asynchronously (``CopyEngine.settle`` for host slots; the GPU pool's slot events for
    device slots, waited for on the host because UCX reads device memory on its own streams).
    """
    if TierKind.GPU not in manager.tier_kinds:
        return  # host and disk copies are synchronous (raykv.copy): nothing can be in flight
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
    """Chunks of the pages of ``blocks`` (held by a lease: they do not move while this lives);
    ``whole``: one chunk when the payload fits in ``chunk_bytes``.

    ``corrupt`` is a test hook: each chunk is copied and one byte flipped in the copy (the tier is
    never touched); checksums still describe the true pages, so the receiver must notice.
    """

    def __init__(
        self,
        manager: CacheManager,
        blocks: tuple[LeasedBlock, ...],
        chunk_bytes: int,
        corrupt: bool = False,
        whole: bool = False,
    ) -> None:
        self.manager = manager
        self.blocks = blocks
        self.page_bytes = manager.layout.page_bytes
        n, page = len(blocks), self.page_bytes
        if whole and 0 < n * page <= chunk_bytes:  # one message (see PageServer._send_ucx)
            self.counts = [n]
        else:
            self.counts = chunk_counts(n, page, chunk_bytes)
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

"""Copy engine: batched page copies between tiers.

One call moves a batch of pages from one tier to another. Host sources are gathered in one numpy
copy; disk reads land directly in host rows when the destination slots are consecutive; every
other pair goes through a host staging array. On return, the destination bytes are complete (the
GPU path synchronizes its copies before returning), so callers may free the source slots.
Empty batches are no-ops.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from raykv.tiers.base import PagePool
from raykv.tiers.disk import DiskPool
from raykv.tiers.host import HostPool
from raykv.types import PageId, TierKind


def _consecutive(slots: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(slots))


class CopyEngine:
    """Moves pages between the pools of one manager; counts bytes per (source, destination)."""

    def __init__(self, pools: Sequence[PagePool]) -> None:
        self.pools = list(pools)
        self.page_bytes = pools[0].page_bytes
        self.bytes_moved: collections.Counter[tuple[TierKind, TierKind]] = collections.Counter()

    def read(self, level: int, slots: Sequence[PageId]) -> npt.NDArray[np.uint8]:
        """Return a new host array [len(slots), page_bytes] holding the pages' bytes."""
        out = np.empty((len(slots), self.page_bytes), dtype=np.uint8)
        if slots:
            self.pools[level].read_pages(list(slots), out)
        return out

    def write(self, level: int, slots: Sequence[PageId], data: npt.NDArray[np.uint8]) -> None:
        """Write host rows ``data`` into pages ``slots`` of one tier."""
        if slots:
            self.pools[level].write_pages(list(slots), data)

    def copy(
        self, src_level: int, src_slots: Sequence[PageId], dst_level: int, dst_slots: Sequence[PageId]
    ) -> None:
        """Copy pages ``src_slots`` of one tier into ``dst_slots`` of another (same count)."""
        if len(src_slots) != len(dst_slots):
            raise ValueError("source and destination batches differ in length")
        if not src_slots:
            return
        src, dst = self.pools[src_level], self.pools[dst_level]
        src_list, dst_list = list(src_slots), list(dst_slots)
        if isinstance(src, HostPool) and isinstance(dst, DiskPool):
            dst.write_rows(dst_list, [src.array[s] for s in src_list])
        elif isinstance(src, DiskPool) and isinstance(dst, HostPool):
            src.read_rows(src_list, [dst.array[d] for d in dst_list])
        elif isinstance(src, HostPool):
            dst.write_pages(dst_list, src.array[src_list])
        elif isinstance(dst, HostPool) and _consecutive(dst_list):
            first = dst_list[0]
            src.read_pages(src_list, dst.array[first : first + len(dst_list)])
        else:
            staged = self.read(src_level, src_list)
            dst.write_pages(dst_list, staged)
        self.bytes_moved[(src.kind, dst.kind)] += len(src_list) * self.page_bytes

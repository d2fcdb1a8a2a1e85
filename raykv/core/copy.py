"""Copy engine: batched page copies between tiers.

One call moves a batch of pages from one tier to another. Empty batches are no-ops. A copy or
read out of a verifying disk tier reports the pages that failed their checksum
(:meth:`raykv.core.tiers.disk.DiskPool.failed`); the caller must not serve them.

Host and disk only: host sources are gathered in one numpy copy; disk reads land directly in host
rows when the destination slots are consecutive; every other pair goes through a host staging
array. These copies are complete on return.

With a GPU tier (see :mod:`raykv.core.tiers.gpu` and :mod:`raykv.core.tiers.cuda_copy`): GPU <-> pinned host
and GPU <-> GPU copies are *asynchronous*: they are enqueued on the GPU pool's copy streams and
``copy`` returns at once. Each batch records one event, which becomes the pending event of every
slot involved: GPU slots in the pool's :class:`~raykv.core.tiers.cuda_util.SlotEvents`, host slots in
this engine's. The contract that keeps this safe:

* callers may release source slots as soon as ``copy`` returns (the manager does); a released
  GPU slot is waited for when it is handed out again (:meth:`GpuPool.allocate`), a host slot
  before this engine touches it again;
* every host-side use of a host slot through this engine (host <-> disk copies, ``read``,
  ``write``, later GPU copies) waits for its pending copy first; code that reads host pages
  directly (``HostPool.page``/``array``, e.g. a zero-copy sender) calls :meth:`CopyEngine.settle`
  for those slots first;
* a promotion (into the GPU) orders the caller's current stream after it.

GPU <-> disk goes through the copier's pinned staging buffer (the disk side is synchronous, the
last host -> GPU hop is not). GPU <-> unpinned host falls back to synchronous copies.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from raykv.core.errors import PageCorruptError
from raykv.core.tiers.base import PagePool, is_run
from raykv.core.tiers.cuda_util import SlotEvents, slot_array
from raykv.core.tiers.disk import DiskPool
from raykv.core.tiers.host import HostPool
from raykv.core.types import PageId, TierKind

if TYPE_CHECKING:
    from raykv.core.tiers.gpu import GpuPool


class CopyEngine:
    """Moves pages between the pools of one manager; counts bytes per (source, destination)."""

    def __init__(self, pools: Sequence[PagePool]) -> None:
        self.pools = list(pools)
        self.page_bytes = pools[0].page_bytes
        self.bytes_moved: collections.Counter[tuple[TierKind, TierKind]] = collections.Counter()
        self.host_events: dict[int, SlotEvents] = {
            level: SlotEvents() for level, p in enumerate(self.pools) if p.kind is TierKind.HOST
        }
        """Pending asynchronous copies into or out of host slots, per host level."""

    def read(self, level: int, slots: Sequence[PageId]) -> npt.NDArray[np.uint8]:
        """Return a new host array [len(slots), page_bytes] holding the pages' bytes.

        Raises PageCorruptError (``positions``: the bad pages) when a disk page fails its
        checksum: no bytes are returned then. :meth:`read_checked` returns the good ones."""
        out, bad = self.read_checked(level, slots)
        if bad:
            kind = self.pools[level].kind.name
            raise PageCorruptError(f"{len(bad)} {kind} page(s) failed their checksum", positions=tuple(bad))
        return out

    def read_checked(self, level: int, slots: Sequence[PageId]) -> tuple[npt.NDArray[np.uint8], list[int]]:
        """(a new host array [len(slots), page_bytes] of the pages' bytes, the positions of the
        pages that failed their checksum: their rows must not be served)."""
        out = np.empty((len(slots), self.page_bytes), dtype=np.uint8)
        if not slots:
            return out, []
        self.settle(level, slots)
        self.pools[level].read_pages(list(slots), out)
        return out, self.failed(level, slots)

    def failed(self, level: int, slots: Sequence[PageId]) -> list[int]:
        """Positions in ``slots`` of pages of tier ``level`` known to have failed a checksum
        (only a verifying disk tier has any)."""
        pool = self.pools[level]
        return pool.failed(slots) if isinstance(pool, DiskPool) else []

    def write(self, level: int, slots: Sequence[PageId], data: npt.NDArray[np.uint8]) -> None:
        """Write host rows ``data`` into pages ``slots`` of one tier."""
        if slots:
            self.settle(level, slots)
            self.pools[level].write_pages(list(slots), data)

    def settle(self, level: int, slots: Sequence[PageId] | None = None) -> None:
        """Block until pending asynchronous copies into or out of host ``slots`` (all when None)
        of tier ``level`` completed. A no-op for other tiers and without a GPU tier."""
        events = self.host_events.get(level)
        if events is None or not len(events):
            return
        if slots is None:
            events.wait_all()
        else:
            events.wait_host(slots)

    def synchronize(self) -> None:
        """Block until every asynchronous copy of this engine completed."""
        for pool in self.pools:
            if pool.kind is TierKind.GPU:
                pool.synchronize()  # type: ignore[attr-defined]
        for level in self.host_events:
            self.settle(level)

    def copy(
        self, src_level: int, src_slots: Sequence[PageId], dst_level: int, dst_slots: Sequence[PageId]
    ) -> list[int]:
        """Copy pages ``src_slots`` of one tier into ``dst_slots`` of another (same count).

        Returns the positions of the source pages that failed their checksum (a disk source
        only; empty otherwise): their destination pages hold bytes that must not be served."""
        if len(src_slots) != len(dst_slots):
            raise ValueError("source and destination batches differ in length")
        if not src_slots:
            return []
        src, dst = self.pools[src_level], self.pools[dst_level]
        src_list, dst_list = list(src_slots), list(dst_slots)
        if TierKind.GPU in (src.kind, dst.kind):
            self._copy_gpu(src_level, src_list, dst_level, dst_list)
        else:
            self.settle(src_level, src_list)
            self.settle(dst_level, dst_list)
            self._copy_host_disk(src, src_list, dst, dst_list)
        self.bytes_moved[(src.kind, dst.kind)] += len(src_list) * self.page_bytes
        return self.failed(src_level, src_list)

    def _copy_host_disk(
        self, src: PagePool, src_list: list[PageId], dst: PagePool, dst_list: list[PageId]
    ) -> None:
        if isinstance(src, HostPool) and isinstance(dst, DiskPool):
            dst.write_rows(dst_list, [src.array[s] for s in src_list])
        elif isinstance(src, DiskPool) and isinstance(dst, HostPool):
            src.read_rows(src_list, [dst.array[d] for d in dst_list])
        elif isinstance(src, HostPool):
            dst.write_pages(dst_list, src.array[src_list])
        elif isinstance(dst, HostPool) and is_run(dst_list):
            first = dst_list[0]
            src.read_pages(src_list, dst.array[first : first + len(dst_list)])
        else:
            staged = np.empty((len(src_list), self.page_bytes), dtype=np.uint8)
            src.read_pages(src_list, staged)
            dst.write_pages(dst_list, staged)

    # ---- GPU -------------------------------------------------------------------------------------
    def _endpoint(self, level: int) -> tuple[int | None, SlotEvents]:
        """(unified base address or None when not directly addressable, slot events) of a tier."""
        pool = self.pools[level]
        if pool.kind is TierKind.GPU:
            gpu: GpuPool = pool  # type: ignore[assignment]
            return gpu.base_address, gpu.events
        events = self.host_events.get(level, SlotEvents())
        if isinstance(pool, HostPool):
            copier = self._gpu(level).copier
            return copier.host_address(pool.array, pool.pinned), events
        return None, events

    def _gpu(self, other_level: int) -> GpuPool:
        """The GPU pool taking part in a copy with ``other_level`` (the first GPU tier)."""
        for pool in self.pools:
            if pool.kind is TierKind.GPU:
                return pool  # type: ignore[return-value]
        raise AssertionError(f"no GPU tier for a copy with level {other_level}")

    def _copy_gpu(
        self, src_level: int, src_list: list[PageId], dst_level: int, dst_list: list[PageId]
    ) -> None:
        src, dst = self.pools[src_level], self.pools[dst_level]
        gpu: GpuPool = src if src.kind is TierKind.GPU else dst  # type: ignore[assignment]
        src_base, src_events = self._endpoint(src_level)
        dst_base, dst_events = self._endpoint(dst_level)
        src_ids = slot_array(src_list)  # converted once: the bookkeeping is vectorized
        dst_ids = slot_array(dst_list)
        if src_base is not None and dst_base is not None:
            stream = "d2d" if src.kind is dst.kind else ("d2h" if src.kind is TierKind.GPU else "h2d")
            waits = src_events.pending(src_ids) + dst_events.pending(dst_ids)
            event = gpu.copier.copy(stream, src_base, src_ids, dst_base, dst_ids, self.page_bytes, waits)
            self._after(gpu, event, src_events, src_ids, dst_events, dst_ids, dst.kind is TierKind.GPU)
        elif isinstance(dst, DiskPool) and src_base is not None:
            waits = src_events.pending(src_ids)
            gpu.copier.to_disk(src_base, src_ids, self.page_bytes, waits, dst.write_rows, dst_list)  # type: ignore[arg-type]
        elif isinstance(src, DiskPool) and dst_base is not None:
            waits = dst_events.pending(dst_ids)
            event = gpu.copier.from_disk(src.read_rows, src_list, dst_base, dst_ids, self.page_bytes, waits)  # type: ignore[arg-type]
            self._after(gpu, event, SlotEvents(), src_ids[:0], dst_events, dst_ids, True)
        else:  # unpinned host memory: synchronous copies through the pools
            self.settle(src_level, src_list)
            self.settle(dst_level, dst_list)
            gpu.synchronize()
            self._copy_host_disk(src, src_list, dst, dst_list)

    def _after(
        self,
        gpu: GpuPool,
        event: Any,
        src_events: SlotEvents,
        src_ids: npt.NDArray[np.int64],
        dst_events: SlotEvents,
        dst_ids: npt.NDArray[np.int64],
        fence_current: bool,
    ) -> None:
        """Record ``event`` as the pending copy of every slot; order the current stream after a
        copy into the GPU (unless the pool is shared: its users wait on the host)."""
        if event is None:
            return
        src_events.set(src_ids, event)
        dst_events.set(dst_ids, event)
        if fence_current:
            gpu.fence_current(event)

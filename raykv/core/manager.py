"""CacheManager: tiers, block tree, eviction, copies, events and stats of one device.

Lifecycle of a request (see :class:`raykv.core.kvcache.KvCache`): ``create`` matches the longest cached
prefix and holds it; ``resume`` brings its pages to the top tier and pins them; ``extend``
allocates pages for new tokens; the engine writes KV into the pages; ``commit`` puts full blocks
into the tree; ``suspend`` unpins (pages may then be demoted); ``close`` releases everything.

Every public method holds the manager's lock, so a manager may be shared between threads. A
rejected call raises a typed error and leaves the manager unchanged.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.config import CacheConfig
from raykv.core.copy import CopyEngine
from raykv.core.errors import InvalidArgumentError, OutOfPagesError, ResourceBusyError, StateError
from raykv.core.events import CacheEvent, EventQueue
from raykv.core.eviction import EvictionPolicy, PriorityLRU
from raykv.core.export_import import export_blocks, import_blocks, import_pages
from raykv.core.keys import DEFAULT_SCOPE, MultimodalItem, ReuseScope, TokenSeq, block_keys
from raykv.core.kvcache import KvCache, Status
from raykv.core.page import Page, new_pages
from raykv.core.placement import RoomPlanner
from raykv.core.radix import Block, BlockRadixTree, Root
from raykv.core.records import (
    BlockLease,
    BlockRecords,
    CommittedBlockInfo,
    ExportedBlock,
    ImportResult,
    LeasedBlock,
    ProbeResult,
)
from raykv.core.stats import CacheStats, Counters, RequestStats, StatsDelta
from raykv.core.tiers import PagePool, make_pool, shm_directory
from raykv.core.types import (
    DEFAULT_PRIORITY,
    PageId,
    Priority,
    TierKind,
    TierLevel,
    check_block_key,
    check_block_keys,
    check_priority,
    check_u64,
)

log = logging.getLogger(__name__)


def _close_pools(pools: list[PagePool]) -> None:
    for pool in pools:
        pool.close()


class CacheManager:
    """The cache of one device. See the module docstring for the request lifecycle."""

    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError("config", "must be a CacheConfig")
        self.config = config
        self.layout = config.layout
        self.tokens_per_block = config.layout.tokens_per_block
        pin_host = any(t.kind is TierKind.GPU for t in config.tiers)
        pools: list[PagePool] = []
        try:
            for tier in config.tiers:
                pools.append(make_pool(tier, config.layout, pin_host=pin_host))
        except BaseException:
            _close_pools(pools)
            raise
        self.pools = pools
        self.tier_kinds = tuple(p.kind for p in pools)
        self.copy = CopyEngine(pools)
        self.tree = BlockRadixTree()
        self.policy: EvictionPolicy = policy or PriorityLRU(len(pools))
        self.events = EventQueue(config.max_events)
        self.counters = Counters(len(pools))
        self._lock = threading.RLock()
        self._locked = _Locked(self)
        self._open: dict[int, weakref.ref[KvCache]] = {}
        self._leases: dict[int, list[Page]] = {}
        self._lease_ids = itertools.count(1)
        self._graveyard: list[tuple[int, list[Page], bool, StatsDelta | None, int | None]] = []
        self._cache_ids = itertools.count(1)
        self._pinned_top = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_pools, pools)
        shm_directory.install(self)
        log.debug(
            "CacheManager up: tiers %s, page %d bytes",
            [(p.kind.name, p.num_slots) for p in pools],
            self.layout.page_bytes,
        )

    def locked(self) -> _Locked:
        """Hold the manager lock (``with mgr.locked():``, re-entrant); first release requests
        that were garbage-collected while open.

        (A KvCache finalizer only queues its pages here: it may run at any point, even inside
        another call on this thread, so it must not touch the tree or queues itself.)
        """
        return self._locked

    def _bury(self) -> None:
        """Release the requests the finalizers queued (under the lock)."""
        while self._graveyard:
            cache_id, pages, active, pending, request_id = self._graveyard.pop()
            self.release_cache_pages(pages, active)
            if pending is not None:
                self.counters.fold(pending, request_id)
            self._open.pop(cache_id, None)

    def defer_release(
        self,
        cache_id: int,
        pages: list[Page],
        active: bool,
        pending: StatsDelta | None,
        request_id: int | None,
    ) -> None:
        """Queue a dead request's pages (and unfolded stats) for release at the next locked call.

        Finalizer-safe: a list append is atomic and touches nothing else."""
        self._graveyard.append((cache_id, pages, active, pending, request_id))

    def release_cache_pages(self, pages: list[Page], active: bool) -> None:
        """Unpin (if ``active``) and drop one request's references to ``pages``."""
        if active:
            for page in pages:
                self.unpin(page)
        for page in pages:
            self.release_holder(page)

    # ---- properties ----------------------------------------------------------------------------
    @property
    def top_pool(self) -> PagePool:
        """The top tier's pool (the one engines read); its slot ids are page ids."""
        return self.pools[0]

    @property
    def num_open_requests(self) -> int:
        with self.locked():
            return len(self._open)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- requests ------------------------------------------------------------------------------
    def create(
        self,
        tokens: TokenSeq,
        scope: ReuseScope | None = None,
        priority: int = DEFAULT_PRIORITY,
        request_id: int | None = None,
        mm_items: Iterable[MultimodalItem] = (),
    ) -> KvCache:
        """Open a request: match the longest cached prefix of ``tokens`` and hold it.

        Returns a SUSPENDED KvCache whose ``num_reused_tokens`` (a multiple of tokens_per_block)
        says how much KV is already cached; the cache starts holding exactly those tokens. If the
        engine must recompute the last prompt token, drop it from ``tokens``. Raises ValueError
        for bad tokens, scope, priority, request id or multimodal items.
        """
        scope = DEFAULT_SCOPE if scope is None else scope
        if not isinstance(scope, ReuseScope):
            raise InvalidArgumentError("scope", f"must be a ReuseScope, got {type(scope).__name__}")
        prio = check_priority(priority)
        if request_id is not None:
            check_u64("request_id", request_id)
        with self.locked():
            self._check_open()
            cache = KvCache(self, scope, tokens, prio, request_id, tuple(mm_items))
            self._open[cache.cache_id] = weakref.ref(cache)
            return cache

    def probe(
        self,
        tokens: TokenSeq | None = None,
        scope: ReuseScope | None = None,
        keys: Sequence[bytes] | None = None,
        mm_items: Iterable[MultimodalItem] = (),
    ) -> ProbeResult:
        """How many leading blocks of ``tokens`` (in ``scope``) or of ``keys`` are cached, and on
        which tier each one sits. Changes nothing (no LRU touch, no stats). Give exactly one of
        ``tokens`` and ``keys``; raises ValueError otherwise or for bad tokens/keys."""
        if (tokens is None) == (keys is None):
            raise InvalidArgumentError("tokens", "give exactly one of tokens and keys")
        if keys is not None:
            if all(type(k) is bytes and len(k) == 32 for k in keys):
                checked = list(keys)
            else:
                checked = [check_block_key(k) for k in keys]
            with self.locked():
                blocks = self.tree.match_keys(checked)  # type: ignore[arg-type]
                return self._probe_result(blocks)
        scope = DEFAULT_SCOPE if scope is None else scope
        assert tokens is not None
        chain = block_keys(tokens, self.tokens_per_block, scope, mm_items)
        with self.locked():
            return self._probe_result(self.tree.match(scope.root_key(), chain))

    def _probe_result(self, blocks: list[Block]) -> ProbeResult:
        tiers = tuple(self.tier_kinds[b.page.level] for b in blocks)
        return ProbeResult(len(blocks), len(blocks) * self.tokens_per_block, tiers)

    # ---- block exchange ------------------------------------------------------------------------
    def export_blocks(self, keys: Sequence[bytes]) -> list[ExportedBlock]:
        """Bytes and metadata of the committed blocks among ``keys`` (missing keys are skipped;
        order follows ``keys``). Pages stay where they are. Raises ValueError for a malformed key.
        """
        checked = [check_block_key(k) for k in keys]
        with self.locked():
            self._check_open()
            return export_blocks(self, checked)

    def import_blocks(
        self, blocks: Sequence[ExportedBlock], priority: int = DEFAULT_PRIORITY
    ) -> ImportResult:
        """Add blocks received from a peer as committed, matchable blocks on the top tier.

        Each block's parent must be in the tree, earlier in ``blocks``, or a scope root
        (``parent_is_root``). Blocks already present are skipped. The batch is rejected whole,
        with nothing changed, on a checksum mismatch (IntegrityError), a missing parent or a
        malformed record (ImportRejectedError), or no room (OutOfPagesError). Returns an
        ImportResult.
        """
        prio = check_priority(priority)
        with self.locked():
            self._check_open()
            return import_blocks(self, list(blocks), prio)

    def import_pages(
        self,
        records: BlockRecords,
        data: npt.NDArray[np.uint8],
        checksums: Sequence[int] | None = None,
        verify: bool = True,
        priority: int = DEFAULT_PRIORITY,
        confirm: Callable[[], object] | None = None,
    ) -> ImportResult:
        """:meth:`import_blocks` with the pages as rows: ``data[i]`` (uint8, shape
        ``[len(records), page_bytes]``) is block ``i``'s page. New blocks' rows reach the top tier
        in one batched copy; ``verify`` first compares each row's CRC-32 with ``checksums[i]``.
        Same all-or-nothing rules (:mod:`raykv.core.export_import`); ImportRejectedError (``index``
        None) for mismatched shapes. ``confirm`` runs after the rows are written, before any block
        is inserted, without the manager's lock (staged pages and cached parents leased): if it
        raises, the pages are given back and the error propagates (evictions made stay made).
        """
        prio = check_priority(priority)
        return import_pages(self, records, data, checksums, verify, prio, confirm)

    def cool_blocks(self, keys: Sequence[bytes]) -> int:
        """Make the committed blocks among ``keys`` the first to be demoted or evicted within their
        priority (e.g. a source whose copy a peer just pulled: one copy is enough). Missing or
        pinned blocks are skipped; nothing else changes. Returns how many were cooled.
        ValueError for a malformed key."""
        checked = check_block_keys(keys)
        with self.locked():
            self._check_open()
            found = [b for b in (self.tree.get(k) for k in checked) if b is not None]
            for block in found:  # each goes before the previous one: the deepest block is first
                self.policy.cool(block.page)
            return sum(1 for b in found if b.page.queued)

    def lease_blocks(self, keys: Sequence[bytes]) -> BlockLease:
        """Hold the committed blocks among ``keys`` in place for a zero-copy sender.

        Leased pages are neither moved nor dropped until :meth:`release_lease`; their bytes can be
        read with :meth:`leased_page` meanwhile. Missing keys are skipped. ValueError for a
        malformed key; ``clear_reusable``/``shutdown`` refuse while leases are open.
        """
        checked = check_block_keys(keys)
        with self.locked():
            self._check_open()
            found = [b for b in (self.tree.get(k) for k in checked) if b is not None]
            lease_id = self.hold_pages([b.page for b in found])
            blocks = tuple(
                LeasedBlock(
                    b.key,
                    b.parent_key,
                    isinstance(b.parent, Root),
                    b.num_tokens,
                    self.tier_kinds[b.page.level],
                    b.page.level,
                    int(b.page.slot),
                    b.checksum,
                )
                for b in found
            )
            return BlockLease(lease_id, blocks)

    def remember_checksums(self, blocks: Sequence[LeasedBlock], sums: Sequence[int]) -> None:
        """Keep the page checksums a sender computed for leased ``blocks`` (same order), so later
        leases carry them (``LeasedBlock.checksum``) and no sender reads those pages to checksum
        them again. Call while the lease is held: its pages are then still the blocks' own. A
        block that already has one keeps it; blocks no longer in the tree are skipped."""
        with self.locked():
            for leased, crc in zip(blocks, sums):
                block = self.tree.get(leased.key)
                if block is not None and block.checksum is None:
                    block.checksum = int(crc)

    def leased_page(self, block: LeasedBlock) -> Any:
        """The page of a leased block, in place: a numpy (host) or torch (GPU) uint8 view; a
        disk page is read into a new array. Valid until the lease is released."""
        pool = self.pools[block.level]
        if hasattr(pool, "page"):
            self.copy.settle(block.level, [PageId(block.slot)])  # a copy into it may be in flight
            return pool.page(PageId(block.slot))
        return self.copy.read(block.level, [PageId(block.slot)])[0]

    def hold_pages(self, pages: list[Page]) -> int:
        """Lease ``pages`` (the list is kept as given): they neither move nor go until
        :meth:`release_lease` of the returned id; ``clear_reusable``/``shutdown`` refuse
        meanwhile. Imports hold the pages they stage this way."""
        with self.locked():
            for page in pages:
                page.leases += 1
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = pages
            return lease_id

    def release_lease(self, lease_id: int) -> None:
        """Release a lease (idempotent); its pages become movable again."""
        with self.locked():
            for page in self._leases.pop(lease_id, []):
                page.leases -= 1

    def committed_blocks(self) -> list[CommittedBlockInfo]:
        """Snapshot of every committed block (parents before children) with its tier."""
        with self.locked():
            blocks = sorted(self.tree.iter_blocks(), key=lambda b: b.ordinal)
            return [
                CommittedBlockInfo(b.key, b.parent_key, self.tier_kinds[b.page.level], b.num_tokens)
                for b in blocks
            ]

    # ---- observation ---------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """A frozen snapshot of the counters and gauges (valid forever; it is a copy)."""
        with self.locked():
            return CacheStats(
                **self.counters.counters(),  # type: ignore[arg-type]
                tiers=self.tier_kinds,
                bytes_in_use=tuple(p.num_used * p.page_bytes for p in self.pools),
                capacity_bytes=tuple(p.capacity_bytes for p in self.pools),
                pinned_pages=self._pinned_top,
                open_requests=len(self._open),
            )

    def request_stats(self) -> list[RequestStats]:
        """Per-request lookup stats of the most recently finished requests (oldest first)."""
        with self.locked():
            return list(self.counters.recent)

    def drain_events(self, max_events: int | None = None) -> list[CacheEvent]:
        """Remove and return the oldest queued events (all when ``max_events`` is None)."""
        return self.events.drain(max_events)

    def top_utilization(self) -> float:
        """Fraction of top-tier pages pinned by active requests."""
        return self._pinned_top / self.top_pool.num_slots

    # ---- global operations ---------------------------------------------------------------------
    def clear_reusable(self) -> int:
        """Drop every committed block; returns how many. Emits AllCleared.

        Raises ResourceBusyError (changing nothing) while requests are open.
        """
        with self.locked():
            self._check_open()
            self._refuse_if_open("clear_reusable()")
            return self._clear()

    def _clear(self) -> int:
        blocks = sorted(self.tree.iter_blocks(), key=lambda b: -b.ordinal)
        for block in blocks:
            page = block.page
            self.tree.remove(block)
            self._free_page(page)
        self.events.cleared()
        return len(blocks)

    def shutdown(self) -> None:
        """Clear the tree and release every tier (the disk tier's temp files go). Idempotent.

        Raises ResourceBusyError (changing nothing) while requests are open.
        """
        with self.locked():
            if self._closed:
                return
            self._refuse_if_open("shutdown()")
            self._clear()
            self._closed = True
            self._finalizer()

    def _refuse_if_open(self, api: str) -> None:
        if self._leases:
            n = len(self._leases)
            raise ResourceBusyError(f"{api} with {n} block lease(s) still open", num_open=n)
        if self._open:
            n = len(self._open)
            raise ResourceBusyError(f"{api} with {n} request(s) still open", num_open=n)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the CacheManager has been shut down")

    # ---- page machinery (used by KvCache and the block exchange) ------------------------------
    def plan_room(self, level: int, count: int, exclude: set[int]) -> RoomPlanner | None:
        """A plan that frees ``count`` slots on ``level`` without touching ``exclude`` pages,
        or None when impossible. Nothing changes until :meth:`execute` runs the plan."""
        planner = RoomPlanner([p.num_free for p in self.pools], self.policy, exclude)
        return planner if planner.make_room(level, count) else None

    def execute(self, planner: RoomPlanner) -> None:
        """Carry out a plan from :meth:`plan_room`: drops first, then moves, coldest first."""
        drops, moves = planner.ordered_steps()
        for step in drops:
            page = step.page
            assert page.block is not None
            self.events.removed(page.block.key, self.tier_kinds[page.level])
            self.counters.evictions[page.level] += 1
            self.tree.remove(page.block)
            self._free_page(page)
        moves.sort(key=lambda s: (-s.src, s.dst))
        for (_src, dst), group in itertools.groupby(moves, key=lambda s: (s.src, s.dst)):
            assert dst is not None
            self.move_pages([s.page for s in group], dst)

    def allocate_pages(self, count: int, priority: Priority, exclude: set[int]) -> list[Page]:
        """``count`` new pages on the top tier (unqueued, no holder yet), evicting as needed.

        Raises OutOfPagesError, with nothing changed, when the room cannot be made.
        """
        if count == 0:
            return []
        planner = self.plan_room(0, count, exclude)
        if planner is None:
            raise OutOfPagesError(
                f"top tier ({self.tier_kinds[0].name}) cannot free {count} page(s): "
                f"{self._pinned_top} of {self.top_pool.num_slots} pinned, the rest not evictable",
                tier=self.tier_kinds[0].name,
                needed=count,
            )
        self.execute(planner)
        slots = self.pools[0].allocate(count)
        return new_pages(TierLevel(0), slots, priority)

    def move_pages(self, pages: list[Page], dst: int) -> None:
        """Copy unpinned pages (all on one level) to level ``dst`` and re-point them."""
        if not pages:
            return
        src = pages[0].level
        dst_slots = self.pools[dst].allocate(len(pages))
        src_slots: list[PageId] = [p.slot for p in pages]
        try:
            self.copy.copy(src, src_slots, dst, dst_slots)
        except BaseException:
            self.pools[dst].release(dst_slots)
            raise
        self.pools[src].release(src_slots)
        counter = self.counters.demotions if dst > src else self.counters.promotions
        for page, slot in zip(pages, dst_slots):
            queued = page.queued
            if queued:
                self.policy.remove(page)
            page.level, page.slot = TierLevel(dst), slot
            if queued:
                self.policy.add(page)
            counter[src] += 1
            if page.block is not None:
                self.events.tier_changed(page.block.key, self.tier_kinds[src], self.tier_kinds[dst])

    def pin(self, page: Page) -> None:
        """An active request starts using ``page`` (which must be on the top tier)."""
        if page.level != 0:
            raise StateError(f"cannot pin {page!r}: not on the top tier")
        if page.pins == 0:
            if page.queued:
                self.policy.remove(page)
            self._pinned_top += 1
        page.pins += 1

    def unpin(self, page: Page) -> None:
        """An active request stops using ``page``; an unpinned page becomes evictable."""
        page.pins -= 1
        if page.pins == 0:
            self._pinned_top -= 1
            self.policy.add(page)

    def release_holder(self, page: Page) -> None:
        """A request drops its reference; an unreferenced private page is freed."""
        page.holders -= 1
        if page.holders == 0 and page.block is None and page.pins == 0:
            self._free_page(page)

    def _free_page(self, page: Page) -> None:
        if page.queued:
            self.policy.remove(page)
        self.pools[page.level].release([page.slot])

    def forget_cache(self, cache_id: int) -> None:
        self._open.pop(cache_id, None)

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Verify tree, pools, pins, holders, queues and counters; AssertionError on a violation."""
        from raykv.core.invariants import check_manager

        with self.locked():
            check_manager(self)

    def open_caches(self) -> list[KvCache]:
        return [c for c in (r() for r in self._open.values()) if c is not None]

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{p.kind.name}:{p.num_used}/{p.num_slots}" for p in self.pools)
        return f"CacheManager({tiers}, blocks={len(self.tree)}, open={len(self._open)})"


__all__ = ["CacheManager", "KvCache", "Status"]


class _Locked:
    """What :meth:`CacheManager.locked` returns (one per manager; all state is in the lock): a
    class, not a generator context manager, since every manager call enters it."""

    __slots__ = ("_mgr",)

    def __init__(self, mgr: CacheManager) -> None:
        self._mgr = mgr

    def __enter__(self) -> None:
        mgr = self._mgr
        mgr._lock.acquire()
        if mgr._graveyard:
            try:
                mgr._bury()
            except BaseException:
                mgr._lock.release()
                raise

    def __exit__(self, *exc: object) -> None:
        self._mgr._lock.release()

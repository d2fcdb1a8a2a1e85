"""PageStore: the page bookkeeping of one device, the one object every part of the cache works on.

It owns the tier pools and the copies between them, the block tree, the eviction policy (and
plans room with :class:`~raykv.core.placement.RoomPlanner`), the events and counters, the pins,
holders' releases and leases of pages, the count of pinned top-tier pages, the registry of open
requests and the manager's lock. :class:`~raykv.core.manager.CacheManager` is the facade users
call; :class:`~raykv.core.kvcache.KvCache`, :mod:`~raykv.core.export_import`,
:mod:`~raykv.core.pipelined_import` and :mod:`~raykv.core.invariants` use this interface.

Rules of the interface: every method that changes state must be called under :meth:`locked`
(unless its docstring says otherwise); a method that raises changes nothing. The attributes are
read-only to everyone else: ``pinned_top``, ``leases`` and ``closed`` change only through methods.
:meth:`cache_blocks` is the one place blocks become cached (tree insert, eviction queueing,
``BlockStored`` events, counters); :meth:`drop_corrupt` is where pages that failed their
checksum (a disk tier file changed under the cache) leave it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, cast

from raykv.core.config import CacheConfig
from raykv.core.copy import CopyEngine
from raykv.core.errors import OutOfPagesError, ResourceBusyError, StateError
from raykv.core.events import EventQueue
from raykv.core.eviction import EvictionPolicy, PriorityLRU
from raykv.core.page import Page, new_pages
from raykv.core.placement import RoomPlanner
from raykv.core.quota import Group, SaltQuota, group_batch
from raykv.core.radix import Block, BlockRadixTree
from raykv.core.stats import Counters, StatsDelta
from raykv.core.tiers import PagePool, make_pool, shm_directory
from raykv.core.types import BlockKey, PageId, Priority, TierKind, TierLevel
from raykv.core.warn_every import WarnEvery

log = logging.getLogger(__name__)
WARN_INTERVAL_S = 10.0
"""At most one integrity warning per this many seconds per store (the rest are counted)."""


def _close_pools(pools: list[PagePool]) -> None:
    for pool in pools:
        pool.close()


class StoreOwner(Protocol):
    """Anything that exposes its PageStore (a CacheManager does): what the export/import entry
    points take, so callers may pass the manager itself."""

    @property
    def store(self) -> PageStore: ...


class PageStore:
    """Pools, tree, eviction, pins, leases and the lock of one device (see the module docstring).

    Attributes (read-only outside this class): ``config``, ``layout``, ``tokens_per_block``,
    ``pools`` (index = tier level), ``tier_kinds``, ``copy``, ``tree``, ``policy``, ``events``,
    ``counters``; ``pinned_top``: top-tier pages pinned by active requests; ``leases``: lease id ->
    the pages it holds; ``corrupt``: uids of pages whose bytes failed their checksum and that a
    request still holds (each request cuts itself before them at its next resume or commit).
    """

    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.tokens_per_block = config.layout.tokens_per_block
        pin_host = any(t.kind is TierKind.GPU for t in config.tiers)
        pools: list[PagePool] = []
        try:
            for tier in config.tiers:
                pools.append(make_pool(tier, config.layout, pin_host, config.verify_disk_checksums))
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
        limit = config.max_blocks_per_salt
        self.quota: SaltQuota | None = SaltQuota(limit) if limit is not None else None
        self.pinned_top = 0
        self.leases: dict[int, list[Page]] = {}
        self.corrupt: set[int] = set()
        self._orphans: dict[int, Page] = {}  # dropped from the tree while leased: freed at release
        self._warnings = WarnEvery(WARN_INTERVAL_S)
        self._unwarned = 0
        self._lock = threading.RLock()
        self._locked = StoreLock(self)
        self._open: dict[int, weakref.ref[Any]] = {}
        self._lease_ids = itertools.count(1)
        self._graveyard: list[tuple[int, list[Page], bool, StatsDelta | None, int | None]] = []
        self._cache_ids = itertools.count(1)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_pools, pools)
        shm_directory.install(pools, self.tree, self.events, self.copy.host_events)

    @property
    def store(self) -> PageStore:
        """This store (so a PageStore is a :class:`StoreOwner` too)."""
        return self

    @property
    def top_pool(self) -> PagePool:
        """The top tier's pool (the one engines read); its slot ids are page ids."""
        return self.pools[0]

    # ---- lock, lifetime ------------------------------------------------------------------------
    def locked(self) -> StoreLock:
        """Hold the lock (``with store.locked():``, re-entrant); first release requests that were
        garbage-collected while open (queued by :meth:`defer_release`)."""
        return self._locked

    def _bury(self) -> None:
        """Release the requests the finalizers queued (under the lock)."""
        while self._graveyard:
            cache_id, pages, active, pending, request_id = self._graveyard.pop()
            self.release_cache_pages(pages, active)
            if pending is not None:
                self.counters.fold(pending, request_id)
            self._open.pop(cache_id, None)

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """StateError once :meth:`close` ran."""
        if self._closed:
            raise StateError("the CacheManager has been shut down")

    def refuse_if_busy(self, api: str) -> None:
        """ResourceBusyError (naming ``api``) while leases or requests are open."""
        if self.leases:
            n = len(self.leases)
            raise ResourceBusyError(f"{api} with {n} block lease(s) still open", num_open=n)
        if self._open:
            n = len(self._open)
            raise ResourceBusyError(f"{api} with {n} request(s) still open", num_open=n)

    def clear(self) -> int:
        """Drop every committed block (deepest first), emit AllCleared; returns how many."""
        blocks = sorted(self.tree.iter_blocks(), key=lambda b: -b.ordinal)
        for block in blocks:
            page = block.page
            self.tree.remove(block)
            self.free_page(page)
        if self.quota is not None:
            self.quota.clear()
        self.events.cleared()
        return len(blocks)

    def close(self) -> None:
        """Clear the tree and release every tier (idempotent; the caller checks busy first)."""
        if self._closed:
            return
        self.clear()
        self._closed = True
        self._finalizer()

    # ---- open requests -------------------------------------------------------------------------
    def next_cache_id(self) -> int:
        """A new request id of this store (1, 2, ...)."""
        return next(self._cache_ids)

    def track(self, cache_id: int, cache: object) -> None:
        """Register an open request (weakly: a collected one is released through the graveyard)."""
        self._open[cache_id] = weakref.ref(cache)

    def forget_cache(self, cache_id: int) -> None:
        """Unregister a closed request (no-op when unknown)."""
        self._open.pop(cache_id, None)

    @property
    def num_open(self) -> int:
        """How many requests are open."""
        return len(self._open)

    def open_requests(self) -> list[Any]:
        """The open requests still alive (the KvCache objects), in registration order."""
        return [c for c in (r() for r in self._open.values()) if c is not None]

    def defer_release(
        self,
        cache_id: int,
        pages: list[Page],
        active: bool,
        pending: StatsDelta | None,
        request_id: int | None,
    ) -> None:
        """Queue a dead request's pages (and unfolded stats) for release at the next locked call.

        Finalizer-safe (no lock needed): a list append is atomic and touches nothing else."""
        self._graveyard.append((cache_id, pages, active, pending, request_id))

    def release_cache_pages(self, pages: list[Page], active: bool) -> None:
        """Unpin (if ``active``) and drop one request's references to ``pages``."""
        if active:
            for page in pages:
                self.unpin(page)
        for page in pages:
            self.release_holder(page)

    # ---- room and pages ------------------------------------------------------------------------
    def plan_room(self, level: int, count: int, exclude: set[int]) -> RoomPlanner | None:
        """A plan that frees ``count`` slots on ``level`` without touching ``exclude`` pages
        (uids), or None when impossible. Nothing changes until :meth:`execute` runs the plan.

        The first plan demotes before it drops (data stays cached); when it cannot free enough,
        a second one drops every droppable candidate first, so the slots below go to pages that
        can only move (demoting a droppable block there could leave such a page no room)."""
        for prefer_drop in (False, True):
            planner = RoomPlanner([p.num_free for p in self.pools], self.policy, exclude, prefer_drop)
            if planner.make_room(level, count):
                return planner
        return None

    def execute(self, planner: RoomPlanner) -> None:
        """Carry out a plan from :meth:`plan_room`: drops first, then moves, coldest first."""
        drops, moves = planner.ordered_steps()
        for step in drops:
            self.drop_block(step.page)
        moves.sort(key=lambda s: (-s.src, s.dst))
        for (_src, dst), group in itertools.groupby(moves, key=lambda s: (s.src, s.dst)):
            assert dst is not None
            self.move_pages([s.page for s in group], dst)

    def drop_block(self, page: Page) -> None:
        """Evict the droppable leaf block ``page`` backs: BlockRemoved, one eviction counted on
        its tier, out of the tree and its quota group, page freed."""
        block = cast(Block, page.block)
        assert block is not None
        self.events.removed(block.key, self.tier_kinds[page.level])
        self.counters.evictions[page.level] += 1
        self.tree.remove(block)
        if self.quota is not None:
            self.quota.forget(page)
        self.free_page(page)

    def allocate_pages(self, count: int, priority: Priority, exclude: set[int]) -> list[Page]:
        """``count`` new pages on the top tier (unqueued, no holder yet), evicting as needed but
        never the ``exclude`` pages (uids). OutOfPagesError, with nothing changed, when the room
        cannot be made."""
        if count == 0:
            return []
        planner = self.plan_room(0, count, exclude)
        if planner is None:
            raise OutOfPagesError(
                f"top tier ({self.tier_kinds[0].name}) cannot free {count} page(s): "
                f"{self.pinned_top} of {self.top_pool.num_slots} pinned, the rest not evictable",
                tier=self.tier_kinds[0].name,
                needed=count,
            )
        self.execute(planner)
        slots = self.pools[0].allocate(count)
        return new_pages(TierLevel(0), slots, priority)

    def move_pages(self, pages: list[Page], dst: int) -> list[Page]:
        """Copy unpinned pages (all on one level) to level ``dst`` and re-point them. Returns the
        pages whose bytes failed their checksum on the way (read from a disk tier), already
        given to :meth:`drop_corrupt`."""
        if not pages:
            return []
        src = pages[0].level
        dst_slots = self.pools[dst].allocate(len(pages))
        src_slots: list[PageId] = [p.slot for p in pages]
        try:
            bad = self.copy.copy(src, src_slots, dst, dst_slots)
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
        corrupt = [pages[i] for i in bad]
        if corrupt:
            self.drop_corrupt(corrupt, self.tier_kinds[src])
        return corrupt

    def pin(self, page: Page) -> None:
        """An active request starts using ``page`` (which must be on the top tier)."""
        if page.level != 0:
            raise StateError(f"cannot pin {page!r}: not on the top tier")
        if page.pins == 0:
            if page.queued:
                self.policy.remove(page)
            self.pinned_top += 1
        page.pins += 1

    def unpin(self, page: Page) -> None:
        """An active request stops using ``page``; an unpinned page becomes evictable."""
        page.pins -= 1
        if page.pins == 0:
            self.pinned_top -= 1
            self.policy.add(page)

    def release_holder(self, page: Page) -> None:
        """A request drops its reference; an unreferenced private page is freed."""
        page.holders -= 1
        if page.holders == 0 and page.block is None and page.pins == 0:
            self.free_page(page)

    def free_page(self, page: Page) -> None:
        """Unqueue ``page`` and give its slot back (it must back no block any more)."""
        if page.queued:
            self.policy.remove(page)
        if self.corrupt:
            self.corrupt.discard(page.uid)
        self.pools[page.level].release([page.slot])

    # ---- integrity -----------------------------------------------------------------------------
    def drop_corrupt(self, pages: Sequence[Page], tier: TierKind) -> None:
        """Pages whose bytes failed their checksum when read from ``tier``: never serve them.

        Each new one counts one ``integrity_drops``; the block it backs leaves the tree with its
        descendants (one BlockRemoved each: a miss from now on, as for an eviction). Pages no one
        references any more are freed; a leased one when its lease ends; one a request holds
        stays in :attr:`corrupt` until that request cuts it (``KvCache.resume``/``commit``).
        Logs a WARNING at most every :data:`WARN_INTERVAL_S`. Under the lock."""
        for page in pages:
            if page.uid not in self.corrupt:
                self.counters.integrity_drops += 1
                self._warn(page, tier)
            if page.block is not None:
                self._drop_subtree(cast(Block, page.block))
            if page.holders or page.pins:
                self.corrupt.add(page.uid)

    def _drop_subtree(self, top: Block) -> None:
        """Remove ``top`` and every block below it from the tree, deepest first."""
        stack, blocks = [top], []
        while stack:
            block = stack.pop()
            blocks.append(block)
            stack.extend(block.children.values())
        blocks.sort(key=lambda b: -b.ordinal)
        for block in blocks:
            page = block.page
            self.events.removed(block.key, self.tier_kinds[page.level])
            self.tree.remove(block)
            if self.quota is not None:
                self.quota.forget(page)
            if page.holders or page.pins:
                continue  # now a private page of the requests holding it
            if page.leases:
                if page.queued:
                    self.policy.remove(page)
                self._orphans[page.uid] = page
            else:
                self.free_page(page)

    def _warn(self, page: Page, tier: TierKind) -> None:
        if not self._warnings.due():
            self._unwarned += 1
            return
        block = page.block
        log.warning(
            "%s page of block %s failed its checksum: dropped, not served (%d more since the "
            "last warning, %d in all); the tier's file changed under the cache",
            tier.name,
            block.key.hex()[:16] if block is not None else "(private)",
            self._unwarned,
            self.counters.integrity_drops,
        )
        self._unwarned = 0

    # ---- leases --------------------------------------------------------------------------------
    def hold_pages(self, pages: list[Page]) -> int:
        """Lease ``pages`` (the list is kept as given): they neither move nor go until
        :meth:`release_lease` of the returned id; ``clear_reusable``/``shutdown`` refuse
        meanwhile. Takes the lock itself."""
        with self.locked():
            for page in pages:
                page.leases += 1
            lease_id = next(self._lease_ids)
            self.leases[lease_id] = pages
            return lease_id

    def release_lease(self, lease_id: int) -> None:
        """Release a lease (idempotent); its pages become movable again. Takes the lock itself."""
        with self.locked():
            for page in self.leases.pop(lease_id, []):
                page.leases -= 1
                if not page.leases and self._orphans and self._orphans.pop(page.uid, None) is not None:
                    self.free_page(page)

    def note_scope(self, root_key: BlockKey, salt: int | None) -> None:
        """A request opened the scope of ``root_key`` (salt ``salt``): blocks cached under that
        root count in the salt's quota group (no-op without a quota). Under the lock."""
        if self.quota is not None:
            self.quota.note_scope(root_key, salt)

    # ---- caching blocks ------------------------------------------------------------------------
    def cache_blocks(
        self,
        keys: Sequence[BlockKey],
        parent_keys: Sequence[BlockKey],
        parent_is_root: Sequence[bool],
        pages: Sequence[Page],
        num_tokens: Sequence[int],
        request_id: int | None = None,
        imported: bool = False,
        chain: bool = False,
    ) -> list[int]:
        """Make blocks cached, parents first: put each in the tree under its parent (a scope root
        is made when ``parent_is_root``), backed by its page; queue for eviction the pages that
        are neither pinned nor queued already; emit one BlockStored each (``request_id``, the
        tier of its page); with ``imported`` count them as imported blocks (a commit counts its
        request's blocks itself). The one place blocks become cached. Under the lock.

        Each parent must be cached, a scope root, or earlier in the batch. A key already cached
        is skipped (its page is left alone, the caller's to give back); returns the positions
        skipped. With ``chain`` the batch must be a chain (each block the parent of the next)
        with no key cached and no request id: it is inserted, queued and reported as one chain,
        with no Python step per block (returns ``[]``).

        Under ``max_blocks_per_salt`` a salt over its quota first drops its own least valuable
        blocks; blocks that still do not fit (its last in the batch, a chain's tail) are not
        cached and are returned with the skipped positions, as for a cached key (counted in
        ``quota_refused``; see :mod:`raykv.core.quota`).
        """
        if self.quota is not None:
            return self._cache_with_quota(
                keys, parent_keys, parent_is_root, pages, num_tokens, request_id, imported, chain
            )
        if chain:
            return self._cache_chain(keys, parent_keys, parent_is_root, pages, num_tokens, imported)
        return self._cache_each(keys, parent_keys, parent_is_root, pages, num_tokens, request_id, imported)

    def _cache_each(
        self,
        keys: Sequence[BlockKey],
        parent_keys: Sequence[BlockKey],
        parent_is_root: Sequence[bool],
        pages: Sequence[Page],
        num_tokens: Sequence[int],
        request_id: int | None,
        imported: bool,
    ) -> list[int]:
        """:meth:`cache_blocks` of any batch, one block at a time."""
        tree, blocks, add, kinds = self.tree, self.tree.blocks, self.policy.add, self.tier_kinds
        stored: list[tuple[BlockKey, BlockKey, TierKind, int, int | None]] = []
        skipped: list[int] = []
        for i, (key, parent_key, root, page, tokens) in enumerate(
            zip(keys, parent_keys, parent_is_root, pages, num_tokens)
        ):
            if key in blocks:
                skipped.append(i)
                continue
            parent = tree.parent_node(parent_key, create_root=root)
            assert parent is not None, "a parent block is not cached"
            tree.insert(parent, key, page, tokens)
            if not (page.pins or page.queued):
                add(page)
            stored.append((key, parent_key, kinds[page.level], tokens, request_id))
        self.events.stored_many(stored)
        if imported:
            self.counters.imported_blocks += len(stored)
        return skipped

    def _cache_with_quota(
        self,
        keys: Sequence[BlockKey],
        parent_keys: Sequence[BlockKey],
        parent_is_root: Sequence[bool],
        pages: Sequence[Page],
        num_tokens: Sequence[int],
        request_id: int | None,
        imported: bool,
        chain: bool,
    ) -> list[int]:
        """:meth:`cache_blocks` under ``max_blocks_per_salt`` (:mod:`raykv.core.quota`): make room
        in each group from its own blocks, cache what fits, count the rest as skipped."""
        quota = cast(SaltQuota, self.quota)
        refused, group_at = self._admit(keys, parent_keys, parent_is_root)
        admitted = [i for i in range(len(keys)) if i not in refused]
        skipped: list[int] = []
        if chain:  # one group: ``refused`` is the chain's tail
            n = len(admitted)
            if n == len(keys):
                self._cache_chain(keys, parent_keys, parent_is_root, pages, num_tokens, imported)
            elif n:
                self._cache_chain(
                    list(keys[:n]),
                    list(parent_keys[:n]),
                    list(parent_is_root[:n]),
                    list(pages[:n]),
                    list(num_tokens[:n]),
                    imported,
                )
        elif admitted:
            done = self._cache_each(
                [keys[i] for i in admitted],
                [parent_keys[i] for i in admitted],
                [parent_is_root[i] for i in admitted],
                [pages[i] for i in admitted],
                [num_tokens[i] for i in admitted],
                request_id,
                imported,
            )
            skipped = [admitted[j] for j in done]
        raced = set(skipped)
        for i in admitted:
            if i not in raced:
                quota.add(pages[i], group_at[i])
        return sorted([*skipped, *refused])

    def _admit(
        self, keys: Sequence[BlockKey], parent_keys: Sequence[BlockKey], parent_is_root: Sequence[bool]
    ) -> tuple[set[int], dict[int, Group]]:
        """Before caching a batch under the quota: each group it would take over the limit drops
        its own least valuable blocks (never the batch's cached parents or keys). Returns the
        positions that still do not fit (each group's last) and the group of every other new one."""
        quota = cast(SaltQuota, self.quota)
        blocks = self.tree.blocks
        by_group = group_batch(quota, blocks, keys, parent_keys)
        keep = {b.page.uid for k in (*parent_keys, *keys) if (b := blocks.get(k)) is not None}
        refused: set[int] = set()
        group_at: dict[int, Group] = {}
        for group, positions in by_group.items():
            need = quota.count(group) + len(positions) - quota.limit
            drops = quota.plan_drops(group, need, self.policy, len(self.pools), keep)
            for page in drops:
                self.drop_block(page)
            self.counters.quota_evictions += len(drops)
            fit = len(positions) - max(0, need - len(drops))
            refused.update(positions[fit:])
            group_at.update((i, group) for i in positions[:fit])
        self.counters.quota_refused += len(refused)
        return refused, group_at

    def _cache_chain(
        self,
        keys: Sequence[BlockKey],
        parent_keys: Sequence[BlockKey],
        parent_is_root: Sequence[bool],
        pages: Sequence[Page],
        num_tokens: Sequence[int],
        imported: bool,
    ) -> list[int]:
        """:meth:`cache_blocks` of a chain: one insert_chain, one add_many, one stored_chain."""
        parent = self.tree.parent_node(parent_keys[0], create_root=bool(parent_is_root[0]))
        assert parent is not None, "a parent block is not cached"
        self.tree.insert_chain(parent, keys, pages, num_tokens)
        self.policy.add_many(pages)  # type: ignore[arg-type]  # a list takes the one-call path
        self.events.stored_chain(keys, parent_keys, self.tier_kinds[pages[0].level], num_tokens)
        if imported:
            self.counters.imported_blocks += len(keys)
        return []


class StoreLock:
    """What :meth:`PageStore.locked` returns (one per store; all state is in the lock): a class,
    not a generator context manager, since every manager call enters it."""

    __slots__ = ("_store",)

    def __init__(self, store: PageStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        store._lock.acquire()
        if store._graveyard:
            try:
                store._bury()
            except BaseException:
                store._lock.release()
                raise

    def __exit__(self, *exc: object) -> None:
        self._store._lock.release()

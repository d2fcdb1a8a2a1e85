"""check_invariants(): a full consistency check of one device's PageStore (tests call it after
every operation through ``CacheManager.check_invariants``). Raises AssertionError naming the
first violation found."""

from __future__ import annotations

import collections

from raykv.core import quota as quota_module
from raykv.core.kvcache import KvCache, Status
from raykv.core.page import Page
from raykv.core.stats import CacheStats
from raykv.core.store import PageStore
from raykv.core.tiers.shm_directory import expected_bindings
from raykv.core.types import TierKind


def _caches(mgr: PageStore) -> list[KvCache]:
    return mgr.open_requests()


def _live_pages(mgr: PageStore) -> dict[int, Page]:
    pages: dict[int, Page] = {b.page.uid: b.page for b in mgr.tree.iter_blocks()}
    for cache in _caches(mgr):
        for page in cache.pages():
            pages[page.uid] = page
    for leased in mgr.leases.values():  # includes pages staged by an import awaiting its confirm
        for page in leased:
            pages[page.uid] = page
    return pages


def _check_refcounts(mgr: PageStore, pages: dict[int, Page]) -> None:
    pins: collections.Counter[int] = collections.Counter()
    holders: collections.Counter[int] = collections.Counter()
    for cache in _caches(mgr):
        assert cache.status is not Status.CLOSED, "closed cache still registered"
        uids = [p.uid for p in cache.pages()]
        assert len(uids) == len(set(uids)), f"{cache!r} lists a page twice"
        assert (
            cache.num_blocks * cache.tokens_per_block
            >= cache.num_tokens
            > (cache.num_blocks - 1) * cache.tokens_per_block
            or cache.num_blocks == 0
        )
        for uid in uids:
            holders[uid] += 1
            if cache.status is Status.ACTIVE:
                pins[uid] += 1
        assert cache.num_committed_blocks <= cache.num_tokens // cache.tokens_per_block
    leases: collections.Counter[int] = collections.Counter()
    for leased in mgr.leases.values():
        for page in leased:
            leases[page.uid] += 1
    pinned_top = 0
    for uid, page in pages.items():
        assert page.leases == leases[uid], f"{page!r}: leases {page.leases} != {leases[uid]}"
        assert page.pins == pins[uid], f"{page!r}: pins {page.pins} != {pins[uid]}"
        assert page.holders == holders[uid], f"{page!r}: holders {page.holders} != {holders[uid]}"
        if page.pins:
            assert page.level == 0, f"{page!r} pinned below the top tier"
            pinned_top += 1
        if page.block is None and page.holders == 0:
            # Only a page staged by ``import_pages`` (leased until its commit) may be neither.
            assert page.leases > 0, f"{page!r}: private page with no holder (leaked)"
            assert not page.queued and not page.pins, f"{page!r}: staged page queued or pinned"
            continue
        assert page.queued == (page.pins == 0), f"{page!r}: queued={page.queued} but pins={page.pins}"
    assert mgr.pinned_top == pinned_top, f"pinned counter {mgr.pinned_top} != {pinned_top}"


def _check_slots(mgr: PageStore, pages: dict[int, Page]) -> None:
    used: dict[tuple[int, int], int] = {}
    per_level = [0] * len(mgr.pools)
    for uid, page in pages.items():
        where = (page.level, int(page.slot))
        assert where not in used, f"pages {used[where]} and {uid} share slot {where}"
        used[where] = uid
        assert mgr.pools[page.level].is_used(page.slot), f"{page!r} sits in a free slot"
        per_level[page.level] += 1
    for level, pool in enumerate(mgr.pools):
        pool.check_slots()
        assert pool.num_used == per_level[level], (
            f"{pool.kind.name}: {pool.num_used} slots used, {per_level[level]} live pages"
        )
        queued = sum(1 for p in pages.values() if p.queued and p.level == level)
        assert mgr.policy.count(level) == queued, (
            f"{pool.kind.name}: policy holds {mgr.policy.count(level)} pages, {queued} queued"
        )


def _check_caches_vs_tree(mgr: PageStore) -> None:
    for cache in _caches(mgr):
        pages = cache.pages()
        keys = cache.committed_keys()
        for i in range(cache.num_committed_blocks):
            page = pages[i]
            if page.block is not None:
                assert page.block.key == keys[i], f"{cache!r}: block {i} backs the wrong key"


def check_store(mgr: PageStore, stats: CacheStats) -> None:
    """Verify tree links, slot ownership, pins, holders, queue membership, per-salt quotas and
    counters (``stats``:
    the manager's snapshot, taken under the same lock). Under the lock."""
    mgr.tree.check()
    pages = _live_pages(mgr)
    _check_refcounts(mgr, pages)
    _check_slots(mgr, pages)
    _check_caches_vs_tree(mgr)
    if mgr.quota is not None:  # every committed block counted in its group, each within the quota
        quota_module.check(mgr.quota, mgr.tree.iter_blocks())
    for level, pool in enumerate(mgr.pools):
        assert stats.bytes_in_use[level] == pool.num_used * pool.page_bytes
    assert mgr.events.last_event_id >= len(mgr.events)
    _check_directories(mgr)


def _check_directories(mgr: PageStore) -> None:
    """A shared host tier's directory binds only committed blocks where they are; with no GPU tier
    (every copy synchronous) it binds every committed block on that tier."""
    synchronous = TierKind.GPU not in mgr.tier_kinds
    for level, pool in enumerate(mgr.pools):
        directory = getattr(pool, "slot_directory", None)
        if directory is None:
            continue
        expected = expected_bindings(mgr.tree, mgr.copy.host_events, level)
        if synchronous:
            directory.check(expected)
        else:
            bound = directory.bound()
            assert all(expected.get(slot) == key for slot, key in bound.items()), "stale directory binding"

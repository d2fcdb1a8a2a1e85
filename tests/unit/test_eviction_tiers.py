"""Eviction across tiers: host -> disk -> dropped, promotion on resume, priorities, LRU, leaves
only, events that mirror the tree, and the host/disk page pools themselves."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from import_support import toks

from raykv import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVLayout,
    ReuseScope,
    TierConfig,
    TierKind,
    block_keys,
)
from raykv.core.config import DISK_ALIGN
from raykv.core.tiers import DiskPool, HostPool

TPB = 4
HOST, DISK = TierKind.HOST, TierKind.DISK


def tiers_of(mgr, tokens) -> tuple[TierKind, ...]:
    return mgr.probe(tokens).tiers


def replay(events, tiers: dict[bytes, TierKind] | None = None) -> dict[bytes, TierKind]:
    """Apply events to a key -> tier map, checking each event is consistent with the map."""
    tiers = {} if tiers is None else tiers
    for e in events:
        if isinstance(e, BlockStored):
            assert e.key not in tiers, "stored twice"
            tiers[e.key] = e.tier
        elif isinstance(e, BlockTierChanged):
            assert tiers[e.key] is e.old_tier and e.old_tier is not e.new_tier
            tiers[e.key] = e.new_tier
        elif isinstance(e, BlockRemoved):
            assert tiers.pop(e.key) is e.tier
        else:
            assert isinstance(e, AllCleared)
            tiers.clear()
    return tiers


def tree_tiers(mgr) -> dict[bytes, TierKind]:
    return {b.key: b.tier for b in mgr.committed_blocks()}


def assert_parents_cached(mgr) -> None:
    """Every committed block's parent is a committed block or a scope root."""
    blocks = mgr.committed_blocks()
    keys = {b.key for b in blocks}
    for b in blocks:
        block = mgr.tree.get(b.key)
        assert (b.parent_key in keys) != (block.ordinal == 0), f"orphan block {b.key.hex()[:16]}"


# ---- the cascade ---------------------------------------------------------------------------------


def test_cascade_host_disk_dropped_then_promoted(make_manager, oracle, run_request):
    mgr = make_manager(2, 4)
    a, b, c = toks(1, 8), toks(2, 8), toks(3, 8)  # two blocks each
    q, r = toks(4, 4), toks(5, 4)  # one block each
    run_request(mgr, a)
    assert tiers_of(mgr, a) == (HOST, HOST)
    run_request(mgr, b)
    assert tiers_of(mgr, a) == (DISK, DISK) and tiers_of(mgr, b) == (HOST, HOST)
    run_request(mgr, c)  # host -> disk: the disk is now full
    assert [tiers_of(mgr, x) for x in (a, b, c)] == [(DISK, DISK), (DISK, DISK), (HOST, HOST)]
    mgr.drain_events()
    run_request(mgr, q)  # c's block 0 goes down; a's leaf (block 1) is dropped from the disk
    run_request(mgr, r)  # c's block 1 goes down; a's block 0, a leaf now, is dropped
    removed = [e for e in mgr.drain_events() if isinstance(e, BlockRemoved)]
    assert [(e.key, e.tier) for e in removed] == [(k, DISK) for k in block_keys(a, TPB)[::-1]]
    assert [tiers_of(mgr, x) for x in (a, b, c, q, r)] == [(), (DISK,) * 2, (DISK,) * 2, (HOST,), (HOST,)]
    assert oracle.verify_manager(mgr) == 6
    base = mgr.stats()

    cache = mgr.create(b)  # a hit on disk ...
    assert cache.num_reused_tokens == 8 and cache.pending_stats.hit_blocks == (0, 2)
    assert cache.resume()  # ... is promoted: q and r go down, c (the disk's LRU chain) is dropped
    assert [pg.level for pg in cache.pages()] == [0, 0]
    oracle.verify_cache(cache)
    mgr.check_invariants()
    cache.close()
    delta = mgr.stats() - base
    assert sum(delta.promotions) == 2 and sum(delta.demotions) == 2
    assert delta.hit_blocks == (0, 2) and delta.evictions == (0, 2)
    assert [tiers_of(mgr, x) for x in (a, b, c, q, r)] == [(), (HOST, HOST), (), (DISK,), (DISK,)]
    assert oracle.verify_manager(mgr) == 4
    mgr.check_invariants()


def test_partially_demoted_chain_promotes_on_resume(make_manager, oracle, run_request):
    mgr = make_manager(3, 6)
    tokens = toks(1, 12)
    run_request(mgr, tokens)
    run_request(mgr, toks(2, 8))  # blocks 0 and 1 of the chain (least recently used) go to disk
    assert tiers_of(mgr, tokens) == (DISK, DISK, HOST)
    cache = run_request(mgr, tokens, close=False)
    assert cache.num_reused_tokens == 12
    assert tiers_of(mgr, tokens) == (HOST, HOST, HOST)
    assert tiers_of(mgr, toks(2, 8)) == (DISK, DISK)
    oracle.verify_cache(cache)
    cache.close()
    assert oracle.verify_manager(mgr) == 5


# ---- who goes first ------------------------------------------------------------------------------


def test_lower_priority_evicted_first_regardless_of_recency(make_manager, run_request):
    mgr = make_manager(3)
    high, low1, low2 = toks(1, 4), toks(2, 4), toks(3, 4)
    run_request(mgr, high, priority=90)  # oldest, but high priority
    run_request(mgr, low1, priority=10)
    run_request(mgr, low2, priority=10)
    mid = [toks(10 + i, 4) for i in range(3)]
    run_request(mgr, mid[0], priority=50)
    assert [mgr.probe(x).num_blocks for x in (high, low1, low2)] == [1, 0, 1]
    run_request(mgr, mid[1], priority=50)
    assert [mgr.probe(x).num_blocks for x in (high, low1, low2)] == [1, 0, 0]
    run_request(mgr, mid[2], priority=50)  # among what is left, priority 50 < 90
    assert [mgr.probe(x).num_blocks for x in (high, *mid)] == [1, 0, 1, 1]


def test_priority_decides_demotion_order(make_manager, run_request):
    mgr = make_manager(2, 4)
    run_request(mgr, toks(1, 4), priority=100)
    run_request(mgr, toks(2, 4), priority=0)
    run_request(mgr, toks(3, 4))
    assert [tiers_of(mgr, toks(i, 4)) for i in (1, 2, 3)] == [(HOST,), (DISK,), (HOST,)]


def test_lru_within_one_priority(make_manager, run_request):
    mgr = make_manager(3)
    p = [toks(i, 4) for i in range(3)]
    for x in p:
        run_request(mgr, x)
    mgr.create(p[0]).close()  # p[0] becomes the most recently used
    order = []
    for i in range(3):
        run_request(mgr, toks(10 + i, 4))
        order.append([mgr.probe(x).num_blocks for x in p])
    assert order == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]


def test_only_leaves_are_dropped(make_manager, run_request):
    mgr = make_manager(3)
    chain = toks(1, 12)
    run_request(mgr, chain)  # block 0 is the least recently used page, but it has a child
    run_request(mgr, toks(2, 4))
    assert tiers_of(mgr, chain) == (HOST, HOST)
    run_request(mgr, toks(3, 4))
    assert tiers_of(mgr, chain) == (HOST,)
    assert_parents_cached(mgr)
    mgr.check_invariants()


def test_priority_respected_when_freeing_several_pages(make_manager, run_request):
    # One allocation of 2 pages: dropping the low chain's leaf makes its block 0 a droppable leaf
    # of priority 10, which must go before any block of priority 90.
    mgr = make_manager(4)
    low, high = toks(1, 8), toks(2, 8)
    run_request(mgr, low, priority=10)
    run_request(mgr, high, priority=90)
    run_request(mgr, toks(3, 8), priority=50)
    assert (mgr.probe(low).num_blocks, mgr.probe(high).num_blocks) == (0, 2)


def test_lru_respected_when_freeing_several_pages(make_manager, run_request):
    mgr = make_manager(4)
    old, new = toks(1, 8), toks(2, 8)
    run_request(mgr, old)
    run_request(mgr, new)
    run_request(mgr, toks(3, 8))  # the least recently used chain goes, whole
    assert (mgr.probe(old).num_blocks, mgr.probe(new).num_blocks) == (0, 2)


def test_cooled_blocks_go_first_deepest_first(make_manager, run_request):
    mgr = make_manager(5)
    old, new = toks(1, 12), toks(2, 8)
    run_request(mgr, old)
    run_request(mgr, new)  # `old` is the least recently used chain, `new` the most
    keys = [bytes(k) for k in block_keys(new, TPB)]
    assert mgr.cool_blocks([*keys, bytes(32)]) == 2  # an unknown key is skipped
    mgr.check_invariants()
    run_request(mgr, toks(3, 4))  # one page needed: the deepest cooled block goes
    assert (mgr.probe(old).num_blocks, mgr.probe(new).num_blocks) == (3, 1)
    run_request(mgr, toks(4, 8))  # two more: the rest of `new`, then the LRU leaf of `old`
    assert (mgr.probe(old).num_blocks, mgr.probe(new).num_blocks) == (2, 0)
    with pytest.raises(ValueError):
        mgr.cool_blocks([b"short"])
    mgr.check_invariants()


# ---- churn: parents, events and bytes stay consistent --------------------------------------------


def churn(mgr, oracle, run_request, rng: random.Random, steps: int) -> None:
    """Requests over a few shared prefixes and scopes, with a suspended request kept around."""
    prefixes = [toks(i, 4 * rng.randint(1, 3)) for i in range(4)]
    scopes = [ReuseScope(), ReuseScope(salt=2**64 - 1)]
    parked = None
    for _ in range(steps):
        tokens = rng.choice(prefixes) + [rng.randrange(50_000, 60_000) for _ in range(rng.randint(0, 6))]
        kw = {"scope": rng.choice(scopes), "priority": rng.choice([10, 35, 35, 80])}
        cache = run_request(mgr, tokens[:16], close=False, **kw)
        oracle.verify_cache(cache)
        if parked is None and rng.random() < 0.3:
            cache.suspend()  # held: may be demoted by later requests, never dropped
            parked = cache
        else:
            cache.close()
            if parked is not None:
                assert parked.resume()
                oracle.verify_cache(parked)
                parked.close()
                parked = None
        mgr.check_invariants()
        assert_parents_cached(mgr)
    if parked is not None:
        parked.close()


@pytest.mark.parametrize("seed", range(4))
def test_churn_keeps_parents_events_and_bytes(make_manager, oracle, run_request, seed):
    mgr = make_manager(6, 6)
    rng = random.Random(seed)
    churn(mgr, oracle, run_request, rng, 40)
    events = mgr.drain_events()
    assert any(isinstance(e, BlockRemoved) for e in events), "the workload should drop blocks"
    assert any(isinstance(e, BlockTierChanged) and e.new_tier is HOST for e in events)
    mirror = replay(events)
    assert mirror == tree_tiers(mgr)
    stats = mgr.stats()
    assert sum(stats.evictions) == sum(isinstance(e, BlockRemoved) for e in events)
    assert oracle.verify_manager(mgr) == len(mirror)
    churn(mgr, oracle, run_request, rng, 20)  # events keep mirroring across drains
    replay(mgr.drain_events(), mirror)
    assert mirror == tree_tiers(mgr)
    mgr.clear_reusable()
    assert replay(mgr.drain_events(), mirror) == {} == tree_tiers(mgr)
    mgr.check_invariants()


def test_events_mirror_cascade_exactly(make_manager, run_request):
    mgr = make_manager(2, 2)
    p = [toks(i, 8) for i in range(3)]
    for x in p:
        run_request(mgr, x)
    k = [block_keys(x, TPB) for x in p]
    got = [(type(e).__name__, e.key) for e in mgr.drain_events()]
    want = [("BlockStored", key) for key in k[0]]
    want += [("BlockTierChanged", key) for key in k[0]] + [("BlockStored", key) for key in k[1]]
    want += [("BlockRemoved", k[0][1]), ("BlockRemoved", k[0][0])]
    want += [("BlockTierChanged", key) for key in k[1]] + [("BlockStored", key) for key in k[2]]
    assert got == want


# ---- the disk tier's file ------------------------------------------------------------------------


def test_disk_file_in_temp_dir_removed_on_shutdown(make_manager):
    mgr = make_manager(2, 3)
    pool = mgr.pools[1]
    assert isinstance(pool, DiskPool) and os.path.dirname(pool.path) == pool.directory
    assert os.path.getsize(pool.path) == pool.num_slots * pool.stride
    mgr.shutdown()
    assert not os.path.exists(pool.path) and not os.path.exists(pool.directory)


def test_disk_file_in_user_dir_removed_on_shutdown(make_manager, run_request, tmp_path):
    mgr = make_manager(2, 3, disk_path=str(tmp_path))
    pool = mgr.pools[1]
    assert os.path.dirname(pool.path) == str(tmp_path)
    run_request(mgr, toks(1, 8))
    run_request(mgr, toks(2, 8))  # something really lives on disk
    assert mgr.stats().bytes_in_use[1] == 2 * pool.page_bytes
    mgr.shutdown()
    assert not os.path.exists(pool.path)
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []


# ---- capacities, alignment, pools ----------------------------------------------------------------


@pytest.mark.parametrize("host_pages, disk_pages", [(2.5, 3.99), (3, 1.01), (1.0, 7.5)])
def test_capacities_round_down_to_whole_pages(make_manager, layout, host_pages, disk_pages):
    mgr = make_manager(host_pages, disk_pages)
    page = layout.page_bytes
    slots = (int(host_pages), int(disk_pages))
    assert tuple(p.num_slots for p in mgr.pools) == slots
    assert mgr.stats().capacity_bytes == tuple(n * page for n in slots)
    assert mgr.stats().tiers == (HOST, DISK)


BIG = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=8)  # 8 KiB pages


@pytest.mark.parametrize("lay", [None, BIG], ids=["512B-pages", "8KiB-pages"])
def test_disk_pages_are_page_aligned(layout, tmp_path, lay):
    lay = lay or layout
    pool = DiskPool(TierConfig.disk(6 * lay.page_bytes, str(tmp_path)), lay)
    try:
        assert pool.stride % DISK_ALIGN == 0 and pool.page_bytes <= pool.stride < pool.page_bytes + DISK_ALIGN
        rng = np.random.default_rng(0)
        slots = [4, 1, 2, 5]  # a run (1, 2) and singletons, out of order
        data = rng.integers(0, 256, (len(slots), lay.page_bytes), dtype=np.uint8)
        pool.write_pages(slots, data)
        with open(pool.path, "rb") as f:
            raw = f.read()
        for row, slot in zip(data, slots):
            assert raw[slot * pool.stride : slot * pool.stride + lay.page_bytes] == row.tobytes()
        out = np.zeros((3, lay.page_bytes), dtype=np.uint8)
        pool.read_pages([5, 1, 2], out)
        assert np.array_equal(out, data[[3, 1, 2]])
    finally:
        pool.close()
    assert not os.path.exists(pool.path)


def test_host_pool_non_consecutive_slots(layout):
    pool = HostPool(TierConfig.host(8 * layout.page_bytes, pin_memory=False), layout)
    try:
        data = np.arange(3 * layout.page_bytes, dtype=np.uint32).astype(np.uint8).reshape(3, -1)
        pool.write_pages([6, 0, 3], data)
        out = np.zeros((3, layout.page_bytes), dtype=np.uint8)
        pool.read_pages([3, 6, 0], out)
        assert np.array_equal(out, data[[2, 0, 1]])
        assert not pool.array[[1, 2, 4, 5, 7]].any()  # neighbours untouched
        assert pool.allocate(3) == [0, 1, 2]
        pool.release([1])
        assert pool.allocate(1) == [1]  # LIFO reuse of the freed slot
        pool.check_slots()
    finally:
        pool.close()


def test_bytes_in_use_per_tier(make_manager, layout, oracle, run_request):
    mgr = make_manager(2, 4)
    page = layout.page_bytes
    assert mgr.stats().bytes_in_use == (0, 0)
    run_request(mgr, toks(1, 8))
    assert mgr.stats().bytes_in_use == (2 * page, 0)
    run_request(mgr, toks(2, 8))
    assert mgr.stats().bytes_in_use == (2 * page, 2 * page)
    cache = run_request(mgr, toks(3, 6), close=False)  # 1 committed + 1 private page, pinned
    stats = mgr.stats()
    assert stats.bytes_in_use == (2 * page, 4 * page) and stats.pinned_pages == 2
    assert stats.capacity_bytes == (2 * page, 4 * page)
    cache.close()
    assert mgr.stats().bytes_in_use == (1 * page, 4 * page)
    assert oracle.verify_manager(mgr) == 5
    mgr.check_invariants()

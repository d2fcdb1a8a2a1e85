"""CacheManager / KvCache lifecycle: create, resume, extend, commit, suspend, close.

Every test checks real page bytes through the content oracle where pages are involved, and calls
``check_invariants`` (directly or through the ``run_request`` / ``state_of`` fixtures) after each
operation.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from import_support import toks

from raykv import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    OutOfPagesError,
    ResourceBusyError,
    ReuseScope,
    RoleNotFoundError,
    StateError,
    StatsDelta,
    Status,
    TierKind,
    block_keys,
)

TPB = 4


def stored(events) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def open_active(mgr, oracle, tokens, **kw):
    """Create + resume + extend + fill (no commit): an engine mid-prefill."""
    cache = mgr.create(tokens, **kw)
    assert cache.resume()
    reused = cache.num_reused_tokens
    cache.extend(tokens[reused:])
    oracle.fill_cache(cache, reused // TPB)
    mgr.check_invariants()
    return cache


# ---- the basic lifecycle -------------------------------------------------------------------------


def test_full_lifecycle(make_manager, oracle):
    mgr = make_manager(8)
    tokens = toks(1, 10)
    cache = mgr.create(tokens, request_id=7)
    assert cache.status is Status.SUSPENDED
    assert (cache.num_reused_tokens, cache.num_tokens, cache.num_blocks) == (0, 0, 0)
    mgr.check_invariants()
    assert cache.resume() and cache.is_active
    assert cache.resume()  # already active: True, no change
    mgr.check_invariants()
    cache.extend(tokens)
    assert (cache.num_tokens, cache.num_blocks) == (10, 3)
    assert cache.tokens.tolist() == tokens
    assert mgr.stats().pinned_pages == 3
    oracle.fill_cache(cache)
    mgr.check_invariants()
    assert cache.commit() == 2  # only the two full blocks
    assert cache.num_committed_blocks == 2
    events = stored(mgr.drain_events())
    keys = block_keys(tokens, TPB)
    assert [e.key for e in events] == keys
    assert [e.parent_key for e in events] == [ReuseScope().root_key(), keys[0]]
    assert all(e.tier is TierKind.HOST and e.request_id == 7 and e.num_tokens == TPB for e in events)
    mgr.check_invariants()
    cache.suspend()
    assert cache.status is Status.SUSPENDED and mgr.stats().pinned_pages == 0
    cache.suspend()  # no-op
    mgr.check_invariants()
    assert cache.resume()
    oracle.verify_cache(cache)
    cache.close()
    assert cache.status is Status.CLOSED
    mgr.check_invariants()
    assert mgr.num_open_requests == 0
    assert mgr.top_pool.num_used == 2  # committed blocks stay, the private partial page is freed
    for call in (cache.resume, cache.suspend, cache.commit):
        with pytest.raises(StateError):
            call()
    assert oracle.verify_manager(mgr) == 2


def test_reuse_after_commit_is_full_blocks_only(make_manager, oracle, run_request):
    mgr = make_manager(16)
    first = toks(1, 10)
    run_request(mgr, first)  # 2 full blocks committed, the partial third stays private
    assert [b.key for b in mgr.committed_blocks()] == block_keys(first, TPB)
    for tokens, reused in [
        (first, 8),
        ([*first[:9], 5], 8),
        (first[:8], 8),
        (first[:7], 4),
        (first[:3], 0),
        ([99, *first[1:]], 0),
        (first + toks(2, 20), 8),
    ]:
        cache = mgr.create(tokens)
        assert cache.num_reused_tokens == reused and reused % TPB == 0
        assert cache.num_tokens == reused and cache.num_blocks == reused // TPB
        assert cache.tokens.tolist() == tokens[:reused]
        assert cache.resume()
        oracle.verify_cache(cache)
        cache.close()
        mgr.check_invariants()
    assert mgr.probe(first).num_tokens == 8


def test_commit_partial_range_and_other_scope(make_manager, oracle):
    mgr = make_manager(8)
    tokens = toks(3, 12)
    cache = open_active(mgr, oracle, tokens)
    assert cache.commit(6) == 1  # one full block among the first 6 tokens
    assert cache.commit(5) == 0
    for bad in (-1, 13, True, 2.0):
        with pytest.raises(ValueError):
            cache.commit(bad)
    assert cache.commit() == 2
    cache.close()
    mgr.check_invariants()
    with mgr.create(tokens, scope=ReuseScope(salt=1)) as other:
        assert other.num_reused_tokens == 0
    with mgr.create(tokens) as same:
        assert same.num_reused_tokens == 12


# ---- page access ---------------------------------------------------------------------------------


def test_page_access_only_when_active(make_manager, oracle, layout):
    mgr = make_manager(4)
    cache = open_active(mgr, oracle, toks(1, 5))
    assert len(cache.page_ids()) == 2
    view = cache.buffer_view(1, 1, "v")
    assert view.shape == (TPB, 2, 8) and view.dtype == np.float16
    region = layout.buffer_region(1, "v")
    view[0, 0, 0] = 1.5
    assert cache.page(1)[region.offset : region.offset + 2].tobytes() == np.float16(1.5).tobytes()
    for status_change in (cache.suspend, cache.close):
        status_change()
        mgr.check_invariants()
        for call in (cache.page_ids, lambda: cache.page(0), lambda: cache.buffer_view(0, 0, "k")):
            with pytest.raises(StateError):
                call()


@pytest.mark.parametrize("layer, role", [(0, "q"), (2, "k"), (-1, "k"), (0, "K"), (0, ["k"])])
def test_unknown_role_is_role_not_found(make_manager, oracle, layout, layer, role):
    mgr = make_manager(4)
    cache = open_active(mgr, oracle, toks(1, 4))
    with pytest.raises(RoleNotFoundError) as from_cache:
        cache.buffer_view(0, layer, role)
    with pytest.raises(RoleNotFoundError) as from_layout:
        layout.buffer_region(layer, role)
    assert isinstance(from_cache.value, KeyError)
    assert type(from_cache.value) is type(from_layout.value)
    oracle.verify_cache(cache)
    mgr.check_invariants()


# ---- rejected calls change nothing -----------------------------------------------------------------


def test_resume_refused_by_max_util_changes_nothing(make_manager, oracle, run_request, state_of):
    mgr = make_manager(4, max_util_for_resume=0.5)
    shared = toks(1, 8)
    run_request(mgr, shared)
    active = open_active(mgr, oracle, toks(2, 8))  # pins 2 of 4 pages: exactly at the limit
    waiting = mgr.create(shared)
    assert waiting.num_reused_tokens == 8
    before = state_of(mgr)
    assert waiting.resume() is False
    assert waiting.status is Status.SUSPENDED
    assert state_of(mgr) == before
    active.suspend()
    assert waiting.resume() is True
    oracle.verify_cache(waiting)
    mgr.check_invariants()
    active.close()
    waiting.close()


def test_resume_refused_when_no_room_changes_nothing(make_manager, oracle, state_of):
    # Both requests hold private pages; the host is full of one, the disk full of the other, so
    # neither can be swapped in without dropping a held page: resume must refuse, not fail.
    mgr = make_manager(2, 2)
    first = open_active(mgr, oracle, toks(1, 8))
    first.suspend()
    second = open_active(mgr, oracle, toks(2, 8))
    second.suspend()
    assert {p.level for p in first.pages()} == {1}
    before = state_of(mgr)
    assert first.resume() is False
    assert state_of(mgr) == before
    second.close()
    mgr.check_invariants()
    assert first.resume() is True
    oracle.verify_cache(first)
    first.close()
    mgr.check_invariants()


def test_extend_out_of_pages_changes_nothing(make_manager, oracle, state_of):
    mgr = make_manager(4, 4)
    cache = open_active(mgr, oracle, toks(1, 14))  # 4 pinned pages, the last holds 2 tokens
    before = state_of(mgr)
    with pytest.raises(OutOfPagesError):
        cache.extend(toks(2, 3))
    assert state_of(mgr) == before
    assert cache.num_tokens == 14
    cache.extend(toks(2, 2))  # fits in the last page: no allocation needed
    oracle.fill_cache(cache, 3)
    assert cache.commit() == 4
    oracle.verify_cache(cache)
    cache.close()
    mgr.check_invariants()


def test_extend_needs_active(make_manager):
    mgr = make_manager(4)
    cache = mgr.create(toks(1, 4))
    with pytest.raises(StateError):
        cache.extend([1])
    assert cache.resume()
    for bad in ([-1], [2**31], [1.5]):
        with pytest.raises(ValueError):
            cache.extend(bad)
    assert cache.num_tokens == 0 and cache.num_blocks == 0
    cache.close()
    mgr.check_invariants()


# ---- what eviction may and may not touch ---------------------------------------------------------


def test_suspended_pages_are_demoted_never_dropped(make_manager, oracle):
    mgr = make_manager(3, 3)
    held = open_active(mgr, oracle, toks(1, 10))
    held.commit()  # 2 committed blocks + 1 private partial page
    held.suspend()
    mgr.drain_events()
    other = open_active(mgr, oracle, toks(2, 12))  # needs all 3 host pages
    assert [p.level for p in held.pages()] == [1, 1, 1]
    with pytest.raises(OutOfPagesError):
        other.extend(toks(3, 4))  # the disk is full of held pages: nothing may be dropped
    assert [p.level for p in held.pages()] == [1, 1, 1]
    assert not [e for e in mgr.drain_events() if isinstance(e, BlockRemoved)]
    other.commit()
    other.close()
    mgr.check_invariants()
    assert held.resume()
    assert [p.level for p in held.pages()] == [0, 0, 0]
    oracle.verify_cache(held)
    held.close()
    mgr.check_invariants()


def test_pinned_pages_are_never_evicted(make_manager, oracle):
    mgr = make_manager(3, 4)
    active = open_active(mgr, oracle, toks(1, 12))
    active.commit()
    ids = active.page_ids()
    other = mgr.create(toks(2, 4))
    assert other.resume()
    with pytest.raises(OutOfPagesError):
        other.extend(toks(2, 4))
    mgr.check_invariants()
    assert active.page_ids() == ids and mgr.pools[1].num_used == 0
    oracle.verify_cache(active)
    active.suspend()
    other.extend(toks(2, 4))  # now the least recently used page of `active` goes to disk
    oracle.fill_cache(other)
    mgr.check_invariants()
    assert [p.level for p in active.pages()] == [1, 0, 0]
    other.commit()
    oracle.verify_cache(other)
    other.close()
    assert active.resume()
    oracle.verify_cache(active)
    active.close()
    assert oracle.verify_manager(mgr) == 4


# ---- duplicate commits ---------------------------------------------------------------------------


def test_duplicate_commit_keeps_second_page_private(make_manager, oracle):
    mgr = make_manager(8)
    tokens = toks(1, 8)
    a = open_active(mgr, oracle, tokens)
    b = open_active(mgr, oracle, tokens)
    b_ids = b.page_ids()
    a.commit()
    mgr.drain_events()
    b.commit()
    mgr.check_invariants()
    assert not stored(mgr.drain_events())
    assert b.page_ids() == b_ids
    assert all(p.block is None for p in b.pages())
    assert [mgr.tree.get(k).page for k in block_keys(tokens, TPB)] == a.pages()
    oracle.verify_cache(a)
    oracle.verify_cache(b)
    b.close()
    mgr.check_invariants()
    assert mgr.top_pool.num_used == 2  # b's private twins were freed
    a.close()
    with mgr.create(tokens) as c:
        assert c.num_reused_tokens == 8 and c.resume()
        oracle.verify_cache(c)
    assert oracle.verify_manager(mgr) == 2


def test_duplicate_twin_dropped_then_commit_reinserts_private_pages(make_manager, oracle, run_request):
    mgr = make_manager(4)
    tokens = toks(1, 12)
    a = open_active(mgr, oracle, tokens[:8])
    b = open_active(mgr, oracle, tokens[:8])
    a.commit()
    b.commit()  # b's two pages stay private twins
    a.close()
    b.suspend()
    run_request(mgr, toks(2, 8))  # evicts a's committed blocks (no disk): they are dropped
    assert mgr.probe(tokens).num_blocks == 0
    assert b.resume()
    b.extend(tokens[8:])
    oracle.fill_cache(b, 2)
    assert b.commit() == 1
    mgr.check_invariants()
    assert [mgr.tree.get(k).page for k in block_keys(tokens, TPB)] == b.pages()
    b.close()
    with mgr.create(tokens) as c:
        assert c.num_reused_tokens == 12 and c.resume()
        oracle.verify_cache(c)
    mgr.check_invariants()


# ---- close ---------------------------------------------------------------------------------------


def test_close_is_idempotent_and_works_while_active(make_manager, oracle):
    mgr = make_manager(4)
    cache = open_active(mgr, oracle, toks(1, 10))
    cache.commit()
    assert mgr.stats().pinned_pages == 3
    cache.close()
    mgr.check_invariants()
    stats = mgr.stats()
    assert (stats.pinned_pages, stats.open_requests, mgr.top_pool.num_used) == (0, 0, 2)
    cache.close()
    mgr.check_invariants()
    assert mgr.stats() == stats
    with cache:  # the context manager closes again: still fine
        pass
    assert mgr.probe(toks(1, 10)).num_blocks == 2
    assert oracle.verify_manager(mgr) == 2


def test_garbage_collected_open_cache_warns_and_releases(make_manager, oracle):
    mgr = make_manager(4)
    cache = open_active(mgr, oracle, toks(1, 6))
    cache.commit()
    with pytest.warns(ResourceWarning, match="garbage-collected"):
        del cache
        gc.collect()
    mgr.check_invariants()
    stats = mgr.stats()
    assert (stats.open_requests, stats.pinned_pages, mgr.top_pool.num_used) == (0, 0, 1)
    assert mgr.probe(toks(1, 6)).num_blocks == 1
    assert oracle.verify_manager(mgr) == 1
    mgr.shutdown()  # nothing is open any more


# ---- global operations ---------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["clear_reusable", "shutdown"])
def test_global_ops_refuse_while_requests_open(make_manager, oracle, run_request, state_of, api):
    mgr = make_manager(8)
    run_request(mgr, toks(1, 8))
    caches = [run_request(mgr, toks(2, 6), close=False), mgr.create(toks(1, 8))]
    mgr.drain_events()
    before = state_of(mgr)
    with pytest.raises(ResourceBusyError, match=r"\b2\b") as err:
        getattr(mgr, api)()
    assert err.value.num_open == 2 and isinstance(err.value, StateError)
    assert state_of(mgr) == before and not mgr.closed and not mgr.drain_events()
    for cache in caches:
        cache.close()
    mgr.check_invariants()
    result = getattr(mgr, api)()
    assert [type(e) for e in mgr.drain_events()] == [AllCleared]
    assert mgr.committed_blocks() == [] and all(p.num_used == 0 for p in mgr.pools)
    if api == "clear_reusable":
        assert result == 3
        mgr.check_invariants()
        with mgr.create(toks(1, 8)) as cache:
            assert cache.num_reused_tokens == 0
    else:
        assert mgr.closed
        mgr.shutdown()  # idempotent
        with pytest.raises(StateError):
            mgr.create(toks(1, 4))


# ---- argument validation -------------------------------------------------------------------------


@pytest.mark.parametrize("request_id", [0, 1, 2**63, 2**64 - 1, None])
def test_request_id_in_block_stored_events(make_manager, run_request, request_id):
    mgr = make_manager(4)
    run_request(mgr, toks(1, 8), request_id=request_id)
    events = stored(mgr.drain_events())
    assert len(events) == 2 and all(e.request_id == request_id for e in events)


@pytest.mark.parametrize("priority", [0, 1, 50, 100])
def test_priority_accepted(make_manager, run_request, priority):
    mgr = make_manager(4)
    cache = run_request(mgr, toks(1, 4), priority=priority)
    assert cache.priority == priority
    assert mgr.tree.get(block_keys(toks(1, 4), TPB)[0]).page.priority == priority


BAD_IDS = [{"request_id": v} for v in (-1, 2**64, True, 1.0, "1")]
BAD_PRIORITIES = [{"priority": v} for v in (-1, 101, True, False, 50.0, None, "50")]


@pytest.mark.parametrize("kw", BAD_IDS + BAD_PRIORITIES, ids=repr)
def test_bad_request_id_or_priority_rejected(make_manager, kw):
    mgr = make_manager(4)
    with pytest.raises(ValueError):
        mgr.create(toks(1, 4), **kw)
    if "priority" in kw:
        with pytest.raises(ValueError):
            mgr.import_blocks([], **kw)
    assert mgr.num_open_requests == 0
    mgr.check_invariants()


# ---- stats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fold", ["commit", "close"])
def test_pending_stats_fold_on_commit_or_close(make_manager, oracle, run_request, fold):
    mgr = make_manager(8)
    shared = toks(1, 12)
    run_request(mgr, shared)
    base = mgr.stats()
    tokens = shared[:8] + toks(2, 6)  # 14 tokens: 3 full blocks, 2 cached
    cache = mgr.create(tokens)
    pending = cache.pending_stats
    assert (pending.hit_blocks, pending.hit_tokens) == ((2,), (8,))
    assert (pending.miss_blocks, pending.miss_tokens) == (1, 6)
    assert cache.resume()
    cache.extend(tokens[8:])
    oracle.fill_cache(cache, 2)
    assert mgr.stats() - base == StatsDelta.zero(1)  # no counter moved yet
    mgr.check_invariants()
    if fold == "commit":
        cache.commit()
    else:
        cache.close()
    mgr.check_invariants()
    delta = mgr.stats() - base
    assert cache.pending_stats is None
    assert (delta.hit_blocks, delta.hit_tokens, delta.miss_blocks, delta.miss_tokens) == ((2,), (8,), 1, 6)
    cache.close()  # folding happens once
    assert (mgr.stats() - base).hit_blocks == (2,)


# ---- probe ---------------------------------------------------------------------------------------


def test_probe_has_no_side_effects(make_manager, run_request, state_of):
    mgr = make_manager(3)
    prompts = [toks(i, 4) for i in (1, 2, 3)]  # committed in this order: prompts[0] is LRU
    for p in prompts:
        run_request(mgr, p)
    before = state_of(mgr)
    keys = block_keys(prompts[0], TPB)
    assert mgr.probe(prompts[0]).num_blocks == 1
    assert mgr.probe(keys=keys).num_blocks == 1
    assert mgr.probe(toks(9, 8)).num_blocks == 0
    assert state_of(mgr) == before  # same stats, events, pages and eviction order
    run_request(mgr, toks(4, 4))  # needs one page: the LRU block goes
    assert [mgr.probe(p).num_blocks for p in prompts] == [0, 1, 1]


def test_create_touches_lru_unlike_probe(make_manager, run_request):
    mgr = make_manager(3)
    prompts = [toks(i, 4) for i in (1, 2, 3)]
    for p in prompts:
        run_request(mgr, p)
    mgr.create(prompts[0]).close()  # a real lookup makes prompts[0] most recently used
    run_request(mgr, toks(4, 4))
    assert [mgr.probe(p).num_blocks for p in prompts] == [1, 0, 1]


def test_probe_reports_tiers_and_keys_match_tokens(make_manager, run_request):
    mgr = make_manager(3, 4)
    tokens = toks(1, 12)
    run_request(mgr, tokens)
    run_request(mgr, toks(2, 4))  # demotes the LRU page of the chain (block 0) to disk
    keys = block_keys(tokens, TPB)
    by_tokens = mgr.probe(tokens)
    assert by_tokens.tiers == (TierKind.DISK, TierKind.HOST, TierKind.HOST)
    assert (by_tokens.num_blocks, by_tokens.num_tokens) == (3, 12)
    assert by_tokens.blocks_on(TierKind.DISK) == 1
    assert mgr.probe(keys=keys) == by_tokens
    assert mgr.probe(tokens[:10]) == mgr.probe(keys=keys[:2])
    assert mgr.probe(keys=keys[1:]).tiers == (TierKind.HOST, TierKind.HOST)
    assert mgr.probe(keys=[bytes(32), *keys]).num_blocks == 0
    assert mgr.probe(tokens, scope=ReuseScope(lora_id=1)).num_blocks == 0
    for bad in ({}, {"tokens": tokens, "keys": keys}, {"keys": [b"short"]}):
        with pytest.raises(ValueError):
            mgr.probe(**bad)
    mgr.check_invariants()

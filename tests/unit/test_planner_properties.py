"""Property and regression tests of the manager's room planning.

A property test runs random operation sequences against a dict model of the keys that were
committed (key -> scope and tokens) and checks the tree has no orphans and every committed chain
is matchable from its root to at least its depth. A deterministic test pins down a planner case
the stateful machine's room check (test_stateful.py) found.
"""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from stateful_support import (
    ORACLE,
    SCOPES,
    SMALL_TOKEN,
    TPB,
    achievable_room,
    chain_depths,
    check_matchable,
    make_config,
    prompts,
    record_keys,
)

from raykv.core.errors import OutOfPagesError
from raykv.core.keys import ReuseScope
from raykv.core.kvcache import KvCache, Status
from raykv.core.manager import CacheManager
from raykv.core.types import TierKind

# ---- property test against a dict model of committed keys --------------------------------------
OPS = st.one_of(
    st.tuples(st.just("create"), prompts(), st.sampled_from(SCOPES), st.sampled_from([0, 35, 100])),
    st.tuples(st.just("resume"), st.integers(0, 7)),
    st.tuples(st.just("extend"), st.integers(0, 7), st.lists(SMALL_TOKEN, min_size=1, max_size=10)),
    st.tuples(st.just("commit"), st.integers(0, 7), st.one_of(st.none(), st.integers(0, 40))),
    st.tuples(st.just("suspend"), st.integers(0, 7)),
    st.tuples(st.just("close"), st.integers(0, 7)),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    host=st.integers(6, 12),
    disk=st.one_of(st.none(), st.integers(8, 16)),
    util=st.sampled_from([1.0, 0.75]),
    ops=st.lists(OPS, max_size=40),
)
def test_committed_blocks_have_no_orphans(
    host: int, disk: int | None, util: float, ops: list[tuple[Any, ...]]
) -> None:
    model: dict[bytes, tuple[ReuseScope, tuple[int, ...]]] = {}
    mgr = CacheManager(make_config(host, disk, util))
    caches: list[KvCache] = []
    try:
        for op in ops:
            name = op[0]
            if name == "create":
                caches.append(mgr.create(list(op[1]), scope=op[2], priority=op[3]))
                continue
            live = [c for c in caches if c.status is not Status.CLOSED]
            if not live:
                continue
            cache = live[op[1] % len(live)]
            if name == "resume":
                cache.resume()
            elif name == "extend":
                if not cache.is_active:
                    continue
                old = cache.num_tokens
                with contextlib.suppress(OutOfPagesError):
                    cache.extend(op[2])
                    ORACLE.fill_cache(cache, old // TPB)
            elif name == "commit":
                n = None if op[2] is None else min(op[2], cache.num_tokens)
                tokens = tuple(int(t) for t in cache.tokens)
                upto = len(tokens) if n is None else n
                cache.commit(n)
                record_keys(model, cache.scope, tokens[: upto // TPB * TPB])
            elif name == "suspend":
                cache.suspend()
            elif name == "close":
                cache.close()
            mgr.check_invariants()
            check_matchable(mgr, model)
        for cache in caches:
            cache.close()
        mgr.check_invariants()
        check_matchable(mgr, model)
        assert set(chain_depths(mgr)) <= set(model)
        ORACLE.verify_manager(mgr)
    finally:
        for cache in caches:
            cache.close()
        mgr.shutdown()


# ---- regression: a drop on the top tier must let the planner use the tier below -----------------
def test_extend_makes_room_when_a_drop_frees_the_tier_below() -> None:
    """Found by the machine's ``achievable_room`` check (extend raised OutOfPagesError while room
    could be made). A parent block P sits on the full disk tier, its child C on the host tier; the
    other host pages are held by suspended requests (demotable, not droppable). Freeing 2 host
    pages is possible: drop C, which makes P a droppable leaf; drop P, which frees a disk slot;
    demote one held page there. The planner gives up instead ("the rest not evictable")."""
    mgr = CacheManager(make_config(6, 8, 1.0))
    caches: list[KvCache] = []

    def request(tokens: list[int], priority: int, keep: bool) -> None:
        cache = mgr.create(tokens, priority=priority)
        caches.append(cache)
        assert cache.resume()
        reused = cache.num_reused_tokens
        cache.extend(tokens[reused:])
        ORACLE.fill_cache(cache, reused // TPB)
        if keep:
            cache.suspend()
        else:
            cache.commit()
            cache.close()

    try:
        request([1, 2, 3, 4], 0, keep=False)  # P (priority 0: demoted first)
        request([1, 2, 3, 4, 5, 6, 7, 8], 100, keep=False)  # C, child of P (priority 100)
        for i in range(12):  # suspended requests holding one private page each
            request([100 + i] * TPB, 0, keep=True)
        assert [c.tier for c in mgr.committed_blocks()] == [TierKind.DISK, TierKind.HOST]
        assert mgr.pools[0].num_free == 0 and mgr.pools[1].num_free == 0
        cache = mgr.create([7] * 8)
        caches.append(cache)
        assert cache.resume()
        assert achievable_room(mgr, set()) >= 2
        cache.extend([7] * 8)  # raises OutOfPagesError: the bug
        ORACLE.fill_cache(cache)
        mgr.check_invariants()
        ORACLE.verify_cache(cache)
        ORACLE.verify_manager(mgr)
    finally:
        for cache in caches:
            cache.close()
        mgr.shutdown()

"""The one routing policy: prices learned online, and one default configuration everywhere."""

from __future__ import annotations

import dataclasses
import inspect
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.core.keys import ReuseScope, block_keys
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.adaptive import RecentWork, RoutingPolicy, WorkShares
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig
from raykv.routing.session_keys import SessionKeys

A, B = WorkerId("a"), WorkerId("b")
# the prices and shares alone: no charge for recent work (its own tests below use RECENT)
CFG = dataclasses.replace(DEFAULT_ROUTING, tokens_per_block=16, recent_weight=0.0)
RECENT = dataclasses.replace(DEFAULT_ROUTING, tokens_per_block=16)


def test_a_duplicate_raises_the_price_and_clean_decisions_lower_it() -> None:
    policy = RoutingPolicy(CFG)
    start = policy.duplicate_price
    held = {A: RouteMatch(A, 10, gpu=10)}
    # A is far too busy: B recomputes A's 10 blocks (a duplicate of 160 of the prompt's 160 tokens)
    d = policy.decide(160, [A, B], [1e6, 0.0], held)
    assert d.worker == B and d.duplicated == 10
    up = math.exp(CFG.price_step * (1.0 / CFG.recompute_budget - 1.0))
    assert policy.duplicate_price == pytest.approx(min(CFG.price_max, start * up))
    high = policy.duplicate_price
    for _ in range(10):  # nothing cached anywhere: no duplicate, the price decays
        policy.decide(160, [A, B], [0.0, 0.0], {})
    assert policy.duplicate_price == pytest.approx(high * math.exp(-10 * CFG.price_step))
    assert policy.decisions == 11


def test_the_price_settles_where_duplicates_stay_within_the_budget() -> None:
    """A stream where keeping a prefix costs a random queue: the learned price ends up making
    about ``recompute_budget`` of the prompt tokens duplicates (dual ascent), whatever it
    started from."""
    rng = random.Random(1)
    for start in (0.5, 30.0):
        policy = RoutingPolicy(dataclasses.replace(CFG, price_start=start, guard_requests=1e9))
        held = {A: RouteMatch(A, 10, gpu=10)}
        dup = 0
        for i in range(20_000):
            d = policy.decide(160, [A, B], [rng.expovariate(1 / 400), 0.0], held)
            dup += d.duplicated if i >= 10_000 else 0
        share = dup / (10 * 10_000)
        assert 0.3 * CFG.recompute_budget < share < 3 * CFG.recompute_budget, (start, share)


def test_the_pull_price_comes_from_observed_pulls_and_prefills() -> None:
    policy = RoutingPolicy(dataclasses.replace(CFG, allow_pulls=True))
    assert policy.pull_price == pytest.approx(1 - CFG.w_remote)  # nothing observed yet
    policy.observe_prefill(1000, 1.0)
    policy.observe_pull(1000, 0.05)
    assert policy.pull_price == pytest.approx(0.05)
    held = {A: RouteMatch(A, 10, gpu=10)}
    d = policy.decide(160, [A, B], [100.0, 0.0], held)  # pull 160 tokens at 0.05 < queue of 100
    assert d.worker == B and d.pull_from == A and d.pull_blocks == 10 and d.duplicated == 0
    assert dict(d.costs)[B] == pytest.approx(0.05 * 160)


def test_the_load_guard_scales_with_the_work_requests_bring() -> None:
    policy = RoutingPolicy(CFG)
    policy.decide(1600, [A, B], [0.0, 0.0], {}, decode_work=400.0)  # 2000 units of work
    assert policy.prices().slack == pytest.approx(CFG.guard_requests * 2000)
    held = {A: RouteMatch(A, 100, gpu=100)}
    assert policy.decide(1600, [A, B], [7000.0, 0.0], held).worker == A  # within the slack
    assert policy.decide(1600, [A, B], [9000.0, 0.0], held).worker == B  # past it


def test_a_hot_prefix_is_re_decided_at_the_hot_price() -> None:
    policy = RoutingPolicy(dataclasses.replace(CFG, price_start=9.0, hot_price=0.0))
    held = {A: RouteMatch(A, 4, gpu=4)}
    asked: list[tuple[WorkerId, int]] = []

    def hot(worker: WorkerId, blocks: int) -> bool:
        asked.append((worker, blocks))
        return True

    assert policy.decide(160, [A, B], [500.0, 0.0], held, hot=hot).worker == B and asked == [(A, 4)]
    cold = RoutingPolicy(dataclasses.replace(CFG, price_start=9.0, hot_price=0.0))
    assert cold.decide(160, [A, B], [500.0, 0.0], held, hot=lambda w, n: False).worker == A


def test_session_keys_equal_block_keys_and_reuse_the_previous_turn() -> None:
    keys = SessionKeys(16)
    rng = np.random.default_rng(0)
    scope = ReuseScope.from_cache_salt("t")
    history = rng.integers(0, 50_000, 100).astype(np.uint32)
    assert keys.keys(history, scope, session=7) == block_keys(history, 16, scope)
    grown = np.concatenate([history, rng.integers(0, 50_000, 60).astype(np.uint32)])
    assert keys.keys(grown, scope, session=7) == block_keys(grown, 16, scope)
    assert keys.reused_blocks == 6 and keys.hashed_blocks == 6 + 4  # 100 // 16, then 160 // 16 - 6
    edited = grown.copy()
    edited[40] += 1  # block 2 changed: blocks 0 and 1 are reused
    assert keys.keys(edited, scope, session=7) == block_keys(edited, 16, scope)
    assert keys.reused_blocks == 8
    other = ReuseScope.from_cache_salt("u")  # another scope shares nothing
    assert keys.keys(edited, other, session=7) == block_keys(edited, 16, other)
    assert keys.reused_blocks == 8
    assert keys.keys(history, scope) == block_keys(history, 16, scope)  # no session: hashed whole


def test_every_router_starts_from_the_one_default_configuration() -> None:
    """The Serve router, RayKVCluster.pick_worker, the replay, the demo, the routing benchmark and
    the examples use DEFAULT_ROUTING (the replay and Serve change deployment facts only)."""
    from pathlib import Path

    import actors.cache.cluster
    import actors.cli.demo
    import actors.serve.deployments
    import raykv.bench.routing
    from actors.serve.ranking import CacheRanker
    from raykv.replay.grid import GridSpec
    from raykv.replay.routers import RaykvRouter, replay_routing
    from raykv.routing.pd import PDConfig

    assert GridSpec().routing is DEFAULT_ROUTING and RaykvRouter().routing is DEFAULT_ROUTING
    assert PDConfig().routing is DEFAULT_ROUTING
    from actors.cache.settings import Settings

    assert Settings().routing is DEFAULT_ROUTING  # raykv up without a [routing] section

    async def connect() -> None:
        raise AssertionError("not called")

    ranker = CacheRanker(connect)  # type: ignore[arg-type]
    assert ranker.config(16) == dataclasses.replace(DEFAULT_ROUTING, tokens_per_block=16)
    assert ranker.policy(16).cfg == ranker.config(16)
    facts = {"tokens_per_block", "w_host", "decode_weight", "allow_pulls", "seed"}
    replayed = replay_routing(DEFAULT_ROUTING, True, 3)
    changed = {f.name for f in dataclasses.fields(RoutingConfig)} - {
        f.name
        for f in dataclasses.fields(RoutingConfig)
        if getattr(replayed, f.name) == getattr(DEFAULT_ROUTING, f.name)
    }
    assert changed <= facts
    assert "DEFAULT_ROUTING" in inspect.getsource(actors.cache.cluster.RayKVCluster.pick_worker)
    assert "DEFAULT_ROUTING" in inspect.getsource(raykv.bench.routing)
    assert "DEFAULT_ROUTING" in inspect.getsource(actors.serve.deployments.PDPairer)  # pd_disagg's pairing
    assert "GridSpec(" in inspect.getsource(actors.cli.demo.run_ray_demo)  # GridSpec's routing: the default
    assert "routing=" not in inspect.getsource(actors.cli.demo.run_ray_demo)
    examples = Path(__file__).resolve().parents[2] / "examples"
    for name in ("serve_app.py", "vllm_serve.py", "pd_disagg.py", "pd_disagg_core.py"):
        text = (examples / name).read_text()
        assert '"routing"' not in text and "RoutingConfig(" not in text, name


def test_a_holder_past_its_share_of_the_work_is_held_near_the_limit() -> None:
    """A holds every prefix and all loads look equal: at first everything goes to A; once the
    shares are trusted (balance_window / 10 decisions) A, past balance_limit x the mean, pays its
    excess work as queued load, so B gets work although it holds nothing and A's share stays
    near the limit."""
    cfg = dataclasses.replace(CFG, balance_window=100, balance_limit=1.2, price_start=0.5)
    policy = RoutingPolicy(cfg)
    held = {A: RouteMatch(A, 10, gpu=10)}
    picks = [policy.decide(160, [A, B], [0.0, 0.0], held).worker for _ in range(400)]
    assert picks[:10] == [A] * 10
    assert picks[200:].count(B) > 20  # B recomputes (224 units a request), A hits (64)
    totals = policy.shares.totals
    assert 0.5 < totals[A] / (totals[A] + totals[B]) < 0.62  # held near balance_limit x the mean


def test_work_shares_report_the_work_past_the_limit() -> None:
    shares = WorkShares(10**9)  # (almost) no decay
    shares.add(A, 30.0)
    shares.add(B, 10.0)
    over = shares.excess([A, B], 1.2)  # mean 20, limit 24
    assert over.keys() == {A} and over[A] == pytest.approx(6.0)
    assert shares.excess([A, B], 1.5) == {}  # A's 30 is within 1.5 x 20


def _past_its_share() -> RoutingPolicy:
    """A policy whose 10 first requests (the warm-up of balance_window 100) all hit on A: A has
    all the work (64 decode units each, decayed by 0.99 a decision), so it is past 1.2 x the mean
    by 0.4 x that (about 245)."""
    policy = RoutingPolicy(dataclasses.replace(CFG, balance_window=100, balance_limit=1.2))
    for _ in range(10):
        assert policy.decide(160, [A, B], [0.0, 0.0], {A: RouteMatch(A, 10, gpu=10)}).worker == A
    assert policy.shares.excess([A, B], 1.2)[A] == pytest.approx(0.4 * 64 * sum(0.99**i for i in range(10)))
    return policy


def test_a_worker_past_its_share_is_left_out_unless_it_holds_the_prefix() -> None:
    """Past its share, A is no candidate for a request it holds nothing of (B wins though B is
    busier); for a request whose prefix it holds it stays, its excess work added to its load
    (about 245): a 10-block prefix (B would recompute 160 tokens at the duplicate price) stays
    on A; a 1-block prefix (16 tokens saved) goes to B, a duplicate that the charge forced, not a
    chosen one."""
    policy = _past_its_share()
    price = policy.duplicate_price
    d = policy.decide(160, [A, B], [0.0, 100.0], {}, learn=False)
    assert d.worker == B and [w for w, _ in d.costs] == [B]
    d = policy.decide(160, [A, B], [0.0, 0.0], {A: RouteMatch(A, 10, gpu=10)}, learn=False)
    assert d.worker == A and d.costs[0][1] == pytest.approx(policy.shares.excess([A, B], 1.2)[A])
    d = policy.decide(160, [A, B], [0.0, 0.0], {A: RouteMatch(A, 1, gpu=1)})
    assert d.worker == B and d.cached_blocks == 0 and d.duplicated == 0
    assert policy.duplicate_price < price  # the forced duplicate did not raise the price


def test_a_duplicate_the_charge_did_not_force_still_raises_the_price() -> None:
    """A past its share holds a 1-block prefix but is also far busier than B: B would win even
    without A's charge, so the duplicate is a chosen one and raises the price."""
    policy = _past_its_share()
    price = policy.duplicate_price
    d = policy.decide(160, [A, B], [400.0, 0.0], {A: RouteMatch(A, 1, gpu=1)})
    assert d.worker == B and d.duplicated == 1
    assert policy.duplicate_price > price


def test_recent_work_decays_over_its_window() -> None:
    recent = RecentWork(2.0)
    recent.add(A, 5.0)  # no clock yet: nothing kept
    assert recent.stored == {} and recent.totals() == {}
    recent.advance(10.0)
    recent.add(A, 100.0)
    recent.advance(12.0)
    recent.add(B, 10.0)
    assert recent.totals() == pytest.approx({A: 100.0 / math.e, B: 10.0})
    recent.advance(11.0)  # an earlier time changes nothing
    assert recent.totals() == pytest.approx({A: 100.0 / math.e, B: 10.0})
    assert recent.stored[A] * recent.factor() == pytest.approx(100.0 / math.e)
    recent.advance(1000.0)  # decayed to nothing: forgotten when the stored values are rebased
    assert recent.totals() == {} and recent.stored == {}
    recent.add(A, 1.0)
    recent.advance(1001.0)
    assert recent.totals() == pytest.approx({A: math.exp(-0.5)})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 30.0), st.sampled_from([A, B]), st.floats(0.0, 1e4)), max_size=40))
def test_recent_work_matches_the_direct_sum(adds: list[tuple[float, WorkerId, float]]) -> None:
    """Against the definition: each worker's total is the sum of work x exp(-age / window)."""
    recent, now, kept = RecentWork(0.5), 0.0, []
    for dt, worker, work in adds:
        now += dt
        recent.advance(now)
        recent.add(worker, work)
        kept.append((now, worker, work))
        want = {w: sum(x * math.exp((t - now) / 0.5) for t, v, x in kept if v == w) for w in (A, B)}
        got = recent.totals()
        for w in (A, B):
            assert got.get(w, 0.0) == pytest.approx(want[w], rel=1e-9, abs=2e-6)


def test_work_just_routed_to_a_worker_is_charged_to_it() -> None:
    """A decision charges each worker ``recent_weight`` x the work routed to it over about the
    last ``recent_window_s`` seconds, decayed to ``now`` or else to the policy's clock."""
    clock = [0.0]
    policy = RoutingPolicy(RECENT, clock=lambda: clock[0])
    d = policy.decide(1000, [A, B], [0.0, 100.0], {}, decode_work=0.0)
    assert d.worker == A and policy.recent.totals() == {A: 1000.0}
    # 0.1 s later A's reported load is still the lower, but the 1000 units just routed there count
    clock[0] = 0.1
    d = policy.decide(160, [A, B], [0.0, 100.0], {}, decode_work=0.0, learn=False)
    charge = RECENT.recent_weight * 1000.0 * math.exp(-0.1 / RECENT.recent_window_s)
    assert d.worker == B and dict(d.costs)[A] == pytest.approx(160 + charge)
    # much later (passed as now) the work has decayed away
    assert policy.decide(160, [A, B], [0.0, 100.0], {}, now=60.0, learn=False).worker == A
    pulls = RoutingPolicy(dataclasses.replace(RECENT, allow_pulls=True), clock=lambda: 0.0)
    for _ in range(3):  # with pulls no charge: a burst spreads by pulling
        assert pulls.decide(1000, [A, B], [0.0, 100.0], {}, decode_work=0.0).worker == A
    assert pulls.recent.totals() == {}


def test_the_load_guard_judges_the_reported_loads_not_the_charges() -> None:
    """A burst just routed to the prefix holder charges it past the guard's slack; it stays a
    candidate (the charge is weighed against the recompute), while a reported load past the slack
    still leaves it out."""
    policy = RoutingPolicy(RECENT)
    for i in range(20):  # 20 x 1000 units routed to A within 20 ms
        policy.decide(1000, [A], [0.0], {}, decode_work=0.0, now=i * 0.001)
    assert policy.prices().slack < RECENT.recent_weight * sum(policy.recent.totals().values())
    held = {A: RouteMatch(A, 60, gpu=60)}
    d = policy.decide(1000, [A, B], [0.0, 0.0], held, now=0.02, learn=False)
    assert A in dict(d.costs)
    d = policy.decide(1000, [A, B], [1e6, 0.0], held, now=0.02, learn=False)
    assert d.worker == B and A not in dict(d.costs)

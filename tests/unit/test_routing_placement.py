"""Where cold requests go (raykv.routing.placement): the worker sent the fewest new blocks lately,
among those near the cheapest, once the cheapest worker's cache is full."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.placement import ColdPlacement
from raykv.routing.policy import DEFAULT_ROUTING, Decision, RoutingConfig

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
TPB = 16
# placement alone: no recent-work charge, no balance rule within these short runs
CFG = dataclasses.replace(DEFAULT_ROUTING, tokens_per_block=TPB, recent_weight=0.0, balance_window=10**6)
CAPACITY = 20  # blocks per worker


def policy_with_capacity(
    cfg: RoutingConfig = CFG, workers: tuple[WorkerId, ...] = (A, B, C)
) -> RoutingPolicy:
    policy = RoutingPolicy(cfg)
    for w in workers:
        policy.observe_capacity(w, CAPACITY)
    return policy


def fill(policy: RoutingPolicy, worker: WorkerId, blocks: int) -> None:
    """Route ``blocks`` new blocks to ``worker`` (it alone idle, nothing cached)."""
    loads = [0.0 if w == worker else 1e9 for w in (A, B, C)]
    d = policy.decide(blocks * TPB, [A, B, C], loads, {})
    assert d.worker == worker


def test_a_cold_request_leaves_a_full_worker_for_the_one_sent_least_new_content() -> None:
    policy = policy_with_capacity()
    fill(policy, A, 30)  # A is full (30 >= 20 blocks sent)
    fill(policy, B, 10)
    fill(policy, C, 2)
    # A is the cheapest by a little (within 0.2 x the prefill); C was sent the fewest new blocks
    d = policy.decide(8 * TPB, [A, B, C], [0.0, 5.0, 10.0], {})
    assert d.worker == C and d.cached_blocks == 0 and d.duplicated == 0
    assert policy.placement.moved == 1
    assert dict(d.costs)[C] == d.cost  # the cost reported is the new worker's


def test_nothing_moves_before_capacities_are_reported_or_while_the_cheapest_has_room() -> None:
    unaware = RoutingPolicy(CFG)
    fill(unaware, A, 30)
    assert unaware.decide(8 * TPB, [A, B, C], [0.0, 5.0, 10.0], {}).worker == A
    roomy = policy_with_capacity()
    fill(roomy, A, 10)  # 10 of A's 20 blocks: evicting nothing yet
    assert roomy.decide(8 * TPB, [A, B, C], [0.0, 5.0, 10.0], {}).worker == A
    assert unaware.placement.moved == roomy.placement.moved == 0


def test_only_workers_within_the_margin_are_considered() -> None:
    policy = policy_with_capacity()
    fill(policy, A, 30)
    fill(policy, B, 10)
    prompt = 8 * TPB
    far = CFG.place_margin * prompt + 1.0  # C is idle but costs more than the margin allows
    d = policy.decide(prompt, [A, B, C], [0.0, 5.0, far], {})
    assert d.worker == B


def test_requests_with_a_cached_prefix_or_little_new_content_stay_where_the_cost_puts_them() -> None:
    policy = policy_with_capacity()
    fill(policy, A, 30)
    held = {A: RouteMatch(A, 3, gpu=3)}  # more than cold_blocks (2) cached on A
    assert policy.decide(10 * TPB, [A, B, C], [0.0, 5.0, 10.0], held).worker == A
    small = (2 * CFG.cold_blocks - 1) * TPB  # fewer new blocks than 2 x cold_blocks
    assert policy.decide(small, [A, B, C], [0.0, 5.0, 10.0], {}).worker == A
    pulls = policy_with_capacity(dataclasses.replace(CFG, allow_pulls=True))
    fill(pulls, A, 30)
    assert pulls.decide(8 * TPB, [A, B, C], [0.0, 5.0, 10.0], {}).worker == A


def test_a_small_cached_prefix_moves_with_the_request_and_is_reported() -> None:
    policy = policy_with_capacity()
    fill(policy, A, 30)
    fill(policy, C, 2)
    held = {A: RouteMatch(A, 1, gpu=1), C: RouteMatch(C, 1, gpu=1)}
    d = policy.decide(8 * TPB, [A, B, C], [0.0, 5.0, 6.0], held)
    assert (d.worker, d.cached_blocks) == (C, 1)


def test_a_margin_of_zero_turns_the_rule_off_and_bad_parameters_are_refused() -> None:
    policy = policy_with_capacity(dataclasses.replace(CFG, place_margin=0.0))
    fill(policy, A, 30)
    assert policy.decide(8 * TPB, [A, B, C], [0.0, 5.0, 10.0], {}).worker == A
    for bad in (
        {"place_margin": -0.1},
        {"place_window": math.inf},
        {"cold_blocks": -1},
        {"cold_blocks": 1.5},
    ):
        with pytest.raises(InvalidArgumentError):
            dataclasses.replace(CFG, **bad)
    with pytest.raises(InvalidArgumentError):
        RoutingPolicy(CFG).observe_capacity(A, -1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(1, 400)), min_size=1, max_size=60),
    st.sampled_from([1, CAPACITY]),
)
def test_recent_counts_decay_over_the_window_like_the_direct_sum(
    adds: list[tuple[WorkerId, int]], capacity: int
) -> None:
    """Each worker's count is its new blocks, each decayed by exp(-(blocks sent after it) /
    window), window = place_window x total capacity (compared up to the shared scale, which a
    capacity of 1 makes overflow and renormalise)."""
    placement = ColdPlacement(CFG)
    for w in (A, B, C):
        placement.observe_capacity(w, capacity)
    window = CFG.place_window * 3 * capacity
    for w, n in adds:
        placement.stored(w, n)
    total = sum(n for _, n in adds)
    direct = dict.fromkeys((A, B, C), 0.0)
    after = total
    for w, n in adds:
        direct[w] += n * math.exp(-(after - n) / window)  # blocks sent after this add (its own count)
        after -= n
    last = adds[-1][0]
    for w in (A, B, C):
        got = placement.recent.get(w, 0.0) / placement.recent[last]
        assert got == pytest.approx(direct[w] / direct[last], rel=1e-9, abs=1e-12)
    assert sum(placement.routed.values()) == total


def test_the_replay_reports_capacities_and_placement_moves_cold_requests() -> None:
    """The replay's raykv router tells its policy the workers' capacities (as a deployment's
    reports do), so the rule is on in the replay."""
    from raykv.replay.routers import RaykvRouter, RouterContext
    from raykv.replay.timing import TimingConfig

    router = RaykvRouter()
    ctx = RouterContext(
        2, [A, B], lambda keys: {}, lambda w, k: None, 1.0, TimingConfig(), 1.0, capacity_blocks=7
    )
    router.start(ctx)
    assert router.policy.placement.capacity == {A: 7, B: 7}
    assert isinstance(router.policy.decide(8 * 512, [A, B], [0.0, 0.0], {}), Decision)

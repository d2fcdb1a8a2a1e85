"""Prefill/decode pairing by cache location (raykv.routing.pd.choose_pair) on hand-built cases."""

from __future__ import annotations

import dataclasses
import random

import pytest

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.pd import PDConfig, choose_pair, pd_policy
from raykv.routing.policy import RoutingConfig, WorkerLoad

P1, P2, D1, D2 = (WorkerId(n) for n in ("p1", "p2", "d1", "d2"))
CFG = PDConfig(RoutingConfig(tokens_per_block=16), transfer_cost=0.1, remote_node_factor=4.0)


def idle(*workers: WorkerId) -> list[WorkerLoad]:
    return [WorkerLoad(w) for w in workers]


def test_prefill_goes_where_the_prefix_is() -> None:
    matches = {P2: RouteMatch(P2, 8, gpu=8)}
    d = choose_pair(160, idle(P1, P2), idle(D1, D2), matches, CFG)
    assert d.prefill == P2 and d.cached_blocks == 8 and d.pull_blocks == 10
    costs = {(p, q): c for p, q, c in d.costs}
    # 8 blocks not prefilled again, and no duplicate of P2's copy (priced at price_start)
    assert costs[(P1, D1)] - costs[(P2, D1)] == pytest.approx(128 * (1 + CFG.routing.price_start))


def test_decode_goes_where_pulling_the_result_is_cheapest() -> None:
    # d2 still holds the first 7 blocks of this conversation (an earlier turn): it pulls 3, d1 10
    matches = {P1: RouteMatch(P1, 10, gpu=10), D2: RouteMatch(D2, 7, host=7)}
    d = choose_pair(160, idle(P1, P2), idle(D1, D2), matches, CFG)
    assert (d.prefill, d.decode, d.pull_blocks) == (P1, D2, 3)
    costs = {(p, q): c for p, q, c in d.costs}
    assert costs[(P1, D1)] - costs[(P1, D2)] == pytest.approx(0.1 * 16 * 7 * 4.0)


def test_a_decode_worker_on_the_prefill_node_pulls_over_the_local_path() -> None:
    nodes = {P1: "n1", P2: "n2", D1: "n2", D2: "n1"}
    matches = {P1: RouteMatch(P1, 10, gpu=10)}
    d = choose_pair(160, idle(P1, P2), idle(D1, D2), matches, CFG, nodes)
    assert (d.prefill, d.decode) == (P1, D2)
    matches = {P2: RouteMatch(P2, 10, gpu=10)}
    assert choose_pair(160, idle(P1, P2), idle(D1, D2), matches, CFG, nodes).decode == D1


def test_busy_decode_workers_and_the_imbalance_guard() -> None:
    matches = {P1: RouteMatch(P1, 10, gpu=10), D1: RouteMatch(D1, 10, gpu=10)}
    busy = [WorkerLoad(D1, running_decodes=50), WorkerLoad(D2)]
    d = choose_pair(160, idle(P1, P2), busy, matches, CFG)
    assert d.decode == D2  # 50 decodes outweigh pulling 10 blocks
    assert D1 in {q for _, q, _ in d.costs}
    busier = [WorkerLoad(D1, running_decodes=100), WorkerLoad(D2)]
    d = choose_pair(160, idle(P1, P2), busier, matches, CFG)
    assert D1 not in {q for _, q, _ in d.costs}  # past the imbalance guard: dropped outright
    hot = [WorkerLoad(P1, queued_prefill_tokens=100_000), WorkerLoad(P2)]
    assert choose_pair(160, hot, idle(D1), matches, CFG).prefill == P2


def test_one_worker_in_both_roles_transfers_nothing() -> None:
    shared = WorkerId("pd")
    matches = {shared: RouteMatch(shared, 4, gpu=4)}
    d = choose_pair(160, idle(shared, P1), idle(shared, D1), matches, CFG)
    assert (d.prefill, d.decode, d.pull_blocks) == (shared, shared, 0)


def test_ties_break_by_seed() -> None:
    picks = {
        (d.prefill, d.decode)
        for d in (
            choose_pair(64, idle(P1, P2), idle(D1, D2), {}, CFG, rng=random.Random(s)) for s in range(40)
        )
    }
    assert len(picks) == 4
    again = {choose_pair(64, idle(P1, P2), idle(D1, D2), {}, CFG, rng=random.Random(3)) for _ in range(3)}
    assert len(again) == 1


def test_the_prefill_side_is_the_routing_policy_and_learns() -> None:
    """Over a random stream of prompts, a proxy's kept policy picks the same prefill workers as
    the same RoutingPolicy deciding alone, and ends with the same learned prices and shares."""
    cfg = PDConfig(dataclasses.replace(CFG.routing, balance_window=50))
    kept, alone = pd_policy(cfg), RoutingPolicy(dataclasses.replace(cfg.routing, allow_pulls=False))
    gen = random.Random(7)
    prefill = [P1, P2, WorkerId("p3")]
    picks = []
    for _ in range(300):
        loads = [WorkerLoad(w, gen.randrange(0, 4000), gen.randrange(0, 6)) for w in prefill]
        matches = {w: RouteMatch(w, gen.randrange(1, 12), gpu=4) for w in gen.sample(prefill, 2)}
        tokens = gen.randrange(16, 400)
        d = choose_pair(tokens, loads, idle(D1, D2), matches, cfg, rng=random.Random(1), policy=kept)
        w = alone.decide(tokens, prefill, [c.tokens(64.0) for c in loads], matches, random.Random(1)).worker
        assert d.prefill == w
        picks.append(w)
    assert kept.decisions == alone.decisions == 300
    assert kept.duplicate_price == alone.duplicate_price != cfg.routing.price_start
    assert kept.shares.totals == alone.shares.totals
    assert len(set(picks)) == 3


def test_a_kept_policy_spreads_prefill_off_a_holder_past_its_share() -> None:
    """P1 holds every prompt and all loads look equal: a fresh policy per pairing always sends
    prefill to P1; the proxy's kept policy starts there, then its recent-work and balance rules give
    P2 work while P1, which recomputes nothing, keeps most of it."""
    cfg = PDConfig(dataclasses.replace(CFG.routing, balance_window=100, price_start=0.5))
    held = {P1: RouteMatch(P1, 10, gpu=10)}
    fresh = {choose_pair(160, idle(P1, P2), idle(D1), held, cfg).prefill for _ in range(50)}
    assert fresh == {P1}
    kept = RoutingPolicy(dataclasses.replace(cfg.routing, allow_pulls=False), clock=lambda: 0.0)
    picks = [choose_pair(160, idle(P1, P2), idle(D1), held, cfg, policy=kept).prefill for _ in range(400)]
    assert picks[0] == P1 and picks.count(P1) > 200
    assert picks[200:].count(P2) > 20


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill": []},
        {"decode": []},
        {"num_tokens": -1},
        {"num_tokens": True},
    ],
)
def test_bad_arguments(kwargs: dict) -> None:
    args = {"num_tokens": 16, "prefill": idle(P1), "decode": idle(D1), "matches": {}}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError):
        choose_pair(**args)


@pytest.mark.parametrize("field,value", [("transfer_cost", -1.0), ("remote_node_factor", 0.5)])
def test_bad_config(field: str, value: float) -> None:
    with pytest.raises(InvalidArgumentError):
        PDConfig(**{field: value})

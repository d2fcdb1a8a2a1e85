"""The pure routing cost model on hand-built cases (at fixed prices; the learned prices are
tested in test_routing_adaptive.py)."""

from __future__ import annotations

import random

import pytest

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.policy import Prices, RoutingConfig, WorkerLoad, choose, choose_loads

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
CFG = RoutingConfig(tokens_per_block=16, price_start=0.0)  # estimated TTFT alone


def loads(**queued: int) -> list[WorkerLoad]:
    return [WorkerLoad(WorkerId(w), q) for w, q in queued.items()]


def test_longest_gpu_prefix_wins_when_idle() -> None:
    matches = {A: RouteMatch(A, 2, gpu=2), B: RouteMatch(B, 6, gpu=6)}
    d = choose(160, loads(a=0, b=0, c=0), matches, CFG)
    assert d.worker == B and d.cached_blocks == 6 and d.pull_from is None
    costs = dict(d.costs)
    assert costs[B] == pytest.approx(160 - 96) and costs[A] == pytest.approx(160 - 32)
    assert costs[C] == pytest.approx(160)
    # at the default price a block that B holds and A recomputes costs 1 + 4 times its prefill
    costs = dict(choose(160, loads(a=0, b=0, c=0), matches, RoutingConfig(tokens_per_block=16)).costs)
    assert costs[A] == pytest.approx(160 - 32 + 4 * 16 * 4) and costs[C] == pytest.approx(160 + 4 * 96)
    assert costs[B] == pytest.approx(160 - 96)


def test_a_duplicate_is_counted_and_priced() -> None:
    matches = {A: RouteMatch(A, 6, gpu=6)}
    d = choose_loads(160, [A, B], [200.0, 0.0], matches, CFG)
    assert d.worker == B and d.duplicated == 6 and d.pull_blocks == 0  # 160 < 200 + 64
    priced = choose_loads(160, [A, B], [200.0, 0.0], matches, CFG, prices=Prices(2.0, 0.5, 1e9))
    assert priced.worker == A and priced.duplicated == 0  # 200 + 64 < 160 + 2 * 96
    assert dict(priced.costs)[B] == pytest.approx(160 + 2 * 96)


def test_tier_weights_lower_the_credit_of_cold_blocks() -> None:
    cfg = RoutingConfig(tokens_per_block=16, w_disk=0.25, price_start=0.0)
    matches = {A: RouteMatch(A, 4, gpu=4), B: RouteMatch(B, 5, disk=5)}
    d = choose(160, loads(a=0, b=0), matches, cfg)
    assert d.worker == A  # 4 GPU blocks (64 tokens) beat 5 disk blocks credited at 20 tokens
    assert dict(d.costs)[B] == pytest.approx(160 - 16 * 5 * 0.25)


def test_load_outweighs_a_small_overlap() -> None:
    matches = {A: RouteMatch(A, 1, gpu=1)}
    d = choose(160, loads(a=500, b=0), matches, CFG)
    assert d.worker == B


def test_imbalance_guard_excludes_overloaded_holder() -> None:
    cfg = RoutingConfig(tokens_per_block=16, imbalance_factor=2.0, imbalance_slack=100.0, price_start=0.0)
    matches = {A: RouteMatch(A, 100, gpu=100)}  # A would win on cost despite its queue
    d = choose(1600, loads(a=1000, b=10), matches, cfg)
    assert d.worker == B
    assert A not in dict(d.costs)


def test_pull_credit_names_the_holder() -> None:
    cfg = RoutingConfig(tokens_per_block=16, allow_pulls=True, w_remote=0.5)
    matches = {A: RouteMatch(A, 8, gpu=8)}
    d = choose(160, loads(a=10_000, b=0), matches, cfg)
    assert d.worker == B and d.pull_from == A and d.pull_blocks == 8 and d.duplicated == 0
    assert dict(d.costs)[B] == pytest.approx(160 - 16 * 8 * 0.5)


def test_ties_break_deterministically_by_seed() -> None:
    picks = {choose(64, loads(a=0, b=0, c=0), {}, CFG, random.Random(s)).worker for s in range(30)}
    assert picks == {A, B, C}
    again = [choose(64, loads(a=0, b=0, c=0), {}, CFG, random.Random(5)).worker for _ in range(3)]
    assert len(set(again)) == 1


def test_predicted_blocks_count_like_gpu_by_default() -> None:
    matches = {A: RouteMatch(A, 3, predicted=3), B: RouteMatch(B, 2, gpu=2)}
    assert choose(160, loads(a=0, b=0), matches, CFG).worker == A


def test_equal_weights_make_the_cost_the_estimated_ttft() -> None:
    # A FIFO worker first works off its queue, then prefills what it lacks: with prefill_cost 1
    # and no duplicate price the cost is that time in tokens, so a busy holder loses to an idle worker.
    cfg = RoutingConfig(tokens_per_block=16, price_start=0.0, imbalance_slack=1e9)
    matches = {A: RouteMatch(A, 4, gpu=4)}
    d = choose(160, loads(a=500, b=0), matches, cfg)
    assert d.worker == B and dict(d.costs) == {A: pytest.approx(500 + 96), B: pytest.approx(160)}
    # A duplicate priced at 9x its prefill keeps the prefix on its holder (TTFT 596 there, not 160).
    sticky = RoutingConfig(tokens_per_block=16, price_start=9.0, imbalance_slack=1e9)
    assert choose(160, loads(a=500, b=0), matches, sticky).worker == A


@pytest.mark.parametrize(
    "field,value",
    [
        ("w_gpu", 1.5),
        ("w_host", -0.1),
        ("prefill_cost", float("nan")),
        ("imbalance_factor", 0.5),
        ("hot_price", -1.0),
        ("recompute_budget", 0.0),
        ("price_start", 100.0),
        ("tokens_per_block", 0),
    ],
)
def test_bad_config_is_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError):
        RoutingConfig(**{field: value})  # type: ignore[arg-type]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(InvalidArgumentError):
        choose(10, [], {}, CFG)


def _reference_costs(
    num_tokens: int, ls: list[float], matches: dict[WorkerId, RouteMatch], cfg: RoutingConfig
) -> dict[WorkerId, float]:
    """The module docstring's formula, written plainly."""
    floor = min(ls)
    limit = max(floor, cfg.imbalance_factor * floor + cfg.imbalance_slack)
    best = max((m.blocks for m in matches.values()), default=0)
    out = {}
    for w, load in zip([A, B, C], ls):
        if load > limit:
            continue
        m = matches.get(w, RouteMatch(w, 0))
        other = best - m.blocks if best > m.blocks else 0  # blocks another worker holds
        credit = cfg.w_gpu * m.gpu + cfg.w_host * m.host + cfg.w_disk * m.disk + cfg.w_predicted * m.predicted
        if cfg.allow_pulls:  # pulled: credited w_remote of their prefill
            left = num_tokens - cfg.tokens_per_block * (credit + cfg.w_remote * other)
            out[w] = cfg.prefill_cost * max(0.0, left) + load
        else:  # recomputed, plus the duplicate's price
            left = num_tokens - cfg.tokens_per_block * credit
            out[w] = cfg.prefill_cost * max(0.0, left) + cfg.price_start * cfg.tokens_per_block * other + load
    return out


def test_costs_follow_the_documented_formula() -> None:
    rng = random.Random(3)
    for _ in range(500):
        cfg = RoutingConfig(
            tokens_per_block=16,
            allow_pulls=rng.random() < 0.5,
            w_remote=rng.random(),
            price_start=rng.choice([0.0, 4.0]),
            imbalance_slack=rng.choice([0.0, 500.0]),
        )
        matches: dict[WorkerId, RouteMatch] = {}
        for w in (A, B, C):
            if rng.random() < 0.6:
                gpu, host, disk = rng.randrange(4), rng.randrange(4), rng.randrange(4)
                matches[w] = RouteMatch(w, gpu + host + disk + 1, gpu, host, disk, 1)
        ls = [rng.choice([0.0, rng.random() * 1000]) for _ in range(3)]
        d = choose_loads(200, [A, B, C], ls, matches, cfg, random.Random(0))
        ref = _reference_costs(200, ls, matches, cfg)
        assert dict(d.costs) == pytest.approx(ref)
        assert ref[d.worker] == pytest.approx(min(ref.values()))

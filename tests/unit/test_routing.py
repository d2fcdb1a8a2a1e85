"""The pure routing cost model on hand-built cases."""

from __future__ import annotations

import random

import pytest

from raykv.errors import InvalidArgumentError
from raykv.index import RouteMatch
from raykv.routing import RoutingConfig, WorkerLoad, choose
from raykv.types import WorkerId

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
CFG = RoutingConfig(tokens_per_block=16)


def loads(**queued: int) -> list[WorkerLoad]:
    return [WorkerLoad(WorkerId(w), q) for w, q in queued.items()]


def test_longest_gpu_prefix_wins_when_idle() -> None:
    matches = {A: RouteMatch(A, 2, gpu=2), B: RouteMatch(B, 6, gpu=6)}
    d = choose(160, loads(a=0, b=0, c=0), matches, CFG)
    assert d.worker == B and d.cached_blocks == 6 and d.pull_from is None
    costs = dict(d.costs)
    assert costs[B] == pytest.approx(160 - 96) and costs[A] == pytest.approx(160 - 32)
    assert costs[C] == pytest.approx(160)


def test_tier_weights_lower_the_credit_of_cold_blocks() -> None:
    cfg = RoutingConfig(tokens_per_block=16, w_disk=0.25)
    matches = {A: RouteMatch(A, 4, gpu=4), B: RouteMatch(B, 5, disk=5)}
    d = choose(160, loads(a=0, b=0), matches, cfg)
    assert d.worker == A  # 4 GPU blocks (64 tokens) beat 5 disk blocks credited at 20 tokens
    assert dict(d.costs)[B] == pytest.approx(160 - 16 * 5 * 0.25)


def test_load_outweighs_a_small_overlap() -> None:
    matches = {A: RouteMatch(A, 1, gpu=1)}
    d = choose(160, loads(a=500, b=0), matches, CFG)
    assert d.worker == B


def test_imbalance_guard_excludes_overloaded_holder() -> None:
    cfg = RoutingConfig(tokens_per_block=16, imbalance_factor=2.0, imbalance_slack=100.0)
    matches = {A: RouteMatch(A, 100, gpu=100)}  # A would win on cost despite its queue
    d = choose(1600, loads(a=1000, b=10), matches, cfg)
    assert d.worker == B
    assert A not in dict(d.costs)


def test_pull_credit_names_the_holder() -> None:
    cfg = RoutingConfig(tokens_per_block=16, allow_pulls=True, w_remote=0.5)
    matches = {A: RouteMatch(A, 8, gpu=8)}
    d = choose(160, loads(a=10_000, b=0), matches, cfg)
    assert d.worker == B and d.pull_from == A and d.pull_blocks == 8
    assert dict(d.costs)[B] == pytest.approx(160 - 16 * 8 * 0.5)


def test_ties_break_deterministically_by_seed() -> None:
    picks = {choose(64, loads(a=0, b=0, c=0), {}, CFG, random.Random(s)).worker for s in range(30)}
    assert picks == {A, B, C}
    again = [choose(64, loads(a=0, b=0, c=0), {}, CFG, random.Random(5)).worker for _ in range(3)]
    assert len(set(again)) == 1


def test_predicted_blocks_count_like_gpu_by_default() -> None:
    matches = {A: RouteMatch(A, 3, predicted=3), B: RouteMatch(B, 2, gpu=2)}
    assert choose(160, loads(a=0, b=0), matches, CFG).worker == A


@pytest.mark.parametrize(
    "field,value",
    [
        ("w_gpu", 1.5),
        ("w_host", -0.1),
        ("prefill_cost", float("nan")),
        ("imbalance_factor", 0.5),
        ("tokens_per_block", 0),
    ],
)
def test_bad_config_is_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError):
        RoutingConfig(**{field: value})  # type: ignore[arg-type]


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(InvalidArgumentError):
        choose(10, [], {}, CFG)

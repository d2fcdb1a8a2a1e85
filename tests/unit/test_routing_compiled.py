"""The compiled decision loop (raykv.native._cost) gives decide_at_py's Decision, float for float,
and draws from the RNG exactly as it does, on random candidates, matches, prices and configs."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from raykv import native
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing import policy
from raykv.routing.policy import DEFAULT_ROUTING, Charges, Prices, decide_at_py

compiled = pytest.mark.skipif(native.load("_cost") is None, reason="raykv.native._cost was not built")


def _case(rng: random.Random):
    n = rng.choice((1, 2, 3, 8, 8, 16))
    workers = [WorkerId(f"w{i}") for i in range(n)]
    loads: list[float] = [
        rng.choice((0.0, 0, 100.0, rng.uniform(0, 5000), rng.randrange(0, 3000), math.inf)) for _ in workers
    ]
    if all(x == math.inf for x in loads):
        loads[0] = 0.0
    tpb = rng.choice((1, 16, 512))
    matches = {}
    for w in rng.sample(workers, rng.randrange(0, n + 1)):
        blocks = rng.randrange(1, 40)
        gpu = rng.randrange(0, blocks + 1)
        host = rng.randrange(0, blocks - gpu + 1)
        disk = blocks - gpu - host
        matches[w] = RouteMatch(w, blocks, gpu, host, disk, rng.choice((0, 0, 2)))
    cfg = dataclasses.replace(
        DEFAULT_ROUTING,
        tokens_per_block=tpb,
        allow_pulls=rng.random() < 0.5,
        w_host=rng.choice((0.9, 1.0)),
        imbalance_factor=rng.choice((1.0, 1.5)),
        prefill_cost=rng.choice((1.0, 0.7)),
    )
    prices = Prices(
        rng.choice((0.0, 4.0, rng.uniform(0, 64))), rng.uniform(0, 1), rng.choice((math.inf, 4096.0, 0.0))
    )
    return rng.randrange(0, 45 * tpb), workers, loads, matches, cfg, prices


def _charges(rng: random.Random, workers: list[WorkerId]) -> Charges | None:
    """None, or totals for some of ``workers`` (and one stranger), a scale, a holder and excess."""
    if rng.random() < 0.25:
        return None
    totals = {
        w: rng.choice((0.0, rng.uniform(0, 1e4)))
        for w in rng.sample(workers, rng.randrange(len(workers) + 1))
    }
    totals[WorkerId("not-a-candidate")] = 5.0
    holder = rng.choice((None, rng.choice(workers)))
    return Charges(totals, rng.choice((0.0, rng.uniform(0, 2), 1e-9)), holder, rng.uniform(0, 3000))


@compiled
@pytest.mark.parametrize("seed", range(8))
def test_compiled_decision_equals_python(seed):
    rng = random.Random(seed)
    for _ in range(400):
        num_tokens, workers, loads, matches, cfg, prices = _case(rng)
        charges = _charges(rng, workers)
        fast_rng, slow_rng = random.Random(seed), random.Random(seed)
        fast = policy.decide_at(num_tokens, workers, loads, matches, cfg, prices, fast_rng, charges)
        slow = decide_at_py(num_tokens, workers, loads, matches, cfg, prices, slow_rng, charges)
        assert fast == slow and type(fast) is type(slow)
        assert [type(c[1]) for c in fast.costs] == [type(c[1]) for c in slow.costs]
        assert fast_rng.random() == slow_rng.random()  # the same draws
        assert policy.decide_at(num_tokens, workers, loads, matches, cfg, prices, None) == decide_at_py(
            num_tokens, workers, loads, matches, cfg, prices, None
        )


@compiled
def test_other_argument_kinds_take_the_python_loop():
    """Tuples for lists, a mapping that is no dict: the Python loop answers (the same answer)."""
    w = [WorkerId("a"), WorkerId("b")]
    m = {w[0]: RouteMatch(w[0], 3, 3)}
    cfg, prices = DEFAULT_ROUTING, Prices(4.0, 0.5, math.inf)
    want = decide_at_py(100, w, [0.0, 0.0], m, cfg, prices, random.Random(1))
    assert policy.decide_at(100, tuple(w), (0.0, 0.0), m, cfg, prices, random.Random(1)) == want

    class Matches(dict):  # a dict subclass: not the exact dict the compiled loop reads
        pass

    assert policy.decide_at(100, w, [0.0, 0.0], Matches(m), cfg, prices, random.Random(1)) == want
    with pytest.raises(ValueError):
        policy.decide_at(100, [], [], m, cfg, prices, None)  # no candidate: min() of nothing, as before
    ints = Charges({w[0]: 7}, 1.0, None, 0.0)  # totals that are not floats: the Python loop
    want = decide_at_py(100, w, [0.0, 0.0], m, cfg, prices, random.Random(1), ints)
    assert policy.decide_at(100, w, [0.0, 0.0], m, cfg, prices, random.Random(1), ints) == want


@compiled
def test_charges_add_after_the_load_guard():
    """A charge no load guard sees: a worker charged past the guard's limit is still scored (its
    cost includes the charge), while a load past it leaves the worker out."""
    w = [WorkerId("a"), WorkerId("b")]
    cfg, prices = DEFAULT_ROUTING, Prices(4.0, 0.5, 100.0)
    m = {w[0]: RouteMatch(w[0], 3, 3)}
    for decide in (policy.decide_at, decide_at_py):
        d = decide(100, w, [0.0, 0.0], m, cfg, prices, None, Charges({w[0]: 1000.0}, 2.0, w[1], 5.0))
        # a: 52 tokens to prefill + 2 x 1000; b: 52 + 3 blocks x 16 x (1 + 4) recomputed + 5
        assert dict(d.costs) == {w[0]: 52.0 + 2000.0, w[1]: 52.0 + 240.0 + 5.0}
        d = decide(100, w, [1000.0, 0.0], m, cfg, prices, None, Charges({}, 0.0, None, 0.0))
        assert d.worker == w[1] and w[0] not in dict(d.costs)

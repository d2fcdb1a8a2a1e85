"""RaykvConnector across engines: a fresh engine reuses what another stored (through the index
and a worker-to-worker pull), prefill/decode disaggregation with the pair chosen by
raykv.routing.pd, and peers that fail while the pull runs; then engines of other kinds, each in a
deployment laid out for it: tensor parallel, an fp8 KV cache, MLA (DeepSeek-style, checked
against vLLM's own ExampleConnector), and sliding-window layers beside full ones.

Blocks held by another worker than the engine's own come through vLLM's asynchronous loads: the
request waits in WAITING_FOR_REMOTE_KVS while the paired worker pulls them, and the engine goes
on with other work. Outputs are compared bit for bit with the ``baseline`` engine (no connector).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

import ray  # noqa: E402

from actors.cache.cluster import RayKVCluster  # noqa: E402
from raykv import ReuseScope, TierKind, block_keys  # noqa: E402
from raykv.integrations.vllm.plan import rank_scope  # noqa: E402
from raykv.integrations.vllm.testing import generate  # noqa: E402
from raykv.routing.pd import PDConfig, choose_pair  # noqa: E402
from raykv.routing.policy import RoutingConfig, WorkerLoad  # noqa: E402

from .helpers import (  # noqa: E402
    TPB,
    engine_model,
    engine_on,
    held,
    prompt,
    usable_blocks,
    wait_held,
    worker,
)

ENGINE_B_TIMEOUT_S = 4.0  # engine_b's timeout_s (conftest)


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
    assert got.raykv["async_loads"] == 1 and "load_errors" not in got.raykv
    assert held(deployment, 1, tokens).num_blocks >= usable_blocks(tokens)  # worker 1 pulled them
    _same(got, generate(baseline, tokens))


@pytest.mark.timeout(600)
def test_stores_past_a_full_inbox_are_counted_and_offered_again(
    baseline: Any, model_dir: str, deployment: RayKVCluster, ray_address: str
) -> None:
    """Backpressure, not silent drops: an engine whose inbox holds 2 pages stores a 6-block
    prompt while its worker is stopped (SIGSTOP: nothing is committed, no slot comes free). The
    2 blocks that fit wait in the inbox; the other 4 are counted as store_backpressure_blocks in
    the request's results. Once the worker runs again, the 2 are committed, and the same prompt
    again loads them and stores the 4 others: the worker holds all 6, and every output equals
    the no-connector engine's."""
    import os
    import signal

    from vllm import LLM

    from raykv.integrations.vllm import testing

    page = deployment.config.layout.page_bytes
    kwargs = testing.engine_kwargs(model_dir)
    kwargs["kv_transfer_config"] = testing.connector_config(
        deployment.namespace, ray_address, worker=1, inbox_bytes=2 * page, timeout_s=2.0
    )
    llm = LLM(**kwargs)
    tokens = prompt(47, 6 * TPB + 3)
    pid = int(ray.get(worker(deployment, 1).status.remote(), timeout=30)["pid"])
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            first = generate(llm, tokens, max_tokens=4)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert first.raykv["staged_blocks"] == 2
        assert first.raykv["store_backpressure_blocks"] >= 4  # offered again each step, counted
        wait_held(deployment, 1, tokens, 2)
        again = generate(llm, tokens, max_tokens=4)
        assert again.raykv["loaded_blocks_ok"] == 2 and again.raykv["staged_blocks"] == 4
        wait_held(deployment, 1, tokens, 6)
        want = generate(baseline, tokens, max_tokens=4)
        _same(first, want)
        _same(again, want)
    finally:
        testing.shutdown_engine(llm)


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
    assert out.raykv["async_loads"] == 1 and "load_errors" not in out.raykv
    assert held(deployment, 1, tokens).num_blocks >= usable_blocks(tokens)


def test_peer_failing_during_the_async_pull_is_recomputed(
    baseline: Any, engine_a: Any, engines: Callable[[str], Any], deployment: RayKVCluster
) -> None:
    """Worker 0's page server drops every pull after its header while engine B's worker pulls
    from it: the async load reports every block lost and vLLM recomputes them, exactly."""
    tokens = prompt(71, 224)
    generate(engine_a, tokens)
    wait_held(deployment, 0, tokens, len(tokens) // TPB)
    # fill worker 0's host tier: the prompt's blocks go to disk, which a pull reads through the
    # page server (pages in the shared host tier would be read one-sided, past the fault hook)
    for r in range(3):
        filler = [200_000 + r * 10_000 + i for i in range(32 * TPB)]
        ray.get(worker(deployment, 0).run_request.remote(filler), timeout=60)
    assert TierKind.DISK in held(deployment, 0, tokens).tiers
    deployment.flush()
    ray.get(worker(deployment, 0).set_transfer_faults.remote(drop_after_header=True), timeout=30)
    try:
        got = generate(engines("engine_b"), tokens)
    finally:
        ray.get(worker(deployment, 0).set_transfer_faults.remote(drop_after_header=False), timeout=30)
    n = usable_blocks(tokens)
    assert got.raykv["hit_blocks"] == got.raykv["loaded_blocks"] == got.raykv["load_errors"] == n
    assert got.raykv["async_loads"] == 1 and got.raykv.get("loaded_blocks_ok", 0) == 0
    assert held(deployment, 1, tokens).num_blocks == 0
    _same(got, generate(baseline, tokens))


def test_producer_blocks_that_never_arrive_are_recomputed(
    baseline: Any, engines: Callable[[str], Any], deployment: RayKVCluster
) -> None:
    """A producer's hint names blocks worker 0 never gets (the producer died before storing
    them): engine B's request waits in the background until its fetch times out, then every
    block is recomputed, exactly."""
    tokens = prompt(81, 200)
    hint = {"raykv": {"worker": str(deployment.worker_ids[0]), "blocks": len(tokens) // TPB}}
    got = generate(engines("engine_b"), tokens, params=hint)
    n = usable_blocks(tokens)
    assert got.raykv["hit_blocks"] == got.raykv["load_errors"] == n
    assert got.raykv["async_loads"] == 1 and got.raykv["fetch_us"] >= ENGINE_B_TIMEOUT_S * 1e6
    _same(got, generate(baseline, tokens))


def test_request_aborted_while_its_async_load_waits_frees_its_blocks(
    baseline: Any, engines: Callable[[str], Any], deployment: RayKVCluster
) -> None:
    """A request waiting in WAITING_FOR_REMOTE_KVS (its producer's blocks never come) is aborted:
    the connector releases it in the next step (vLLM frees its blocks only once the worker side
    reports it received), long before its fetch would time out, and the engine goes on exactly.
    ``reset_prefix_cache`` succeeds only while no engine block is in use."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engines("engine_b")
    tokens = prompt(91, 200)
    hint = {"raykv": {"worker": str(deployment.worker_ids[0]), "blocks": len(tokens) // TPB}}
    sampling = SamplingParams(max_tokens=4, temperature=0.0, extra_args={"kv_transfer_params": hint})
    llm.llm_engine.add_request("waits", TokensPrompt(prompt_token_ids=tokens), sampling)
    deadline = time.monotonic() + ENGINE_B_TIMEOUT_S / 2
    while llm.reset_prefix_cache():  # until it is admitted: blocks allocated, waiting for its KV
        assert time.monotonic() < deadline, "the request never waited for its KV"
        time.sleep(0.02)
    llm.llm_engine.abort_request(["waits"])
    aborted = time.monotonic()
    while not llm.reset_prefix_cache():
        assert time.monotonic() - aborted < ENGINE_B_TIMEOUT_S / 2, "its blocks are still held"
        time.sleep(0.05)
    other = prompt(92, 150)
    _same(generate(llm, other), generate(baseline, other))


@pytest.mark.timeout(600)
def test_a_tensor_parallel_engine_loads_each_ranks_own_heads(
    model_dir: str, ray_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP=2 engine: each rank holds one of the model's two KV heads and keeps pages of its own
    (rank 1's keys in a derived scope), in a deployment laid out for one rank's heads. A repeat
    of a prompt loads its blocks on both ranks from the paired worker and generates exactly
    what the first run computed (before ranks had pages of their own, rank 1 loaded rank 0's
    heads and the repeat generated other tokens); once only the other worker holds them, the
    paired worker fetches both ranks' pages from it (an asynchronous load), same output."""
    from raykv.integrations.vllm import testing

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node here)
    layout = testing.tiny_layout(num_key_value_heads=1)
    with engine_on(layout, 2, model_dir, ray_address, 1, tensor_parallel_size=2) as (one_rank, llm):
        tokens = prompt(41, 3 * TPB + 5)
        first = generate(llm, tokens)
        assert first.raykv.get("staged_blocks") == 3  # rank 0's figures: its 3 blocks
        scopes = [rank_scope(ReuseScope(), rank, 2) for rank in (0, 1)]
        for scope in scopes:  # each rank's pages reach the paired worker
            wait_held(one_rank, 1, tokens, 3, scope, timeout=30)
        again = generate(llm, tokens)
        assert again.raykv["loaded_blocks_ok"] == 3 and again.raykv.get("load_errors", 0) == 0
        _same(again, first)

        paired, other = worker(one_rank, 1), worker(one_rank, 0)
        model = engine_model(one_rank)
        for scope in scopes:  # only worker 0 holds them now
            keys = [bytes(k) for k in block_keys(tokens[: 3 * TPB], TPB, scope.with_model(model))]
            assert len(ray.get(other.pull.remote(one_rank.worker_ids[1], keys), timeout=30).imported) == 3
        ray.get(paired.clear.remote(), timeout=30)
        one_rank.flush()  # the index knows worker 0 holds them, worker 1 not
        fetched = generate(llm, tokens)
        assert fetched.raykv["async_loads"] == 1 and fetched.raykv["loaded_blocks_ok"] == 3
        _same(fetched, first)


def _cpu_flags() -> list[str]:
    """The first ``flags`` line of /proc/cpuinfo, split (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])


def _fp8_kv_cache_unsupported() -> str | None:
    """Why vLLM cannot hold an fp8 KV cache on this machine (a skip reason), or None.

    vLLM's CPU attention backend (``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py)
    raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." unless
    ``torch.cpu._is_avx512_supported()`` or ``torch.cpu._is_amx_tile_supported()``; this asks
    the same (falling back to /proc/cpuinfo's avx512f and amx_tile flags if torch drops those
    private calls). A missing CPU capability is a reason to skip; engines on a GPU are unaffected.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    flags = _cpu_flags()
    avx512 = getattr(torch.cpu, "_is_avx512_supported", lambda: "avx512f" in flags)()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: "amx_tile" in flags)()
    if avx512 or amx:
        return None
    seen = " ".join(f for f in flags if f.startswith(("avx512", "amx"))) or "none"
    return (
        "no AVX-512 or AMX on this CPU (vLLM's fp8 KV cache on CPU needs one; "
        f"avx512/amx flags in /proc/cpuinfo: {seen})"
    )


@pytest.mark.timeout(600)
def test_an_fp8_kv_cache_round_trips_bit_exact(model_dir: str, ray_address: str) -> None:
    """vLLM keeps an fp8 KV cache (``kv_cache_dtype="fp8"``) in uint8 tensors; the connector
    pages it as float8_e4m3fn (one byte per value): a repeat loads its blocks and generates
    exactly what the first run computed. Skipped on a CPU without AVX-512 or AMX."""
    unsupported = _fp8_kv_cache_unsupported()
    if unsupported is not None:
        pytest.skip(unsupported)
    from raykv import KVLayout
    from raykv.integrations.vllm import testing

    f = testing.MODEL_FIELDS
    layout = KVLayout.uniform(
        f["num_hidden_layers"], f["num_key_value_heads"], f["head_dim"], TPB, "float8_e4m3fn"
    )
    with engine_on(layout, 1, model_dir, ray_address, 0, kv_cache_dtype="fp8") as (fp8, llm):
        tokens = prompt(43, 3 * TPB + 5)
        first = generate(llm, tokens)
        wait_held(fp8, 0, tokens, 3, ReuseScope(), timeout=30)
        again = generate(llm, tokens)
        assert again.raykv["loaded_blocks_ok"] == 3 and again.raykv.get("load_errors", 0) == 0
        _same(again, first)


def _same_as_example_connector(
    model: str, tokens: list[int], runs: tuple[Any, Any], path: str, **engine: Any
) -> None:
    """Run ``tokens`` twice on an engine of ``model`` and ``engine`` settings with vLLM's own
    ExampleConnector (files under ``path``; its repeat loads the prompt's full blocks) and
    check that ``runs`` (a first run and a repeat) equal its two runs bit for bit."""
    from vllm import LLM

    from raykv.integrations.vllm import testing

    kwargs = testing.engine_kwargs(model, **engine)
    kwargs["kv_transfer_config"] = testing.example_connector_config(path)
    reference = LLM(**kwargs)
    try:
        ref_first, ref_again = generate(reference, tokens), generate(reference, tokens)
    finally:
        testing.shutdown_engine(reference)
    block = kwargs["block_size"]
    assert ref_again.cached_tokens == (len(tokens) - 1) // block * block  # it loaded the full blocks
    _same(runs[0], ref_first)
    _same(runs[1], ref_again)


@pytest.mark.ci_only  # two engines, ~1.3 min on 2 cores: run by CI with -m ci_only
@pytest.mark.timeout(600)
def test_an_mla_engine_loads_latents_as_vllms_own_example_connector_does(
    ray_address: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeepSeek-style engine (multi-head latent attention, CPU_MLA) pages one latent per token
    and layer. CPU_MLA prefills a prompt whole when nothing is cached but attends to loaded
    context through a separate path, so a repeat over loaded blocks is not bit-identical to the
    first run (greedy tokens equal, logprobs within 2e-3 here). The oracle is vLLM's own
    ExampleConnector loading the same blocks from files: raykv's first run and repeat equal its
    first run and repeat bit for bit."""
    from raykv.integrations.vllm import testing

    for key, value in testing.THREAD_ENV.items():  # both engines compute alike
        monkeypatch.setenv(key, value)
    model = testing.save_tiny_mla(str(tmp_path_factory.mktemp("tiny-mla")))
    tokens = prompt(47, 6 * testing.MLA_BLOCK_SIZE + 5)
    block = testing.MLA_BLOCK_SIZE
    with engine_on(testing.tiny_mla_layout(), 1, model, ray_address, 0, block_size=block) as (dep, llm):
        first = generate(llm, tokens)
        wait_held(dep, 0, tokens, 6, ReuseScope(), timeout=30)
        again = generate(llm, tokens)
    assert first.raykv["hit_blocks"] == 0 and first.raykv["staged_blocks"] == 6
    assert first.raykv["shared_store_blocks"] == first.raykv["stored_blocks"] == 6  # one copy
    assert again.raykv["loaded_blocks_ok"] == 6 and again.raykv.get("load_errors", 0) == 0
    assert again.raykv["prefilled_tokens"] == 5

    _same_as_example_connector(
        model, tokens, (first, again), str(tmp_path_factory.mktemp("ex")), block_size=block
    )
    assert again.tokens == first.tokens
    steps = zip(again.logprobs, first.logprobs, strict=True)
    assert max(abs(a[1] - b[1]) for x, y in steps for a, b in zip(x, y, strict=True)) < 1e-2


@pytest.mark.ci_only  # two engines, ~1.3 min on 2 cores: run by CI with -m ci_only
@pytest.mark.timeout(600)
def test_a_tensor_parallel_mla_engine_stores_one_set_of_latent_pages(
    ray_address: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of a TP=2 MLA engine holds the same latents: only rank 0 stages pages (in the
    request's scope, none in rank 1's), both ranks load them, and the repeat equals vLLM's
    ExampleConnector's repeat on a TP=2 engine bit for bit."""
    from raykv.integrations.vllm import testing

    for key, value in {**testing.THREAD_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}.items():
        monkeypatch.setenv(key, value)
    model = testing.save_tiny_mla(str(tmp_path_factory.mktemp("tiny-mla-tp")))
    tokens = prompt(53, 6 * testing.MLA_BLOCK_SIZE + 5)
    engine = dict(block_size=testing.MLA_BLOCK_SIZE, tensor_parallel_size=2)
    with engine_on(testing.tiny_mla_layout(), 1, model, ray_address, 0, **engine) as (dep, llm):
        first = generate(llm, tokens)
        wait_held(dep, 0, tokens, 6, ReuseScope(), timeout=30)
        again = generate(llm, tokens)
        assert held(dep, 0, tokens, rank_scope(ReuseScope(), 1, 2)).num_blocks == 0
    assert first.raykv["staged_blocks"] == 6
    assert again.raykv["loaded_blocks_ok"] == 6 and again.raykv.get("load_errors", 0) == 0

    _same_as_example_connector(model, tokens, (first, again), str(tmp_path_factory.mktemp("ex-tp")), **engine)


@dataclass(frozen=True)
class SlidingWindow:
    """The sliding-window model (:func:`sliding_window`) and what its two tests share."""

    model: str
    deployment: RayKVCluster  # two testing workers laid out for the model
    engine: Any  # kv_both, paired with worker 0
    plain: Any  # no connector


@pytest.fixture(scope="module")
def sliding_window(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlidingWindow]:
    """The tiny Llama with ``layer_types`` (sliding-window layers beside full ones, a 40-token
    window), a deployment of two workers for its pages, an engine of it paired with worker 0 and
    one without a connector: each engine takes ~30 s to start on 2 cores, so both tests use these
    (their prompts share no block). One torch thread per engine (THREAD_ENV)."""
    from vllm import LLM

    from raykv.integrations.vllm import testing

    saved = testing.pin_engine_threads()
    try:
        model = testing.save_tiny_llama(
            str(tmp_path_factory.mktemp("tiny-swa")),
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=40,
        )
        with engine_on(testing.tiny_layout(), 2, model, ray_address, 0) as (dep, llm):
            plain = LLM(**testing.engine_kwargs(model))
            try:
                yield SlidingWindow(model, dep, llm, plain)
            finally:
                testing.shutdown_engine(plain)
    finally:
        testing.restore_env(saved)


@pytest.mark.timeout(600)
def test_sliding_window_layers_beside_full_ones_keep_only_their_window(sliding_window: SlidingWindow) -> None:
    """Sliding-window layers beside full-attention ones (Gemma 2/3 and gpt-oss style; here the
    tiny Llama with ``layer_types``, a 40-token window). RaykvConnector supports vLLM's hybrid KV
    cache manager, so the engine keeps two KV cache groups and a block slot holds one layer of
    each: twice the blocks of a manager that gives every layer whole blocks. Pages are stored
    whole in the step that computes them; a load fills every full-attention block and only the
    window's sliding-window blocks (the rest are null), asynchronously. A repeat of an 8-block
    prompt, and a prompt sharing only its first 5 blocks (whose window then reads blocks 2-4,
    stored by the first prompt), generate exactly what an engine without a connector does."""
    from raykv.integrations.vllm import testing

    dep, llm, plain = sliding_window.deployment, sliding_window.engine, sliding_window.plain
    long = prompt(59, 8 * TPB + 3)
    branch = long[: 5 * TPB] + prompt(61, 2 * TPB + 7)
    layout = testing.tiny_layout()
    assert held(dep, 0, long).num_blocks == 0 and held(dep, 1, long).num_blocks == 0  # nothing cached yet
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    first = generate(llm, long)
    wait_held(dep, 0, long, 8, ReuseScope(), timeout=30)
    again = generate(llm, long)
    other = generate(llm, branch)
    assert blocks == testing.KV_CACHE_BYTES // (layout.page_bytes // 2)  # one layer per group in a slot
    assert first.raykv["staged_blocks"] == 8
    assert again.raykv["loaded_blocks_ok"] == 8 and again.raykv["prefilled_tokens"] == 3
    assert again.raykv["async_loads"] == 1 and "load_errors" not in again.raykv
    assert other.raykv["loaded_blocks_ok"] == 5 and "load_errors" not in other.raykv
    _same(first, generate(plain, long))
    _same(again, first)
    _same(other, generate(plain, branch))


@pytest.mark.timeout(600)
def test_sliding_window_prefill_decode_pulls_every_groups_pages(
    sliding_window: SlidingWindow, ray_address: str
) -> None:
    """Prefill/decode with the sliding-window model: a ``kv_producer`` engine on worker 0 stores
    a prompt's pages; a ``kv_consumer`` engine on worker 1, given the producer's
    ``kv_transfer_params``, has its worker pull them (a fetch, not a held hit) and loads each
    group's blocks; it generates what an engine without a connector does, bit for bit. (The
    producer is the module's kv_both engine on worker 0, whose first run of a prompt stores it
    as a producer does.)"""
    from vllm import LLM

    from raykv.integrations.vllm import testing

    dep, producer, model = sliding_window.deployment, sliding_window.engine, sliding_window.model
    tokens = prompt(67, 7 * TPB + 6)
    assert held(dep, 0, tokens).num_blocks == 0 and held(dep, 1, tokens).num_blocks == 0  # nothing cached yet
    first = generate(producer, tokens, max_tokens=1)
    wait_held(dep, 0, tokens, 7, ReuseScope(), timeout=30)
    kwargs = testing.engine_kwargs(model)
    kwargs["kv_transfer_config"] = testing.connector_config(
        dep.namespace, ray_address, worker=1, role="kv_consumer"
    )
    saved = testing.pin_engine_threads()
    try:
        consumer = LLM(**kwargs)
    finally:
        testing.restore_env(saved)
    try:
        out = generate(consumer, tokens, params={"raykv": first.raykv})
    finally:
        testing.shutdown_engine(consumer)
    assert held(dep, 1, tokens).num_blocks >= 7  # worker 1 pulled them
    assert first.raykv["blocks"] == 7
    assert out.raykv["loaded_blocks_ok"] == 7 and out.raykv["async_loads"] == 1
    assert "load_errors" not in out.raykv and out.raykv["pulled_tokens"] == 7 * TPB
    _same(out, generate(sliding_window.plain, tokens))

"""``raykv bench scheduler``: what RaykvConnector adds to vLLM's scheduler step.

vLLM 0.32's own ``Scheduler`` (``vllm.v1.core.sched.scheduler``), without a model: each step is
``schedule()``, then ``forward_ms`` of simulated forward pass (a sleep: the engine's other
threads, raykv's lookup thread among them, run meanwhile, as they do beside a real forward pass),
then ``update_from_output()`` with one sampled token per scheduled request. ``requests`` new
requests arrive one per step (prompts of ``prompt`` random tokens; every other one a prompt
whose blocks the paired CacheWorker holds), each generating ``max_tokens`` tokens. The same
requests run in one process without a connector (the baseline), then with RaykvConnector's
scheduler side against a live one-worker deployment on a local Ray (its lookups, stores and
finishes; no worker side runs, so no page moves), alternated for ``rounds`` rounds and pooled.

Timed per step: ``schedule()`` plus ``update_from_output()``, where every connector hook of the
scheduler side runs. Each step carries one new request, so the difference of the two runs' step
times (median, p99) is what the connector adds per new request. Steps that scheduled nothing
(every waiting request deferred for its lookup and none running: the connector then waits up to
5 ms for an answer rather than let the engine spin) are counted apart: no request runs in them.
Also reported: how long the connector kept a request waiting for its lookup's answer (arrival
to first scheduled step, against the baseline's), the hits it found, the time spent inside the
connector's hooks per request, and the model fingerprint's one-time cost.
"""

from __future__ import annotations

import gc
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.cache.ray_util import shutdown_ray
from raykv.bench.harness import Benchmark, Row
from raykv.integrations.vllm import testing

log = logging.getLogger(__name__)

GOAL_P50_US = 50.0
GOAL_P99_US = 500.0


@dataclass(frozen=True)
class SchedSettings:
    requests: int = 1000
    prompt: int = 960  # 30 blocks; the tiny Llama's context is 1024
    max_tokens: int = 4
    forward_ms: float = 2.0
    seed: int = 0
    rounds: int = 3


@dataclass
class Loop:
    """One run's figures: per-step seconds, per-request steps from arrival to scheduled."""

    step_s: list[float] = field(default_factory=list)  # steps that ran work
    idle_s: list[float] = field(default_factory=list)  # steps with nothing scheduled
    admitted_after_s: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    counters: dict[str, int] = field(default_factory=dict)


def _prompts(s: SchedSettings) -> tuple[list[list[int]], list[list[int]]]:
    """(the prompts in arrival order, the distinct prompts the worker holds): every other
    request repeats one of 8 held prompts, the others are fresh."""
    rng = random.Random(s.seed)
    held = [[rng.randrange(1, 500) for _ in range(s.prompt)] for _ in range(8)]
    order = [
        held[i // 2 % 8] if i % 2 == 0 else [rng.randrange(1, 500) for _ in range(s.prompt)]
        for i in range(s.requests)
    ]
    return order, held


def _vllm_config(model_dir: str, s: SchedSettings, transfer: Any = None) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    n = testing.MODEL_FIELDS["max_position_embeddings"]
    kwargs = testing.engine_kwargs(model_dir, max_model_len=n, max_num_batched_tokens=4 * n, max_num_seqs=64)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    config = EngineArgs(**kwargs).create_engine_config()
    config.cache_config.num_gpu_blocks = 4096
    return config


def _scheduler(config: Any) -> Any:
    """vLLM's Scheduler over a KV cache of 4096 blocks of the tiny Llama's attention layers."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    fields = testing.MODEL_FIELDS
    spec = FullAttentionSpec(
        block_size=testing.BLOCK_SIZE,
        num_kv_heads=fields["num_key_value_heads"],
        head_size=fields["head_dim"],
        dtype=torch.float32,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(fields["num_hidden_layers"])]
    groups = [KVCacheGroupSpec(layers, spec)]
    kv = KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=testing.BLOCK_SIZE)


def _drive(scheduler: Any, prompts: Sequence[list[int]], s: SchedSettings) -> Loop:
    """Run ``prompts`` through ``scheduler`` (module docstring); the figures."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    loop, arrived, finished, i = Loop(), {}, 0, 0
    params = SamplingParams(max_tokens=s.max_tokens, ignore_eos=True)
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does once started: collections then skip the startup heap
    while finished < len(prompts):
        if i < len(prompts):
            scheduler.add_request(Request(f"r{i}", prompts[i], params, None))
            arrived[f"r{i}"] = time.perf_counter()
            i += 1
        start = time.perf_counter()
        out = scheduler.schedule()
        spent = time.perf_counter() - start
        for new in out.scheduled_new_reqs:
            loop.admitted_after_s.append(time.perf_counter() - arrived.pop(new.req_id))
            loop.hit_tokens += new.num_computed_tokens
        time.sleep(s.forward_ms / 1e3)
        ids = list(out.num_scheduled_tokens)
        sampled = ModelRunnerOutput(ids, {r: n for n, r in enumerate(ids)}, [[7] for _ in ids])
        start = time.perf_counter()
        results = scheduler.update_from_output(out, sampled)
        spent += time.perf_counter() - start
        if out.total_num_scheduled_tokens:
            loop.step_s.append(spent)
        else:  # nothing to run: the connector may wait a few ms for a lookup instead of spinning
            loop.idle_s.append(spent)
        finished += sum(1 for o in results.values() for r in o.outputs if r.finish_reason is not None)
    gc.unfreeze()
    return loop


def _store_held(deployment: Any, held: Sequence[list[int]], model: bytes) -> None:
    """Commit ``held``'s full blocks into the worker under the engine's keys (zero pages: the
    lookup reads keys only)."""
    import ray

    worker = deployment.workers[deployment.worker_ids[0]]
    for tokens in held:
        handle, _ = ray.get(worker.create.remote(tokens, None, None, 35, None, model))
        ray.get(worker.resume.remote(handle))
        ray.get(worker.extend.remote(handle, tokens))
        ray.get(worker.commit.remote(handle))
        ray.get(worker.close.remote(handle))
    ray.get(worker.flush_events.remote())


HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished_all_groups",
)
"""The connector's scheduler-side hooks vLLM's Scheduler calls (timed on the instance)."""


def _timed_hooks(connector: Any, spent: list[float]) -> None:
    """Wrap ``connector``'s scheduler hooks on the instance so their time adds up in ``spent[0]``."""
    for name in HOOKS:
        hook = getattr(connector, name)

        def timed(*args: Any, _hook: Callable[..., Any] = hook, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(connector, name, timed)


def _rounds(s: SchedSettings, model_dir: str, connected: Any, model: bytes) -> tuple[Loop, Loop]:
    """``s.rounds`` of (the loop without a connector, the loop with one), alternated so that a
    slow spell of the machine falls on both; their figures pooled."""
    prompts, _ = _prompts(s)
    base, ours, hooks = Loop(), Loop(), [0.0]
    for _ in range(s.rounds):
        plain = _drive(_scheduler(_vllm_config(model_dir, s)), prompts, s)
        scheduler = _scheduler(connected)
        side = scheduler.connector.scheduler_side
        if side is None or side.model != model:
            raise AssertionError("the connector's fingerprint differs from the stored blocks'")
        _timed_hooks(scheduler.connector, hooks)
        with_connector = _drive(scheduler, prompts, s)
        scheduler.shutdown()
        for pooled, loop in ((base, plain), (ours, with_connector)):
            pooled.step_s += loop.step_s
            pooled.idle_s += loop.idle_s
            pooled.admitted_after_s += loop.admitted_after_s
            pooled.hit_tokens += loop.hit_tokens
        for name, count in side.counters.items():
            ours.counters[name] = ours.counters.get(name, 0) + int(count)
    ours.counters["hook_us_per_request"] = int(hooks[0] * 1e6 / (s.rounds * s.requests))
    return base, ours


def measure(s: SchedSettings) -> tuple[Loop, Loop, float]:
    """(baseline loops, connector loops, fingerprint ms) on a local Ray with a one-worker
    deployment holding the held prompts' blocks."""
    import ray

    import raykv
    from raykv.integrations.vllm.identity import model_fingerprint

    _, held = _prompts(s)
    with tempfile.TemporaryDirectory(prefix="raykv-bench-sched-") as workdir:
        model_dir = testing.save_tiny_llama(f"{workdir}/model")
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 << 20)
        deployment = None
        try:
            layout = testing.tiny_layout()
            blocks = 16 * (s.prompt // layout.tokens_per_block + 1)
            config = testing.deployment_config(layout, blocks, blocks)
            deployment = raykv.start(1, config, namespace="raykv-bench-sched")
            address = str(ray.get_runtime_context().gcs_address)
            connected = _vllm_config(model_dir, s, testing.connector_config(deployment.namespace, address, 0))
            start = time.perf_counter()
            model = model_fingerprint(connected, layout, 1, {})
            fingerprint_ms = (time.perf_counter() - start) * 1e3
            _store_held(deployment, held, model)
            base, ours = _rounds(s, model_dir, connected, model)
        finally:
            if deployment is not None:
                deployment.shutdown()
            shutdown_ray()
    return base, ours, fingerprint_ms


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def rows(s: SchedSettings, base: Loop, ours: Loop, fingerprint_ms: float) -> list[Row]:
    """The table's rows (module docstring); the goal verdicts in their info."""
    out = []
    for label, q, goal in (("p50", 0.5, GOAL_P50_US), ("p99", 0.99, GOAL_P99_US)):
        b, o = _pct(base.step_s, q) * 1e6, _pct(ours.step_s, q) * 1e6
        verdict = "met" if o - b <= goal else "MISSED"
        out.append(Row(f"scheduler step {label}, raykv vs no connector", o, b, "us", info="lower is better"))
        out.append(
            Row(
                f"added per new request, {label}", o - b, None, "us", info=f"goal <= {goal:.0f} us: {verdict}"
            )
        )
    idle = f"{len(ours.idle_s)} vs {len(base.idle_s)} steps with nothing to run, not counted above"
    out.append(Row("steps with nothing scheduled", len(ours.idle_s), len(base.idle_s), "steps", info=idle))
    b, o = (statistics.mean(x.admitted_after_s) * 1e3 for x in (base, ours))
    out.append(
        Row("arrival to scheduled, mean", o, b, "ms", info="raykv vs none: lookups answered off the step")
    )
    c = ours.counters
    info = (
        f"{c.get('lookups', 0)} lookups, {c.get('lookups_deferred', 0)} deferred polls, "
        f"{c.get('lookup_timeouts', 0)} past budget"
    )
    out.append(Row("prompt tokens raykv found cached", ours.hit_tokens, base.hit_tokens, "tokens", info=info))
    hooks = c.get("hook_us_per_request", 0)
    out.append(
        Row("connector hooks per new request", hooks, None, "us", info="time inside its scheduler-side calls")
    )
    out.append(Row("model fingerprint (once per engine)", fingerprint_ms, None, "ms"))
    return out


def benchmarks(quick: bool) -> list[Benchmark]:
    s = SchedSettings(requests=200, rounds=1) if quick else SchedSettings()

    def run() -> list[Row]:
        return rows(s, *measure(s))

    return [Benchmark(f"vLLM scheduler step with RaykvConnector, {s.requests} new requests", run)]


def register() -> None:
    """Add the ``scheduler`` suite to ``raykv bench`` (needs vllm)."""
    from raykv.bench import SUITES

    def suite(quick: bool) -> tuple[list[Benchmark], str]:
        s = SchedSettings()
        desc = (
            f"vLLM's Scheduler without a model, one new request per step ({s.prompt}-token prompts, half "
            f"held by the paired worker, {s.max_tokens} tokens each), {s.forward_ms:g} ms simulated forward "
            "pass; per step schedule() + update_from_output(); baseline: the same loop without a connector"
        )
        return benchmarks(quick), desc

    SUITES["scheduler"] = suite

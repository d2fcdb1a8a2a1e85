"""``raykv bench serve``: raykv judged as users see it, over HTTP against Ray Serve LLM.

A Ray Serve LLM app on this machine's CPUs (vLLM engines of a random-weight Llama made at run
time, with a locally made chat tokenizer; one ``serve.run`` of ``build_openai_app``, so every
engine starts once and in parallel) is driven by ``AsyncOpenAI`` at a fixed request rate with a
multi-turn chat workload (:mod:`raykv.bench.serve_workload`, :mod:`raykv.bench.serve_client`).
Four configs play the same workload (same seed: sessions, messages, send times) one after
another:

1. ``pow2``: Serve's default router (power of two choices), vLLM's prefix cache only;
2. ``prefix-affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (``imbalanced_threshold``
   4, else Ray's defaults: :data:`actors.bench.serve_app.PREFIX_AFFINITY`), vLLM's prefix cache
   only;
3. ``raykv``: :func:`actors.serve.llm.with_raykv`: raykv's CacheAwareRouter (chat rendered to
   token ids with the model's tokenizer) and RaykvConnector over a raykv deployment;
4. ``raykv-pow2``: with_raykv's connector, routed by Serve's power of two choices: what the cache
   alone gives.

Engines (``Settings.engines``): ``shared`` (the default) runs two deployments, plain engines for
configs 1-2 and raykv engines (one raykv deployment) for 3-4, each routed by a bench router that
applies the config a request names (:mod:`actors.bench.serve_routers`). A vLLM engine process
trio takes ~2 GiB and ~40 CPU-seconds to start here, so one deployment per config (``separate``:
each config its own engines and raykv deployment) does not fit ``--quick`` into 3 minutes on 2
cores. Isolation, both ways: every request carries its config's ``cache_salt`` (with a per-run
id), so no config reuses blocks another computed, in vLLM's prefix cache or in raykv (keys are
scoped by the salt); the configs run one at a time.

Each engine's KV cache holds only part of the sessions' contexts (``num_gpu_blocks_override``),
as GPU memory does in production; raykv's workers add a host tier. Before the first config, every
deployment plays a short warm-up workload (another seed and salt), so no config pays the
engines' first prefills. Engines run niced (:class:`actors.bench.serve_app.Settings`). Every
router is timed the same way (``choose_replicas``). Output: the table and goal lines on stdout
(:mod:`raykv.bench.serve_report`), a progress bar on stderr, a plot (``--plot``) and a JSON file
(``--json``). :func:`run_serve_bench` is what the CLI and the test call.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import ray

from actors.bench.serve_app import (
    APP,
    CONFIGS,
    PREFIX_AFFINITY,
    RAYKV_ROUTER,
    WARMUP_SEED,
    Settings,
    deployments_of,
    free_port,
    llm_config,
    model_of,
    needed_cpus,
    raykv_config,
    settings_for,
)
from actors.cache.ray_util import shutdown_ray
from raykv.bench.serve_client import Progress, run_phase
from raykv.bench.serve_report import ConfigResult, goal_lines, plot, summarize, table
from raykv.bench.serve_timings import TIMINGS_ACTOR, RouterTimings, phase_salt
from raykv.bench.serve_workload import Workload, build_workload
from raykv.integrations.vllm import testing

__all__ = ["CONFIGS", "Settings", "run_serve_bench", "serve_bench_main", "settings_for"]


# ---- a run ---------------------------------------------------------------------------------------
def run_serve_bench(
    s: Settings, progress: bool = True, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run the bench (module docstring) on the connected Ray (else an embedded local one, shut
    down at the end); returns the JSON-able results: ``settings``, ``timings_s`` (startup,
    phases, total), ``results`` (per config, :meth:`ConfigResult.to_json`), ``table``,
    ``goals``, and ``_results`` (the :class:`ConfigResult` objects, not JSON)."""
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    workload = build_workload(s.workload)
    max_model_len = min(
        s.engine_blocks * testing.BLOCK_SIZE,
        int(s.model["max_position_embeddings"]),
        workload.max_prompt_tokens() + s.workload.max_tokens + 32,
    )
    started_ray = not ray.is_initialized()
    with tempfile.TemporaryDirectory(prefix="raykv-bench-serve-") as workdir:
        model_dir = os.path.join(workdir, "model")
        pool = concurrent.futures.ThreadPoolExecutor(1)
        prepared = pool.submit(_prepare, s, model_dir)  # beside starting Ray, raykv and Serve
        try:
            if started_ray:
                env = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}  # a loaded VM answers late
                ray.init(
                    address="local",
                    num_cpus=math.ceil(needed_cpus(s)) + 2,
                    include_dashboard=False,
                    log_to_driver=False,
                    namespace=APP,
                    runtime_env={"env_vars": env},
                )
            free = ray.available_resources().get("CPU", 0.0)
            if free < needed_cpus(s):
                raise RuntimeError(
                    f"the bench needs {needed_cpus(s):g} free logical CPUs in Ray; {free:g} are free"
                )
            results, times = _run(s, workload, max_model_len, model_dir, prepared, progress, say, t0)
        finally:
            pool.shutdown(wait=True)
            if started_ray and ray.is_initialized():
                shutdown_ray()
    times["total_s"] = time.monotonic() - t0
    return {
        "settings": _settings_json(s, workload, max_model_len),
        "timings_s": times,
        "results": [r.to_json() for r in results],
        "table": table(results),
        "goals": goal_lines(results),
        "_results": results,
    }


def _prepare(s: Settings, model_dir: str) -> None:
    """The model and its chat tokenizer in ``model_dir``; Ray Serve LLM imported (which sets the
    root logger to INFO: set back, so the driver does not log a line per HTTP request)."""
    root = logging.getLogger()
    level = root.level
    import ray.serve.llm  # noqa: F401 - ~10 s of imports, done beside ray.init

    root.setLevel(level)
    from transformers.utils import logging as hf_logging

    from raykv.routing.local_tokenizer import save_chat_tokenizer

    hf_logging.disable_progress_bar()
    testing.save_tiny_llama(model_dir, **s.model)
    save_chat_tokenizer(model_dir, int(s.model["vocab_size"]))


def _run(
    s: Settings,
    workload: Workload,
    max_model_len: int,
    model_dir: str,
    prepared: concurrent.futures.Future[None],
    progress: bool,
    say: Callable[[str], None],
    t0: float,
) -> tuple[list[ConfigResult], dict[str, float]]:
    """Start the raykv deployments and the app, warm it up, play every phase, stop it all."""
    from ray import serve

    import raykv

    run_id = uuid.uuid4().hex[:8]
    bench_ns = f"{APP}-{run_id}"
    timings = ray.remote(RouterTimings).options(name=TIMINGS_ACTOR, namespace=bench_ns, num_cpus=0).remote()
    clusters: list[Any] = []
    results: list[ConfigResult] = []
    times: dict[str, float] = {}
    bar = Progress(len(workload.requests) * len(s.configs), progress)
    serving = False
    serve_log = logging.getLogger("ray.serve")
    serve_level = serve_log.level
    serve_log.setLevel(logging.WARNING)  # not the deployment options of every config on stdout
    try:
        raykv_ns = {
            m: f"{bench_ns}-{m}" for m, names in deployments_of(s).items() if names[0].startswith("raykv")
        }
        for namespace in raykv_ns.values():  # each its own raykv deployment (workers, index)
            clusters.append(raykv.start(num_workers=s.replicas, config=raykv_config(s), namespace=namespace))
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serving = True
        prepared.result()  # the model is written, Ray Serve LLM imported
        from ray.serve.llm import build_openai_app

        configs = [
            llm_config(s, m, model_dir, max_model_len, bench_ns, raykv_ns.get(m, ""))
            for m in deployments_of(s)
        ]
        engines = len(configs) * s.replicas
        bar.note(f"starting {engines} engines")
        serve.run(build_openai_app({"llm_configs": configs}), name=APP, route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        ray.get(timings.ping.remote(), timeout=120)  # up before any router reports
        asyncio.run(_warm_up(s, base_url, run_id))
        warmed = {n: _router_timings(timings, f"warmup-{n}", 0)["counters"] for n in s.configs}
        times["startup_s"] = time.monotonic() - t0
        say(f"bench serve: {engines} engines up and warm in {times['startup_s']:.0f} s")
        for name in s.configs:
            bar.note(name)
            t1 = time.monotonic()
            salt = {"cache_salt": phase_salt(name, run_id)}  # no phase reuses another's blocks
            records = asyncio.run(
                run_phase(base_url, model_of(s, name), workload, on_done=bar.request, extra_body=salt)
            )
            times[f"phase_{name}_s"] = time.monotonic() - t1
            router = _router_timings(timings, name, sum(r.ok for r in records))
            base = warmed.get(name) or {}  # counters are the router's totals: the phase's own
            router["counters"] = {k: v - base.get(k, 0) for k, v in router["counters"].items()}
            results.append(summarize(name, records, workload.offered_rate, router))
    finally:
        bar.close()
        t2 = time.monotonic()
        if serving:
            try:
                serve.shutdown()
            except Exception as exc:  # the results matter more than a clean Serve shutdown
                say(f"bench serve: serve.shutdown failed: {exc}")
        for cluster in clusters:
            cluster.shutdown()
        ray.kill(timings)
        serve_log.setLevel(serve_level)
        times["teardown_s"] = time.monotonic() - t2
    return results, times


async def _warm_up(s: Settings, base_url: str, run_id: str) -> None:
    """Every deployment plays a short workload of its own (another seed, ``warmup_s`` long, under
    a salt of its own, all deployments at once), routed as its cache-aware config is: the engines' first
    prefills, decodes and loads at the workload's sizes, the tokenizer and the index link of
    raykv's router, are paid here and not by whichever config runs first on them."""
    warm = build_workload(s.workload.with_changes(seed=s.workload.seed + WARMUP_SEED, duration_s=s.warmup_s))
    await asyncio.gather(
        *(
            run_phase(
                base_url,
                model,
                warm,
                extra_body={"cache_salt": phase_salt(f"warmup-{_warm_config(names)}", run_id)},
            )
            for model, names in deployments_of(s).items()
        )
    )


def _warm_config(names: tuple[str, ...]) -> str:
    return next((n for n in names if n in ("prefix-affinity", "raykv")), names[0])


def _router_timings(timings: Any, name: str, served: int, wait_s: float = 5.0) -> dict[str, Any]:
    """Config ``name``'s router timings once they cover ``served`` requests (the routers report
    fire-and-forget), or what has landed after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        got: dict[str, Any] = ray.get(timings.get.remote(name), timeout=60)
        if got["requests"] >= served or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _settings_json(s: Settings, workload: Workload, max_model_len: int) -> dict[str, Any]:
    out = asdict(s)
    out["workload"] = asdict(s.workload)
    out.update(
        sessions=len(workload.sessions),
        raykv_router=dict(RAYKV_ROUTER),
        prefix_affinity_router=dict(PREFIX_AFFINITY),
        requests=len(workload.requests),
        planned_duration_s=workload.duration_s,
        offered_rate=workload.offered_rate,
        max_model_len=max_model_len,
        working_set_tokens=round(workload.mean_working_set()),
        engine_tokens=s.engine_blocks * testing.BLOCK_SIZE,
        deployments={m: list(names) for m, names in deployments_of(s).items()},
    )
    return out


def describe(out: Mapping[str, Any]) -> str:
    """The header line: what ran."""
    st = out["settings"]
    wl = st["workload"]
    return (
        f"raykv bench serve: {len(st['configs'])} configs on {len(st['deployments'])} deployments x "
        f"{st['replicas']} replicas (vLLM on CPU, "
        f"Llama hidden {st['model']['hidden_size']} x {st['model']['num_hidden_layers']} layers), "
        f"{st['engines']} engines; "
        f"{st['requests']} chat requests from {st['sessions']} sessions at {st['offered_rate']:.2f} req/s "
        f"(seed {wl['seed']}); engine KV cache {st['engine_tokens']} tokens each, sessions' working set "
        f"{st['working_set_tokens']} tokens on average; startup {out['timings_s']['startup_s']:.0f} s, "
        f"total {out['timings_s']['total_s']:.0f} s"
    )


def serve_bench_main(args: argparse.Namespace) -> int:
    """``raykv bench serve``: run, print the table and goal lines, write ``--json`` and ``--plot``;
    exit 1 when a request failed."""
    s = settings_for(
        quick=bool(args.quick),
        replicas=getattr(args, "replicas", None),
        rate=getattr(args, "rate", None),
        sessions=getattr(args, "sessions", None),
        seed=int(getattr(args, "seed", 0) or 0),
        engines="separate" if getattr(args, "separate_engines", False) else "shared",
    )
    out = run_serve_bench(s)
    results = out.pop("_results")
    print(describe(out))
    print(out["table"])
    for line in out["goals"]:
        print(line)
    for r in results:
        if r.error_samples:
            print(f"{r.name} errors: {'; '.join(r.error_samples)}")
    plot_path = getattr(args, "plot", None) or "docs/bench_serve.png"
    plot(results, plot_path, describe(out))
    print(f"plot: {plot_path}")
    json_path = getattr(args, "json", None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"json: {json_path}")
    return 1 if any(r.errors for r in results) else 0

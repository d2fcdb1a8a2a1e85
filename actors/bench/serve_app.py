"""The settings and the Ray Serve LLM app of ``raykv bench serve`` (:mod:`actors.bench.serve`):
the model, engine and workload sizes of ``--quick`` and the full run, and the ``LLMConfig`` of
each deployment with its router (:mod:`actors.bench.serve_routers`)."""

from __future__ import annotations

import copy
import socket
from dataclasses import dataclass, field
from typing import Any

from raykv.bench.serve_workload import WorkloadConfig
from raykv.integrations.vllm import testing

CONFIGS = ("pow2", "prefix-affinity", "raykv", "raykv-pow2")
APP = "raykv-bench-serve"
MODEL_FIELDS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
"""The random-weight Llama: a 1,024-token prefill takes ~0.3 s on one core of this VM, a cached
one ~20 ms, so prefill dominates TTFT while the run stays short."""
RAYKV_ROUTER: dict[str, Any] = {"time_budget_s": 0.2, "retry_after_s": 1.0}
"""raykv's router settings here (beside ``seed``): on a loaded 2-core VM the index actor can
answer a route later than the 50 ms default budget, and each timeout would turn cache routing
off for the default 5 s."""
PREFIX_AFFINITY: dict[str, Any] = {"imbalanced_threshold": 4}
"""``PrefixCacheAffinityRouter``'s settings here (its others at Ray's defaults). Ray's default
``imbalanced_threshold`` is infinite: it never balances load, and with shared system prompts a
trial run sent all 46 requests of the phase to one replica. At 4 (ongoing requests apart, half an
engine's batch) it falls back to power of two choices when one replica runs ahead."""
WARMUP_SEED = 7919  # the warm-up workload's seed is the run's plus this
_ROUTERS = "actors.bench.serve_routers"
ROUTERS = {
    "plain": f"{_ROUTERS}:PlainPhaseRouter",
    "raykv-engines": f"{_ROUTERS}:RaykvPhaseRouter",
    "pow2": f"{_ROUTERS}:TimedPow2Router",
    "prefix-affinity": f"{_ROUTERS}:TimedPrefixAffinityRouter",
    "raykv": f"{_ROUTERS}:TimedCacheAwareRouter",
}
"""The routers (:mod:`actors.bench.serve_routers`, imported by path in the ingress replica): by
deployment for shared engines, by config for separate ones."""


@dataclass(frozen=True)
class Settings:
    """Everything a run is made of (``--quick`` and the flags pick these).

    ``engine_nice``: on this machine the CPUs play the accelerator; engines computing at full
    speed would starve the serving path (Serve's proxy, the OpenAI ingress where every router
    decides, Ray's and raykv's actors) of CPU it does not share with the model on a GPU machine.
    Niced, they yield the CPU to it, for every config alike."""

    replicas: int
    workload: WorkloadConfig
    engine_blocks: int  # per engine: its KV cache, in 32-token blocks
    host_pages: int  # per raykv worker: its host tier, in pages of one block
    chunk_tokens: int = 512  # vLLM's max_num_batched_tokens (chunked prefill)
    max_num_seqs: int = 8
    cpu_per_replica: float = 0.5  # logical CPUs a replica takes (its engine's bundle; the actor 0)
    engine_nice: int = 10  # the replicas and their engines run at this CPU niceness (see above)
    warmup_s: float = 4.0  # each deployment plays a warm-up workload this long first (_warm_up)
    model: dict[str, Any] = field(default_factory=lambda: dict(MODEL_FIELDS))
    configs: tuple[str, ...] = CONFIGS
    engines: str = "shared"  # or "separate": each config its own deployment (module docstring)


QUICK = Settings(
    replicas=2,
    workload=WorkloadConfig(rate=3.5, duration_s=9.0, turns=(3, 5), min_think_s=1.0, think_s=1.0),
    engine_blocks=40,  # 1,280 tokens: ~1/2 of the sessions' mean working set (2,500), ~1/3 of its peak
    host_pages=512,
    warmup_s=3.0,
)
FULL = Settings(
    replicas=3,  # per deployment: 6 engines, ~15 GiB, what fits a 24 GiB VM beside other work
    workload=WorkloadConfig(rate=4.0, duration_s=120.0, turns=(4, 9), min_think_s=2.0, think_s=2.0),
    engine_blocks=96,  # 3,072 tokens: ~1/3 of the sessions' mean working set (8,400), ~1/4 of its peak
    host_pages=1024,
    warmup_s=8.0,
)


def settings_for(
    quick: bool = False,
    replicas: int | None = None,
    rate: float | None = None,
    sessions: int | None = None,
    seed: int = 0,
    configs: tuple[str, ...] | None = None,
    engines: str = "shared",
) -> Settings:
    """The quick or full settings with the flags' changes."""
    base = QUICK if quick else FULL
    wl = base.workload.with_changes(seed=seed)
    if rate is not None:
        wl = wl.with_changes(rate=float(rate))
    if sessions is not None:
        wl = wl.with_changes(sessions=int(sessions))
    unknown = sorted(set(configs or ()) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown configs {unknown}; known: {CONFIGS}")
    if engines not in ("shared", "separate"):
        raise ValueError(f"engines must be 'shared' or 'separate', got {engines!r}")
    return Settings(
        replicas=int(replicas or base.replicas),
        workload=wl,
        engine_blocks=base.engine_blocks,
        host_pages=base.host_pages,
        chunk_tokens=base.chunk_tokens,
        max_num_seqs=base.max_num_seqs,
        cpu_per_replica=base.cpu_per_replica,
        engine_nice=base.engine_nice,
        warmup_s=base.warmup_s,
        model=dict(base.model),
        configs=tuple(configs or base.configs),
        engines=engines,
    )


def deployments_of(s: Settings) -> dict[str, tuple[str, ...]]:
    """Model id -> the configs its deployment serves: shared engines put the plain configs on
    ``bench-plain`` and the raykv ones on ``bench-raykv``; separate engines give each config
    ``bench-<config>``."""
    if s.engines == "separate":
        return {f"bench-{name}": (name,) for name in s.configs}
    out: dict[str, tuple[str, ...]] = {}
    for name in s.configs:
        model = "bench-raykv" if name.startswith("raykv") else "bench-plain"
        out[model] = (*out.get(model, ()), name)
    return out


def model_of(s: Settings, config: str) -> str:
    return next(m for m, names in deployments_of(s).items() if config in names)


def _base_config(s: Settings, model_dir: str, model_id: str, max_model_len: int) -> Any:
    from ray.serve.llm import LLMConfig

    page = testing.tiny_layout(**s.model).page_bytes
    engine = testing.engine_kwargs(
        model_dir,
        skip_tokenizer_init=False,  # chat requests: the engine renders them with the tokenizer
        enable_prefix_caching=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=s.chunk_tokens,
        max_num_seqs=s.max_num_seqs,
        num_gpu_blocks_override=s.engine_blocks,
        kv_cache_memory_bytes=s.engine_blocks * page,
        enable_prompt_tokens_details=True,  # usage.prompt_tokens_details.cached_tokens
    )
    engine.pop("model")
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_dir},
        engine_kwargs=engine,
        placement_group_config={"bundles": [{"CPU": s.cpu_per_replica}]},
        deployment_config={
            "num_replicas": s.replicas,
            "max_ongoing_requests": 2 * s.max_num_seqs,
            "ray_actor_options": {"num_cpus": 0},
        },
        runtime_env={"env_vars": dict(testing.THREAD_ENV)},
        log_engine_metrics=False,
        # the model is a local directory: no download tasks (a process each) before the engine
        callback_config={
            "callback_class": f"{_ROUTERS}:LocalModelCallback",
            "callback_kwargs": {"nice": s.engine_nice},
        },
    )


def _router(path_key: str, bench_ns: str, **kwargs: Any) -> Any:
    from ray.serve.config import RequestRouterConfig

    fields: dict[str, Any] = {
        "request_router_class": ROUTERS[path_key],
        "request_router_kwargs": {"bench_namespace": bench_ns, **kwargs},
    }
    return RequestRouterConfig(**fields)


def llm_config(
    s: Settings, model_id: str, model_dir: str, max_model_len: int, bench_ns: str, raykv_ns: str
) -> Any:
    """The ``LLMConfig`` of deployment ``model_id`` (:func:`deployments_of`; module docstring)."""
    from actors.serve.llm import with_raykv

    names = deployments_of(s)[model_id]
    base = _base_config(s, model_dir, model_id, max_model_len)
    if s.engines == "shared":
        kind = "raykv-engines" if names[0].startswith("raykv") else "plain"
    else:
        kind = "pow2" if names[0] == "raykv-pow2" else names[0]
    extra: dict[str, Any] = {} if s.engines == "shared" else {"bench_name": names[0]}
    if not names[0].startswith("raykv"):
        affinity = PREFIX_AFFINITY if "prefix-affinity" in names else {}
        router = _router(kind, bench_ns, **extra, **affinity)
    else:
        base = with_raykv(base, raykv_ns, router={"seed": s.workload.seed, **RAYKV_ROUTER})
        given = base.deployment_config["request_router_config"]
        if kind == "pow2":
            router = _router(kind, bench_ns, **extra)
        else:
            kwargs = dict(given.request_router_kwargs or {})
            kwargs.setdefault("tokenizer", model_dir)  # with_raykv sets the model source already
            router = _router(kind, bench_ns, **extra, **kwargs).model_copy(
                update={"request_routing_stats_period_s": given.request_routing_stats_period_s}
            )
    deployment = copy.deepcopy(dict(base.deployment_config or {}))
    deployment["request_router_config"] = router
    return base.model_copy(update={"deployment_config": deployment})


def raykv_config(s: Settings) -> Any:
    """A raykv deployment's cache config for the bench's engines: one shared host tier of
    ``host_pages`` pages (the engines read it one-sided)."""
    from raykv import CacheConfig, TierConfig

    layout = testing.tiny_layout(**s.model)
    return CacheConfig(
        layout, (TierConfig.host(s.host_pages * layout.page_bytes, pin_memory=False, shared=True),)
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def needed_cpus(s: Settings) -> float:
    """Logical CPUs the app takes: the replicas' bundles, the ingress and Serve's own actors."""
    return len(deployments_of(s)) * s.replicas * s.cpu_per_replica + 2

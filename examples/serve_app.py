"""Cache-aware routing of a real (tiny) model on Ray Serve, checked end to end.

A Serve deployment runs two replicas of a tiny random-weight Llama (transformers'
LlamaForCausalLM, fixed seed, no download). Replica rank i is paired with raykv CacheWorker i:
before a request it fetches the prompt's cached blocks from its worker, loads them into the
model's KV cache object, computes the rest, and stores the prompt's new blocks back. The
deployment routes with raykv's CacheAwareRouter, which asks the raykv index where each prompt's
prefix is cached.

The example sends several conversations that share system prompts and asserts that:
- every request's generated tokens and final logits equal a full local recompute, bit for bit;
- every repeat of a system prompt lands on the replica whose worker holds it, and reuses it.

Run: python examples/serve_app.py      (needs ray[serve], torch and transformers)
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray import serve

import raykv
from actors.serve.deployments import ReplicaCache
from actors.serve.routed import parse_request
from actors.serve.router import router_config, router_counters
from raykv.integrations.hf import (
    HFKVAdapter,
    generate_from_blocks,
    greedy_generate,
    kv_layout,
    reusable_keys,
    tiny_llama,
    tiny_llama_config,
)

SEED = 0
TPB = 8
NEW_TOKENS = 4
NAMESPACE = "raykv-serve-app"
APP = "raykv-tiny-llm"


def cache_config() -> raykv.CacheConfig:
    """Pages shaped like the tiny Llama's KV (float32), a small host tier and a disk tier."""
    layout = kv_layout(tiny_llama_config(), TPB)
    page = layout.page_bytes
    return raykv.CacheConfig(
        layout, (raykv.TierConfig.host(128 * page, pin_memory=False), raykv.TierConfig.disk(512 * page))
    )


ROUTER: dict[str, Any] = {"time_budget_s": 2.0}
"""The shipped routing policy and its one default configuration (no routing overrides); the index
gets a generous time budget (past it the router falls back to power-of-two: no affinity) so the
example's claim holds even when the replicas and workers keep every CPU busy and the index
answers late."""


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=4,
    ray_actor_options={"num_cpus": 0},
    request_router_config=router_config(NAMESPACE, **ROUTER),
)
class TinyLLM:
    """One replica: the tiny model plus its paired raykv CacheWorker."""

    def __init__(self, namespace: str, seed: int) -> None:
        torch.set_num_threads(1)
        self.model = tiny_llama(seed)
        self.kv = ReplicaCache(namespace)
        self.adapter = HFKVAdapter(self.kv.cluster.config.layout)

    def record_replica_metadata(self) -> dict[str, Any]:
        return self.kv.metadata()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.kv.routing_stats()

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"tokens": [...], "cache_salt"?: str, "max_new_tokens"?: int}`` -> generated tokens,
        final logits, the worker that served it and how many prompt tokens were reused."""
        parsed = parse_request((request,), {})
        if parsed is None:
            raise ValueError("request needs integer 'tokens'")
        tokens, new = list(parsed.tokens), int(request.get("max_new_tokens", NEW_TOKENS))
        with self.kv.prefilling(len(tokens)):
            cached = await self.kv.fetch(reusable_keys(tokens, self.kv.tokens_per_block, parsed.scope))
            gen, blocks = await asyncio.to_thread(
                generate_from_blocks, self.model, self.adapter, tokens, new, cached, parsed.scope
            )
            stored = await self.kv.store(blocks)
        return {
            "tokens": list(gen.tokens),
            "logits": gen.logits,
            "worker": str(self.kv.worker_id),
            "reused_tokens": gen.reused_tokens,
            "stored_blocks": stored,
        }


def build_app(namespace: str = NAMESPACE) -> Any:
    """The Serve application for a raykv deployment in ``namespace``."""
    config = router_config(namespace, **ROUTER)
    return TinyLLM.options(request_router_config=config).bind(namespace, SEED)


def app_builder(args: dict[str, str]) -> Any:
    """Serve's application builder for a config file or a KubeRay RayService
    (``import_path: examples.serve_app:app_builder``, ``args: {namespace: ...}``). A raykv
    deployment of :func:`cache_config`'s shape with 2 workers must run in that namespace
    (``raykv up``; cluster/kuberay-rayservice.yaml starts one); until it does, replicas fail to
    start and Serve retries them."""
    return build_app(args.get("namespace", NAMESPACE))


def workload(num_prefixes: int = 3, repeats: int = 3) -> list[tuple[int, list[int]]]:
    """Interleaved requests: ``repeats`` per system prompt (5 blocks each), distinct tails."""
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(0, 256, 5 * TPB).tolist() for _ in range(num_prefixes)]
    out = []
    for r in range(repeats):
        for p, prefix in enumerate(prefixes):
            out.append((p, prefix + rng.integers(0, 256, 3 + 2 * r + p).tolist()))
    return out


@dataclass(frozen=True)
class Summary:
    requests: int
    reused_tokens: int
    workers_by_prefix: dict[int, list[str]]


def verify(handle: Any, num_prefixes: int = 3, repeats: int = 3) -> Summary:
    """Send the workload one request at a time and assert the example's claims."""
    torch.set_num_threads(1)
    model = tiny_llama(SEED)
    workers: dict[int, list[str]] = defaultdict(list)
    reused = 0
    for prefix, tokens in workload(num_prefixes, repeats):
        out = handle.remote({"tokens": tokens}).result(timeout_s=120)
        want = greedy_generate(model, tokens, NEW_TOKENS, TPB)
        assert out["tokens"] == list(want.tokens), (out["tokens"], want.tokens)
        assert np.array_equal(out["logits"], want.logits), "logits differ from a full recompute"
        if workers[prefix]:
            held = out["worker"] == workers[prefix][0]
            assert held, f"prefix {prefix} left its holder: {out['worker']}; router {router_counters()}"
            assert out["reused_tokens"] >= 5 * TPB, out["reused_tokens"]
        workers[prefix].append(out["worker"])
        reused += out["reused_tokens"]
    return Summary(len(workload(num_prefixes, repeats)), reused, dict(workers))


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    deployment = raykv.start(num_workers=2, config=cache_config(), namespace=NAMESPACE)
    try:
        serve.start(proxy_location="Disabled")
        t0 = time.monotonic()
        handle = serve.run(build_app(), name=APP, route_prefix=None)
        print(f"serve app up in {time.monotonic() - t0:.1f}s")
        summary = verify(handle)
        for prefix, ws in sorted(summary.workers_by_prefix.items()):
            print(f"system prompt {prefix}: served by {ws}")
        print(f"{summary.requests} requests, {summary.reused_tokens} prompt tokens reused from raykv")
        print(f"router decisions: {router_counters()}")
        print("outputs equal a full recompute; repeated prefixes stayed on their holder. OK")
    finally:
        serve.shutdown()
        deployment.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

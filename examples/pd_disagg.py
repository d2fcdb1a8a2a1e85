"""Disaggregated prefill/decode on Ray Serve, KV pulled between raykv workers, checked end to end.

Three deployments and four raykv CacheWorkers:
- Prefill (2 replicas, paired with workers 0 and 1): computes the prompt's KV, reusing the blocks
  its worker already holds, and stores the prompt's blocks in its worker.
- Decode (2 replicas, paired with workers 2 and 3): pulls the prompt's blocks from the prefill
  worker into its own worker (CacheWorker.pull: raykv's page transfer over UCX), loads them into
  the tiny Llama's KV cache object, computes the short tail and decodes.
- PDProxy (ingress): picks the (prefill, decode) pair by cache location with raykv.routing.pd
  (prefill where the prefix is, decode where pulling the result is cheapest), then sends each
  phase with ``target_worker`` set; the CacheAwareRouter on Prefill and Decode honors it.

It runs two turns of three conversations (turn 2 extends turn 1's prompt) and asserts that:
- every answer (tokens and final logits) equals a full local recompute, bit for bit;
- turn 2 of a conversation goes to the same prefill and decode workers as turn 1, reuses the
  prefix on prefill and pulls only the new blocks to decode;
- the decode side pulled its blocks through the page transfer (UCX), not a recompute.

Run: python examples/pd_disagg.py      (needs ray[serve], torch, transformers and ucxx)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import ray
import torch
from ray import serve

import raykv
from actors.serve.deployments import PDPairer, ReplicaCache
from actors.serve.routed import parse_request
from actors.serve.router import router_config
from raykv.core.types import WorkerId
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
NAMESPACE = "raykv-pd-example"
PREFILL_WORKERS = ("raykv-worker-0", "raykv-worker-1")
DECODE_WORKERS = ("raykv-worker-2", "raykv-worker-3")


def cache_config() -> raykv.CacheConfig:
    layout = kv_layout(tiny_llama_config(), TPB)
    page = layout.page_bytes
    return raykv.CacheConfig(layout, (raykv.TierConfig.host(256 * page, pin_memory=False),))


class _Phase:
    """A model replica of one phase: the tiny Llama and its paired CacheWorker from ``pool``."""

    def __init__(self, namespace: str, pool: tuple[str, ...]) -> None:
        torch.set_num_threads(1)
        self.model = tiny_llama(SEED)
        self.kv = ReplicaCache(namespace, pool=pool)
        self.adapter = HFKVAdapter(self.kv.cluster.config.layout)

    def record_replica_metadata(self) -> dict[str, Any]:
        return self.kv.metadata()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.kv.routing_stats()

    async def _run(self, request: dict[str, Any], new_tokens: int) -> tuple[Any, int]:
        parsed = parse_request((request,), {})
        assert parsed is not None, "request needs integer 'tokens'"
        tokens = list(parsed.tokens)
        cached = await self.kv.fetch(reusable_keys(tokens, self.kv.tokens_per_block, parsed.scope))
        gen, blocks = await asyncio.to_thread(
            generate_from_blocks, self.model, self.adapter, tokens, new_tokens, cached, parsed.scope
        )
        return gen, await self.kv.store(blocks)


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class Prefill(_Phase):
    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.kv.prefilling(len(request["tokens"])):
            gen, stored = await self._run(request, 1)
        return {"worker": str(self.kv.worker_id), "reused_tokens": gen.reused_tokens, "stored": stored}


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class Decode(_Phase):
    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_request((request,), {})
        assert parsed is not None
        tokens = list(parsed.tokens)
        keys = reusable_keys(tokens, self.kv.tokens_per_block, parsed.scope)
        with self.kv.decoding():
            held = await self.kv.held(tokens[:-1], parsed.scope)  # pull only what is missing here
            source = WorkerId(request["pull_from"])
            pulled, path = await self.kv.pull(source, keys[held:], prefer_shm=False)
            gen, _ = await self._run(request, NEW_TOKENS)
        return {
            "worker": str(self.kv.worker_id),
            "tokens": list(gen.tokens),
            "logits": gen.logits,
            "reused_tokens": gen.reused_tokens,
            "pulled_blocks": pulled,
            "pull_path": path,
        }


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class PDProxy:
    """Pairs prefill and decode by cache location, then runs the two phases."""

    def __init__(self, prefill: Any, decode: Any, namespace: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.pairer = PDPairer(PREFILL_WORKERS, DECODE_WORKERS, namespace, time_budget_s=0.5)

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_request((request,), {})
        assert parsed is not None, "request needs integer 'tokens'"
        pair = await self.pairer.pair(parsed)
        with self.pairer.running(pair, len(parsed.tokens)):
            pre = await self.prefill.remote({**request, "target_worker": pair.prefill})
            out = await self.decode.remote(
                {**request, "target_worker": pair.decode, "pull_from": pre["worker"]}
            )
        out.update(prefill_worker=pre["worker"], prefill_reused=pre["reused_tokens"])
        out.update(planned_pull=pair.pull_blocks)
        return dict(out)


def build_app(namespace: str = NAMESPACE) -> Any:
    config = router_config(namespace, time_budget_s=0.5)
    prefill = Prefill.options(request_router_config=config).bind(namespace, PREFILL_WORKERS)
    decode = Decode.options(request_router_config=config).bind(namespace, DECODE_WORKERS)
    return PDProxy.bind(prefill, decode, namespace)


def verify(handle: Any) -> list[dict[str, Any]]:
    """Two turns of three conversations; asserts the claims in the module docstring."""
    torch.set_num_threads(1)
    model = tiny_llama(SEED)
    rng = np.random.default_rng(3)
    turn1 = [rng.integers(0, 256, 4 * TPB + 3).tolist() for _ in range(3)]
    turn2 = [t + rng.integers(0, 256, 2 * TPB + 1).tolist() for t in turn1]
    outs: list[dict[str, Any]] = []
    for tokens in turn1 + turn2:
        out = handle.remote({"tokens": tokens}).result(timeout_s=120)
        want = greedy_generate(model, tokens, NEW_TOKENS, TPB)
        assert out["tokens"] == list(want.tokens), "tokens differ from a full recompute"
        assert np.array_equal(out["logits"], want.logits), "logits differ from a full recompute"
        assert out["reused_tokens"] == (len(tokens) - 1) // TPB * TPB  # every block was there
        outs.append(out)
    for first, second in zip(outs[:3], outs[3:]):
        assert second["prefill_worker"] == first["prefill_worker"], "turn 2 left its prefill worker"
        assert second["worker"] == first["worker"], "turn 2 left its decode worker"
        assert second["prefill_reused"] >= 4 * TPB  # turn 1's prompt blocks, cached on prefill
        assert (first["pulled_blocks"], second["pulled_blocks"]) == (4, 2)  # only new blocks moved
        assert first["pull_path"] == second["pull_path"] == "ucx"
        assert second["planned_pull"] == 2  # the pairing saw what the decode worker held
    return outs


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    deployment = raykv.start(num_workers=4, config=cache_config(), namespace=NAMESPACE)
    try:
        serve.start(proxy_location="Disabled")
        t0 = time.monotonic()
        handle = serve.run(build_app(), name="raykv-pd", route_prefix=None)
        print(f"serve app up in {time.monotonic() - t0:.1f}s")
        for i, out in enumerate(verify(handle)):
            print(
                f"request {i}: prefill {out['prefill_worker']} (reused {out['prefill_reused']} tokens), "
                f"decode {out['worker']} pulled {out['pulled_blocks']} blocks over {out['pull_path']}"
            )
        print("answers equal a full recompute; turns stayed on their pair; KV moved over UCX. OK")
    finally:
        serve.shutdown()
        deployment.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

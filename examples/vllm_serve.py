"""vLLM engines with RaykvConnector on Ray Serve, routed by raykv's CacheAwareRouter.

A Serve deployment runs two replicas; replica rank i is paired with raykv CacheWorker i and runs
a vLLM engine (``vllm.LLM``, a tiny random-weight Llama made locally) whose RaykvConnector loads
from and stores to that worker. The deployment routes with raykv's CacheAwareRouter, which asks
the raykv index where each prompt's prefix is cached. (A Serve deployment around ``vllm.LLM``
rather than ``ray.serve.llm``: see the README's vLLM section.)

The example sends requests that share system prompts and asserts that every repeat of a system
prompt lands on the replica whose worker holds it and loads its blocks through the connector
(``kv_transfer_params["raykv"]["hit_blocks"]``).

Run: python examples/vllm_serve.py      (needs ray[serve] and vllm, see the README)
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import threading
import time
from typing import Any

import ray
from ray import serve

import raykv
from actors.serve import parse_request, router_config, router_counters
from actors.serve_kv import ReplicaCache
from raykv.integrations.vllm import testing

NAMESPACE = "raykv-vllm-serve"
APP = "raykv-vllm"
PREFIX_BLOCKS = 3
ROUTER: dict[str, Any] = {"time_budget_s": 2.0, "routing": {"load_cost": 0.1}}


@serve.deployment(num_replicas=2, max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class VllmReplica:
    """One replica: a vLLM engine whose RaykvConnector uses the replica's paired CacheWorker."""

    def __init__(self, namespace: str, model_dir: str) -> None:
        self.kv = ReplicaCache(namespace)
        testing.pin_engine_threads()
        from vllm import LLM

        address = str(ray.get_runtime_context().gcs_address)
        config = testing.connector_config(namespace, address, str(self.kv.worker_id))
        self.llm = LLM(**testing.engine_kwargs(model_dir, kv_transfer_config=config))
        self.lock = threading.Lock()  # one request at a time in the engine (exact outputs)

    def record_replica_metadata(self) -> dict[str, Any]:
        return self.kv.metadata()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.kv.routing_stats()

    def _generate(self, tokens: list[int]) -> testing.Result:
        with self.lock:
            return testing.generate(self.llm, tokens)

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"tokens": [...]}`` -> generated tokens, logprobs, the worker, the connector's
        results."""
        parsed = parse_request((request,), {})
        if parsed is None:
            raise ValueError("request needs integer 'tokens'")
        with self.kv.prefilling(len(parsed.tokens)):
            result = await asyncio.to_thread(self._generate, list(parsed.tokens))
        return {
            "tokens": list(result.tokens),
            "logprobs": result.logprobs,
            "worker": str(self.kv.worker_id),
            "raykv": dict(result.raykv),
        }


def build_app(model_dir: str, namespace: str = NAMESPACE) -> Any:
    """The Serve application for a raykv deployment in ``namespace``."""
    config = router_config(namespace, **ROUTER)
    return VllmReplica.options(request_router_config=config).bind(namespace, model_dir)


def workload(num_prefixes: int = 2, repeats: int = 3) -> list[tuple[int, list[int]]]:
    """Interleaved requests: ``repeats`` per system prompt (PREFIX_BLOCKS blocks), own tails."""
    rng = random.Random(7)
    size = PREFIX_BLOCKS * testing.BLOCK_SIZE
    prefixes = [[rng.randrange(1, 500) for _ in range(size)] for _ in range(num_prefixes)]
    return [
        (p, prefix + [rng.randrange(1, 500) for _ in range(5 + 3 * r + p)])
        for r in range(repeats)
        for p, prefix in enumerate(prefixes)
    ]


def wait_stored(deployment: Any, tokens: list[int], blocks: int, timeout: float = 30.0) -> None:
    """Wait until some worker holds ``blocks`` leading blocks of ``tokens`` (stores are pulled by
    the CacheWorker shortly after the engine computed them) and the index knows it."""
    deadline = time.monotonic() + timeout
    while True:
        deployment.flush()
        if any(m.blocks >= blocks for m in deployment.route(tokens).values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker holds {blocks} blocks of the prompt")
        time.sleep(0.1)


def verify(handle: Any, deployment: Any) -> dict[int, list[str]]:
    """Send the workload one request at a time and assert the example's claims."""
    workers: dict[int, list[str]] = {}
    for prefix, tokens in workload():
        out = handle.remote({"tokens": tokens}).result(timeout_s=300)
        if prefix in workers:
            holder = workers[prefix][0]
            assert out["worker"] == holder, f"prefix {prefix} left {holder}: router {router_counters()}"
            assert out["raykv"]["hit_blocks"] >= PREFIX_BLOCKS, out["raykv"]
        workers.setdefault(prefix, []).append(out["worker"])
        wait_stored(deployment, tokens, len(tokens) // testing.BLOCK_SIZE)
    return workers


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    layout = testing.tiny_layout()
    deployment = raykv.start(num_workers=2, config=testing.deployment_config(layout), namespace=NAMESPACE)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            model_dir = testing.save_tiny_llama(os.path.join(workdir, "model"))
            serve.start(proxy_location="Disabled")
            t0 = time.monotonic()
            handle = serve.run(build_app(model_dir), name=APP, route_prefix=None)
            print(f"serve app up in {time.monotonic() - t0:.1f}s")
            for prefix, ws in sorted(verify(handle, deployment).items()):
                print(f"system prompt {prefix}: served by {ws}")
            print(f"router decisions: {router_counters()}")
            print("repeated prefixes stayed on their holder and loaded their blocks through raykv. OK")
            serve.shutdown()
    finally:
        deployment.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

"""Prompts and deployment probes for the vLLM connector tests."""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ray

from actors.cache.cluster import RayKVCluster
from raykv import ReuseScope
from raykv.integrations.vllm.testing import BLOCK_SIZE

TPB = BLOCK_SIZE


def prompt(seed: int, length: int) -> list[int]:
    """Random token ids in 1..499 (seeded)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(length)]


def usable_blocks(tokens: list[int]) -> int:
    """Blocks a lookup may load: the full blocks of ``tokens[:-1]``."""
    return (len(tokens) - 1) // TPB


def worker(deployment: RayKVCluster, index: int) -> Any:
    return deployment.workers[deployment.worker_ids[index]]


def held(
    deployment: RayKVCluster, index: int, tokens: list[int], salt: str | ReuseScope | None = None
) -> Any:
    """The ProbeResult of ``tokens`` on worker ``index`` (``salt``: a cache_salt's text, or a
    scope; without a model, in that of the deployment's engines, :func:`engine_model`)."""
    if isinstance(salt, ReuseScope):
        scope = salt
    else:
        scope = ReuseScope.from_cache_salt(salt) if salt is not None else ReuseScope()
    if scope.model is None:
        scope = scope.with_model(engine_model(deployment))
    probe = worker(deployment, index).probe.remote(tokens, scope.lora_id, scope.salt, scope.model)
    return ray.get(probe, timeout=30)


def engine_model(deployment: RayKVCluster) -> bytes:
    """The model fingerprint in the keys of the engines bound to ``deployment``'s workers (the
    one model they all run; AssertionError when none is bound or they run several)."""
    found = set()
    for handle in deployment.workers.values():
        binding = ray.get(handle.binding.remote(), timeout=30)
        found.update(fingerprint for _, fingerprint in binding["engines"].values())
    assert len(found) == 1, f"engines of {len(found)} models are bound: pass a scope with its model"
    return bytes.fromhex(found.pop())


def wait_held(
    deployment: RayKVCluster,
    index: int,
    tokens: list[int],
    blocks: int,
    salt: str | ReuseScope | None = None,
    timeout: float = 20.0,
) -> None:
    """Wait until worker ``index`` holds the first ``blocks`` blocks of ``tokens`` (``salt``:
    in that cache_salt's scope, or that scope)."""
    deadline = time.monotonic() + timeout
    while held(deployment, index, tokens, salt).num_blocks < blocks:
        assert time.monotonic() < deadline, f"worker {index} never held {blocks} blocks"
        time.sleep(0.05)


@contextlib.contextmanager
def engine_on(
    layout: Any,
    workers: int,
    model_dir: str,
    ray_address: str,
    paired: int,
    connector: dict[str, Any] | None = None,
    **engine: Any,
) -> Iterator[tuple[RayKVCluster, Any]]:
    """A deployment of ``workers`` testing workers with pages of ``layout``, and an engine with
    ``engine`` settings (and ``connector`` extra config) paired with worker ``paired``; both shut
    down on exit."""
    from vllm import LLM

    import raykv
    from actors.testing import TestingCacheWorker
    from raykv.integrations.vllm import testing

    namespace = f"raykv-{uuid.uuid4().hex[:8]}"
    config = testing.deployment_config(layout, host_pages=64)
    deployment = raykv.start(
        num_workers=workers, config=config, namespace=namespace, worker_class=TestingCacheWorker
    )
    try:
        kwargs = testing.engine_kwargs(model_dir, **engine)
        kwargs["kv_transfer_config"] = testing.connector_config(
            namespace, ray_address, worker=paired, **(connector or {})
        )
        llm = LLM(**kwargs)
        try:
            yield deployment, llm
        finally:
            testing.shutdown_engine(llm)
    finally:
        deployment.shutdown()

"""Prompts and deployment probes for the vLLM connector tests."""

from __future__ import annotations

import random
import time
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

"""Shared helpers for the Ray integration and multinode tests (small configs, polling, views)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ray

import raykv
from actors.cache.cluster import RayKVCluster
from actors.cache.ray_util import shutdown_ray
from actors.testing import TestingCacheWorker
from raykv import CacheConfig, KVLayout, TierConfig
from raykv.core.types import WorkerId
from raykv.index.prefix_index import KEY_PREFIX, RouteMatch

TPB = 4  # tokens per block of small_config()
HOST_PAGES = 16
DISK_PAGES = 32
TIMEOUT_S = 60.0


def small_config() -> CacheConfig:
    """2 layers x 2 KV heads x head_dim 8, 4 tokens per block; host 16 pages, disk 32 pages."""
    layout = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB)
    page = layout.page_bytes
    return CacheConfig(
        layout, (TierConfig.host(HOST_PAGES * page, pin_memory=False), TierConfig.disk(DISK_PAGES * page))
    )


def tokens(seed: int, num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks of tokens that no other seed shares."""
    return [seed * 100_000 + i for i in range(num_blocks * TPB)]


def get(refs: Any, timeout: float = TIMEOUT_S) -> Any:
    return ray.get(refs, timeout=timeout)


@contextlib.contextmanager
def running(prefix: str, **kwargs: Any) -> Iterator[RayKVCluster]:
    """A deployment in a fresh namespace, shut down on exit. Its workers are TestingCacheWorkers
    (``run_request``, ``verify_all``, ``check``, ``set_transfer_faults``) unless ``worker_class``
    says otherwise; the config defaults to :func:`small_config`."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    kwargs.setdefault("config", small_config())
    kwargs.setdefault("worker_class", TestingCacheWorker)
    dep = raykv.start(namespace=namespace, **kwargs)
    try:
        yield dep
    finally:
        dep.shutdown()


def poll(check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1, what: str = "") -> Any:
    """Call ``check`` until it returns a truthy value (exceptions count as falsy) or time is up."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}: last={last!r}")
        time.sleep(interval)


def snapshot_view(handle: Any) -> dict[bytes, int]:
    """A worker's committed blocks: key -> tier."""
    return dict(get(handle.snapshot.remote()).blocks)


def prefixed(blocks: Mapping[bytes, int]) -> dict[bytes, int]:
    """``blocks`` keyed as the index lists them: by each key's first KEY_PREFIX bytes."""
    return {k[:KEY_PREFIX]: t for k, t in blocks.items()}


def index_view(shards: Sequence[Any], worker: str) -> dict[bytes, int]:
    """What the index lists for ``worker``: union over shards of worker_blocks (key prefix -> tier,
    compare with :func:`prefixed` of a snapshot)."""
    out: dict[bytes, int] = {}
    for part in get([s.worker_blocks.remote(worker) for s in shards]):
        assert not set(part) & set(out), "a key is listed by two shards"
        out.update(part)
    return out


def expected_route(snapshots: Mapping[WorkerId, Mapping[bytes, int]], keys: Sequence[bytes]) -> dict:
    """Brute-force route from worker snapshots: leading keys each worker holds, counted by tier."""
    out: dict[WorkerId, RouteMatch] = {}
    for worker, blocks in snapshots.items():
        n = 0
        while n < len(keys) and keys[n] in blocks:
            n += 1
        if n:
            tiers = [blocks[k] for k in keys[:n]]
            out[worker] = RouteMatch(worker, n, tiers.count(0), tiers.count(1), tiers.count(2), 0)
    return out


def load_example(filename: str) -> Any:
    """Import ``examples/<filename>`` as a module Serve replicas can unpickle by value."""
    import importlib.util
    import sys
    from pathlib import Path

    import ray

    path = Path(__file__).resolve().parents[1] / "examples" / filename
    spec = importlib.util.spec_from_file_location(f"raykv_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # replicas cannot import it by name
    return module


@contextlib.contextmanager
def serve_example(example: Any, prefix: str, num_workers: int, app_name: str) -> Iterator[tuple[Any, Any]]:
    """A raykv deployment plus the example's Serve app; yields (deployment, handle), tears both down."""
    from ray import serve

    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    dep = raykv.start(num_workers=num_workers, config=example.cache_config(), namespace=namespace)
    try:
        serve.start(proxy_location="Disabled")
        yield dep, serve.run(example.build_app(namespace), name=app_name, route_prefix=None)
    finally:
        serve.shutdown()
        dep.shutdown()


def quiet_shutdown() -> None:
    """:func:`actors.cache.ray_util.shutdown_ray` with a longer settle (a deployment was just killed)."""
    shutdown_ray(settle_s=0.5)

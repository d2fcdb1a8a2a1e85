"""examples/pd_disagg.py on the local Ray: prefill and decode deployments of a tiny Llama, a
proxy that pairs them by cache location, KV pulled between raykv workers over UCX.

``verify`` asserts per request that answers equal a full recompute bit for bit, that turn 2 of a
conversation keeps its prefill and decode workers and pulls only the new blocks; here we also
check the workers' own transfer counters: the decode workers pulled exactly those pages over UCX.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("transformers")
pytest.importorskip("ucxx")

import ray
from ray import serve

import raykv
from actors.cluster import RayKVCluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pd_disagg.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("raykv_example_pd_disagg", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # replicas cannot import it by name
    return module


@pytest.fixture(scope="module")
def pd_app(ray_local: None) -> Iterator[tuple[ModuleType, RayKVCluster, Any]]:
    example = load_example()
    namespace = f"raykv-pd-{uuid.uuid4().hex[:8]}"
    dep = raykv.start(num_workers=4, config=example.cache_config(), namespace=namespace)
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(example.build_app(namespace), name="raykv-it-pd", route_prefix=None)
        yield example, dep, handle
    finally:
        serve.shutdown()
        dep.shutdown()


def test_pd_pairs_by_cache_location_and_pulls_over_ucx(pd_app) -> None:
    example, dep, handle = pd_app
    outs = example.verify(handle)  # asserts recompute equality and pairing per request
    pulled: dict[str, int] = {}
    for out in outs:
        pulled[out["worker"]] = pulled.get(out["worker"], 0) + out["pulled_blocks"]
    for name, blocks in pulled.items():
        stats = ray.get(dep.workers[raykv.WorkerId(name)].transfer_stats.remote(), timeout=30)
        assert stats["client"]["pages"].get("ucx", 0) == blocks
        assert not stats["client"]["failures"]
    assert set(pulled) <= set(example.DECODE_WORKERS)
    assert {o["prefill_worker"] for o in outs} <= set(example.PREFILL_WORKERS)

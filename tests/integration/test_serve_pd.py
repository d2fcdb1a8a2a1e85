"""examples/pd_disagg.py on the local Ray: prefill and decode deployments of a tiny Llama, a
proxy that pairs them by cache location, KV pulled between raykv workers over UCX.

``verify`` asserts per request that answers equal a full recompute bit for bit, that turn 2 of a
conversation keeps its prefill and decode workers and pulls only the new blocks; here we also
check the workers' own transfer counters: the decode workers pulled exactly those pages over UCX.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from deps import require

require("ray.serve")
require("transformers")
require("ucxx")

import ray  # noqa: E402
from ray_helpers import load_example, serve_example  # noqa: E402

import raykv  # noqa: E402
from actors.cache.cluster import RayKVCluster  # noqa: E402


@pytest.fixture(scope="module")
def pd_app(ray_local: None) -> Iterator[tuple[ModuleType, RayKVCluster, Any]]:
    example = load_example("pd_disagg.py")
    with serve_example(example, "raykv-pd", 4, "raykv-it-pd") as (dep, handle):
        yield example, dep, handle


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

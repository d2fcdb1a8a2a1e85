"""examples/vllm_serve.py on the tests' local Ray: two Serve replicas, each a vLLM engine with
RaykvConnector paired with one CacheWorker, behind raykv's CacheAwareRouter.

Checks content: every repeat of a system prompt lands on the replica whose worker holds it and
loads at least the system prompt's blocks through the connector; the router decided with the
index (not by fallback).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")
pytest.importorskip("ray.serve")

from ray_helpers import load_example

from actors.cluster import RayKVCluster
from actors.serve import router_counters


def test_serve_routes_repeats_to_their_holder_which_loads_them(
    deployment: RayKVCluster, model_dir: str
) -> None:
    from ray import serve

    example = load_example("vllm_serve.py")
    serve.start(proxy_location="Disabled")
    try:
        app = example.build_app(model_dir, deployment.namespace)
        handle = serve.run(app, name="raykv-vllm-test", route_prefix=None)
        workers = example.verify(handle, deployment)  # asserts holder and hits per request
        assert sorted(len(ws) for ws in workers.values()) == [3, 3]
        assert all(len(set(ws)) == 1 for ws in workers.values())
        counters = next(iter(router_counters().values()))
        assert counters["cache_routed"] >= 4 and counters.get("index_errors", 0) == 0
    finally:
        serve.shutdown()

"""examples/serve_app.py on the local Ray: a Serve deployment of a tiny Llama (2 replicas, each
paired with a raykv CacheWorker) behind CacheAwareRouter.

Checks content, not calls: generated tokens and final logits equal a local full recompute bit for
bit; repeats of a system prompt land on the replica whose worker holds it (and the index agrees);
the router decided with the index, not by fallback; and when a raykv worker dies, requests still
succeed with correct outputs.
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

import numpy as np
import ray
from ray import serve

import raykv
from actors.cluster import RayKVCluster
from actors.serve import router_counters

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_app.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("raykv_example_serve_app", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # replicas cannot import it by name
    return module


@pytest.fixture(scope="module")
def app(ray_local: None) -> Iterator[tuple[ModuleType, RayKVCluster, Any]]:
    example = load_example()
    namespace = f"raykv-serve-{uuid.uuid4().hex[:8]}"
    dep = raykv.start(num_workers=2, config=example.cache_config(), namespace=namespace)
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(example.build_app(namespace), name="raykv-it-serve", route_prefix=None)
        yield example, dep, handle
    finally:
        serve.shutdown()
        dep.shutdown()


def test_outputs_match_recompute_and_prefixes_stay_on_their_holder(app) -> None:
    example, dep, handle = app
    summary = example.verify(handle, num_prefixes=3, repeats=3)  # asserts per request
    assert summary.requests == 9
    assert summary.reused_tokens >= 6 * 5 * example.TPB  # every repeat reused its system prompt
    dep.flush()
    for prefix, (_, tokens) in enumerate(example.workload(3, 1)):
        holder = summary.workers_by_prefix[prefix][0]
        match = dep.route(tokens[: 5 * example.TPB])
        assert match[raykv.WorkerId(holder)].blocks == 5  # the index agrees with where it ran
    counters = next(iter(router_counters().values()))
    assert counters["cache_routed"] >= 6 and counters.get("index_errors", 0) == 0


def test_a_dead_cache_worker_never_fails_a_request(app) -> None:
    example, dep, handle = app
    ray.kill(dep.workers[raykv.WorkerId("raykv-worker-1")], no_restart=True)
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    model = example.tiny_llama(example.SEED)
    rng = np.random.default_rng(99)
    served = set()
    for _ in range(6):
        tokens = rng.integers(0, 256, 3 * example.TPB + 5).tolist()
        out = handle.remote({"tokens": tokens}).result(timeout_s=120)
        want = example.greedy_generate(model, tokens, example.NEW_TOKENS, example.TPB)
        assert out["tokens"] == list(want.tokens) and np.array_equal(out["logits"], want.logits)
        served.add(out["worker"])
    assert served <= {"raykv-worker-0", "raykv-worker-1"}

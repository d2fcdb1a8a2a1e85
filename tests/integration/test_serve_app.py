"""examples/serve_app.py on the local Ray: a Serve deployment of a tiny Llama (2 replicas, each
paired with a raykv CacheWorker) behind CacheAwareRouter.

Checks content, not calls: generated tokens and final logits equal a local full recompute bit for
bit; repeats of a system prompt land on the replica whose worker holds it (and the index agrees);
the router decided with the index, not by fallback; and when a raykv worker dies, requests still
succeed with correct outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from deps import require

require("ray.serve")
require("transformers")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray_helpers import load_example, serve_example  # noqa: E402

import raykv  # noqa: E402
from actors.cache.cluster import RayKVCluster  # noqa: E402
from actors.serve.router import router_counters  # noqa: E402


@pytest.fixture(scope="module")
def app(ray_local: None) -> Iterator[tuple[ModuleType, RayKVCluster, Any]]:
    example = load_example("serve_app.py")
    with serve_example(example, "raykv-serve", 2, "raykv-it-serve") as (dep, handle):
        yield example, dep, handle


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
    torch = require("torch")
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

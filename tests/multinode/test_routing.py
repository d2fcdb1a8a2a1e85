"""One CacheWorker per logical node, a 2-shard index: events from every node reach the index and
routes match a brute-force union of the workers' snapshots."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_helpers import (
    DISK_PAGES,
    HOST_PAGES,
    expected_route,
    get,
    index_view,
    prefixed,
    running,
    snapshot_view,
    tokens,
)

from actors.cache.cluster import RayKVCluster
from raykv import TierKind

from .conftest import NODE_RESOURCES, NUM_NODES


@pytest.fixture(scope="module")
def deployment(cluster: Cluster) -> Iterator[RayKVCluster]:
    with running("raykv-mn", num_workers=NUM_NODES, index_shards=2, worker_resources=NODE_RESOURCES) as dep:
        yield dep


def _handles(dep: RayKVCluster) -> list[Any]:
    return [dep.workers[w] for w in dep.worker_ids]


def _snapshots(dep: RayKVCluster) -> dict:
    return {w: snapshot_view(dep.workers[w]) for w in dep.worker_ids}


def test_each_worker_runs_on_its_own_node(deployment: RayKVCluster) -> None:
    for name, handle in deployment.workers.items():
        assert get(handle.health.remote())["worker"] == name
    try:
        from ray._private import state

        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        node_ids = [
            state.actors(actor_id=h._actor_id.hex())["Address"]["NodeID"] for h in _handles(deployment)
        ]
    except (ImportError, AttributeError, KeyError, TypeError) as exc:  # private API moved
        pytest.skip(f"cannot read actor placement: {exc!r}")
    assert len(resources) == NUM_NODES
    assert len(set(node_ids)) == NUM_NODES
    for i, node_id in enumerate(node_ids):
        assert resources[node_id].get(f"node{i}") == 1.0, (i, resources[node_id])


def test_events_from_every_node_reach_the_index(deployment: RayKVCluster) -> None:
    prompts = [tokens(100 + i, 3 + i) for i in range(NUM_NODES)]
    for handle, prompt in zip(_handles(deployment), prompts):
        get(handle.run_request.remote(prompt))
    deployment.flush()
    for i, (worker, prompt) in enumerate(zip(deployment.worker_ids, prompts)):
        route = deployment.route(prompt)
        assert set(route) == {worker}, route
        assert route[worker].blocks == 3 + i
        probe = get(deployment.workers[worker].probe.remote(prompt))
        m = route[worker]
        assert (m.gpu, m.host, m.disk) == tuple(probe.blocks_on(k) for k in TierKind)
    snaps = _snapshots(deployment)
    for worker in deployment.worker_ids:
        assert index_view(deployment.shards, worker) == prefixed(snaps[worker])
    # Both shards own some of the keys.
    assert all(info["entries"] > 0 for info in deployment.index_info())


def test_route_picks_the_node_with_the_longest_prefix(deployment: RayKVCluster) -> None:
    prompt = tokens(110, 8)
    lengths = [2, 8, 5]
    for handle, n in zip(_handles(deployment), lengths):
        get(handle.run_request.remote(prompt[: n * 4]))
    deployment.flush()
    route = deployment.route(prompt)
    assert {w: m.blocks for w, m in route.items()} == dict(zip(deployment.worker_ids, lengths))
    assert max(route.values(), key=lambda m: m.blocks).worker == deployment.worker_ids[1]
    assert route == expected_route(_snapshots(deployment), deployment.keys(prompt))


def test_evictions_propagate(deployment: RayKVCluster) -> None:
    w1 = deployment.worker_ids[1]
    handle = deployment.workers[w1]
    first = tokens(120, 5)
    prompts = [first] + [tokens(121 + i, 5) for i in range(12)]
    assert 5 * len(prompts) > HOST_PAGES + DISK_PAGES
    for prompt in prompts:
        get(handle.run_request.remote(prompt))
    deployment.flush()
    assert get(handle.stats.remote()).evictions[-1] > 0
    snaps = _snapshots(deployment)
    assert len(snaps[w1]) == HOST_PAGES + DISK_PAGES
    for worker in deployment.worker_ids:
        assert index_view(deployment.shards, worker) == prefixed(snaps[worker])
    probe = get(handle.probe.remote(first))
    assert probe.num_blocks < 5
    route = deployment.route(first)
    assert (route[w1].blocks if w1 in route else 0) == probe.num_blocks


def test_two_shards_match_brute_force_union(deployment: RayKVCluster) -> None:
    handles = _handles(deployment)
    shared = tokens(130, 6)
    get(handles[0].run_request.remote(shared))
    get(handles[2].run_request.remote(shared[:16] + tokens(131, 3)))
    get(handles[1].run_request.remote(shared[:8]))
    deployment.flush()
    snaps = _snapshots(deployment)
    queries = [
        shared,
        shared[:16] + tokens(131, 3),
        shared[:8],
        *(tokens(100 + i, 3 + i) for i in range(NUM_NODES)),
        tokens(110, 8),
        *(tokens(120 + i, 5) for i in range(13)),
        tokens(999, 4),
    ]
    nonempty = 0
    for prompt in queries:
        want = expected_route(snaps, deployment.keys(prompt))
        assert deployment.route(prompt) == want, prompt[:1]
        nonempty += bool(want)
    assert nonempty >= 8
    # The union over shards partitions each worker's keys.
    per_shard = [get(s.info.remote())["entries"] for s in deployment.shards]
    assert sum(per_shard) == len(set().union(*(set(s) for s in snaps.values())))

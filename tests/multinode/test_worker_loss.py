"""Killing the worker on one node purges only its entries, on every index shard."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_helpers import expected_route, get, index_view, poll, prefixed, running, snapshot_view, tokens

from actors.cache.cluster import RayKVCluster

from .conftest import NODE_RESOURCES, NUM_NODES


@pytest.fixture(scope="module")
def deployment(cluster: Cluster) -> Iterator[RayKVCluster]:
    with running(
        "raykv-mn-loss", num_workers=NUM_NODES, index_shards=2, worker_resources=NODE_RESOURCES
    ) as dep:
        yield dep


def test_killing_one_nodes_worker_purges_only_its_entries(deployment: RayKVCluster) -> None:
    ids = deployment.worker_ids
    shared = tokens(200, 6)
    own = [tokens(201 + i, 4) for i in range(NUM_NODES)]
    for worker, prompt in zip(ids, own):
        get(deployment.workers[worker].run_request.remote(shared))
        get(deployment.workers[worker].run_request.remote(prompt))
    deployment.flush()
    assert set(deployment.route(shared)) == set(ids)
    victim, survivors = ids[2], ids[:2]
    views = {w: index_view(deployment.shards, w) for w in survivors}
    purged = [i["counters"].get("workers_purged", 0) for i in deployment.index_info()]

    ray.kill(deployment.workers[victim], no_restart=True)
    poll(lambda: victim not in deployment.route(shared), timeout=20, what=f"{victim} leaves the route")
    poll(
        lambda: all(victim not in i["workers"] for i in deployment.index_info()),
        timeout=20,
        what=f"{victim} purged from every shard",
    )
    for info, n in zip(deployment.index_info(), purged):
        assert info["counters"]["workers_purged"] == n + 1
        assert set(info["workers"]) == set(survivors)
    assert deployment.route(own[2]) == {}
    snaps = {w: snapshot_view(deployment.workers[w]) for w in survivors}
    for worker in survivors:
        assert index_view(deployment.shards, worker) == views[worker] == prefixed(snaps[worker])
    for prompt in (shared, *own):
        assert deployment.route(prompt) == expected_route(snaps, deployment.keys(prompt))
    # The survivors keep publishing.
    fresh = tokens(210, 3)
    handle = deployment.workers[survivors[0]]
    get(handle.run_request.remote(fresh))
    get(handle.flush_and_wait.remote())  # deployment.flush() would call the dead worker too
    assert deployment.route(fresh)[survivors[0]].blocks == 3

"""Pairing by node: a Serve replica pairs with a CacheWorker on its own Ray node
(``actors.serve.deployments.pair_on_node``), claims it for its model, and on a node without one gets
NoWorkerOnNode (its connector then runs without raykv rather than storing into nothing).

Workers on nodes 1 and 2 only (none on node 0), in a deployment started without a layout; the
"replicas" are small actors pinned to a node, calling what a replica's connector backend calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_helpers import get, running

from actors.cache.cluster import RayKVCluster
from actors.testing import PairingProbe
from raykv.integrations.vllm.link import DISABLED_KEY, open_link

from .conftest import NODE_RESOURCES


@pytest.fixture(scope="module")
def deployment(cluster: Cluster) -> Iterator[RayKVCluster]:
    pinned = [NODE_RESOURCES[1], NODE_RESOURCES[2], NODE_RESOURCES[2]]  # node 2 has two workers
    with running("raykv-pair", num_workers=3, engine_layouts=True, worker_resources=pinned) as dep:
        yield dep


def _replica(dep: RayKVCluster, node: int) -> Any:
    return ray.remote(PairingProbe).options(num_cpus=0, resources=NODE_RESOURCES[node]).remote(dep.namespace)


def test_replicas_pair_on_their_own_node_rotated_by_rank(deployment: RayKVCluster) -> None:
    names = [str(w) for w in deployment.worker_ids]
    replicas = {i: _replica(deployment, i) for i in (0, 1, 2)}
    try:
        nodes = {i: get(r.node.remote()) for i, r in replicas.items()}
        bindings = [get(deployment.workers[w].binding.remote()) for w in deployment.worker_ids]
        assert [b["node_id"] for b in bindings] == [nodes[1], nodes[2], nodes[2]]
        assert get(replicas[1].pair.remote("e1", "llama", 0)) == names[0]
        assert get(replicas[1].pair.remote("e2", "llama", 1)) == names[0]  # the node's only worker
        assert get(replicas[2].pair.remote("e3", "llama", 0)) == names[1]
        assert get(replicas[2].pair.remote("e4", "llama", 1)) == names[2]  # rank 1: the node's next
        engines = [get(deployment.workers[w].binding.remote())["engines"] for w in deployment.worker_ids]
        assert [sorted(e) for e in engines] == [["e1", "e2"], ["e3"], ["e4"]]  # claimed for "llama"
        none = get(replicas[0].pair.remote("e5", "llama", 0))
        assert none.startswith("none: no raykv worker") and nodes[0] in none, none
    finally:
        for r in replicas.values():
            ray.kill(r)


def test_a_model_claims_a_free_worker_before_sharing_one(deployment: RayKVCluster) -> None:
    """Two models on node 2's two workers: the second model's replica skips the worker the first
    claimed (in a deployment that takes engine layouts, a worker holds one layout)."""
    names = [str(w) for w in deployment.worker_ids]
    for w in deployment.worker_ids[1:]:
        for engine in list(get(deployment.workers[w].binding.remote())["engines"]):
            get(deployment.workers[w].unbind_engine.remote(engine))
    replica = _replica(deployment, 2)
    try:
        a = get(replica.pair.remote("a0", "model-a", 0))
        b = get(replica.pair.remote("b0", "model-b", 0))  # rank 0 too: starts at a's worker, skips it
        assert {a, b} == set(names[1:])
        c = get(replica.pair.remote("c0", "model-c", 0))  # no free worker left: shares a's
        assert c == a
    finally:
        ray.kill(replica)


def test_a_disabled_connector_opens_no_link() -> None:
    assert open_link({DISABLED_KEY: True, "link": "no.such:module"}) is None

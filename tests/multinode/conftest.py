"""Fixtures for the multinode tests: one ray.cluster_utils.Cluster of 3 logical nodes.

``cluster`` (package scope) starts a head and two worker nodes on this machine, each with
``num_cpus=1``, a 100 MiB object store and a custom resource ``{"nodeI": 1}`` so actors can be
pinned to node I; the driver connects to it. ``NODE_RESOURCES[i]`` pins one CacheWorker to node i
through ``raykv.start(worker_resources=...)``. Everything is torn down after the last test here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_helpers import quiet_shutdown

NUM_NODES = 3
OBJECT_STORE = 100 * 1024 * 1024
NODE_RESOURCES = [{f"node{i}": 0.01} for i in range(NUM_NODES)]


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        quiet_shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node0": 1},
            "object_store_memory": OBJECT_STORE,
            "include_dashboard": False,
        },
    )
    try:
        for i in range(1, NUM_NODES):
            cluster.add_node(num_cpus=1, resources={f"node{i}": 1}, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="raykv-multinode-driver")
        yield cluster
    finally:
        quiet_shutdown()
        cluster.shutdown()

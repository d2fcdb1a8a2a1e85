"""Fixtures for the one-node Ray integration tests.

``ray_local`` (package scope) starts a small local Ray (2 CPUs, 100 MiB object store, no
dashboard) once for every module here and shuts it down after the last one. ``deployment``
(module scope) is a raykv deployment with 3 CPU workers and 2 index shards using the small
``helpers.small_config()``; modules that need another shape start their own with
``helpers.running``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray_helpers import quiet_shutdown, running

from actors.cache.cluster import RayKVCluster


@pytest.fixture(scope="package")
def ray_local() -> Iterator[None]:
    if ray.is_initialized():
        quiet_shutdown()
    ray.init(
        address="local",  # never attach to another Ray instance on this machine
        num_cpus=2,
        object_store_memory=100 * 1024 * 1024,
        include_dashboard=False,
        namespace="raykv-integration-driver",
    )
    yield
    quiet_shutdown()


@pytest.fixture(scope="module")
def deployment(ray_local: None) -> Iterator[RayKVCluster]:
    with running("raykv-it", num_workers=3, index_shards=2) as dep:
        yield dep

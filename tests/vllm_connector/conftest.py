"""Fixtures for the vLLM connector tests (each module skips itself without vllm).

(The directory is not called ``tests/vllm``: tests/ is on sys.path, so a test package named
``vllm`` would shadow the real one.)

Everything is session-scoped and built on first use, because one engine takes ~30-45 s to start
on 2 cores: a local Ray (``ray_address``), a raykv deployment of two CPU workers whose layout is
the tiny model's (``deployment``), the tiny random-weight Llama (``model_dir``) and the engines:
``baseline`` (no connector), ``engine_a`` (kv_both, worker 0, through ``FaultyDeploymentLink``),
``engine_b`` (kv_consumer, worker 1, ``timeout_s`` 4 so that a fetch that times out costs
little) and ``producer`` (kv_producer, worker 0). Engines run one request at a time with
one-block prefill chunks (see raykv.integrations.vllm.testing), so outputs are bit-exact across
engines. Everything is shut down at the end of the session.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

import raykv
from actors.cache.cluster import RayKVCluster
from actors.cache.ray_util import shutdown_ray
from actors.testing import TestingCacheWorker
from raykv.integrations.vllm import testing

HOST_PAGES = 64


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    if ray.is_initialized():
        shutdown_ray()
    # 8 logical CPUs: a Ray Serve LLM replica reserves 2 (its actor and its engine's bundle)
    # Serve's router asks a replica for its queue length before sending it a request and skips
    # it when no answer comes within 0.1 s (then the next-ranked replica serves): on a loaded
    # 2-core machine that moved a repeat off the replica holding its prefix. 1 s here.
    env = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=100 << 20,
        runtime_env={"env_vars": env},
    )
    yield str(ray.get_runtime_context().gcs_address)
    shutdown_ray()


FAULTY_LINK = "actors.testing:FaultyDeploymentLink"  # a request may ask it to drop the cache


@pytest.fixture(scope="session")
def deployment(ray_address: str) -> Iterator[RayKVCluster]:
    config = testing.deployment_config(testing.tiny_layout(), host_pages=HOST_PAGES, disk_pages=1024)
    dep = raykv.start(
        num_workers=2,
        config=config,
        namespace=f"raykv-vllm-{uuid.uuid4().hex[:8]}",
        worker_class=TestingCacheWorker,
    )
    yield dep
    dep.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return testing.save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def engines(model_dir: str, deployment: RayKVCluster, ray_address: str) -> Iterator[Callable[[str], Any]]:
    """``engines(name)``: the named engine, started on first use (see the module docstring)."""
    from vllm import LLM

    saved = testing.pin_engine_threads()
    roles = {
        "baseline": None,
        "engine_a": dict(worker=0, role="kv_both", link=FAULTY_LINK),
        "engine_b": dict(worker=1, role="kv_consumer", timeout_s=4.0),
        "producer": dict(worker=0, role="kv_producer"),
    }
    started: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in started:
            spec = roles[name]
            kwargs = testing.engine_kwargs(model_dir)
            if spec is not None:
                kwargs["kv_transfer_config"] = testing.connector_config(
                    deployment.namespace, ray_address, **spec
                )
            started[name] = LLM(**kwargs)
        return started[name]

    yield get
    for llm in started.values():
        testing.shutdown_engine(llm)
    testing.restore_env(saved)


@pytest.fixture(scope="session")
def baseline(engines: Callable[[str], Any]) -> Any:
    return engines("baseline")


@pytest.fixture(scope="session")
def engine_a(engines: Callable[[str], Any]) -> Any:
    return engines("engine_a")

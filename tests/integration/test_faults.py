"""Faults on a deployment of its own: a killed index shard is restarted by Ray and rebuilds its
routes from worker snapshots; a killed worker is purged from every shard by the heartbeat."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray_helpers import get, index_view, poll, prefixed, running, snapshot_view, tokens

from actors.cache.cluster import RayKVCluster


@pytest.fixture(scope="module")
def faulty(ray_local: None) -> Iterator[RayKVCluster]:
    with running("raykv-it-faults", num_workers=2, index_shards=2) as dep:
        yield dep


def _fill(dep: RayKVCluster) -> list[list[int]]:
    w0, w1 = (dep.workers[w] for w in dep.worker_ids)
    prompts = [tokens(20, 6), tokens(21, 4), tokens(22, 9)]
    get(w0.run_request.remote(prompts[0]))
    get(w1.run_request.remote(prompts[0][:12]))
    get(w1.run_request.remote(prompts[1]))
    get(w0.run_request.remote(prompts[2]))
    get(w1.run_request.remote(prompts[2]))
    dep.flush()
    return prompts


def _info(shard: object) -> dict:
    return get(shard.info.remote(), timeout=5)  # type: ignore[attr-defined]


def test_killed_shard_restarts_and_recovers_routes(faulty: RayKVCluster) -> None:
    prompts = _fill(faulty)
    before = [faulty.route(p) for p in prompts]
    assert all(before), before
    views = {w: index_view(faulty.shards, w) for w in faulty.worker_ids}
    assert all(views.values())
    victim = faulty.shards[0]
    assert _info(victim)["restarted"] is False

    ray.kill(victim, no_restart=False)
    info = poll(lambda: (i := _info(victim))["restarted"] and i, timeout=30, what="shard restart")
    assert info["counters"].get("snapshots", 0) >= len(faulty.worker_ids)
    assert set(info["workers"]) == set(faulty.worker_ids)
    poll(lambda: [faulty.route(p) for p in prompts] == before, timeout=20, what="routes after restart")
    assert {w: index_view(faulty.shards, w) for w in faulty.worker_ids} == views

    # The workers' sinks keep feeding the restarted shard.
    w0 = faulty.worker_ids[0]
    fresh = tokens(23, 7)
    get(faulty.workers[w0].run_request.remote(fresh))
    faulty.flush()
    assert faulty.route(fresh)[w0].blocks == 7
    for worker in faulty.worker_ids:
        assert index_view(faulty.shards, worker) == prefixed(snapshot_view(faulty.workers[worker]))


def test_killed_worker_is_purged(faulty: RayKVCluster) -> None:
    w0, w1 = faulty.worker_ids
    prompt = tokens(24, 5)
    for w in (w0, w1):
        get(faulty.workers[w].run_request.remote(prompt))
    faulty.flush()
    route = faulty.route(prompt)
    assert route[w0].blocks == 5 and route[w1].blocks == 5
    purged_before = [i["counters"].get("workers_purged", 0) for i in faulty.index_info()]

    ray.kill(faulty.workers[w0], no_restart=True)
    poll(lambda: w0 not in faulty.route(prompt), timeout=20, what=f"{w0} purged from the route")
    poll(
        lambda: all(w0 not in i["workers"] for i in faulty.index_info()),
        timeout=20,
        what=f"{w0} purged from every shard",
    )
    after = faulty.index_info()
    for info, n in zip(after, purged_before):
        assert info["counters"]["workers_purged"] == n + 1
        assert set(info["workers"]) == {w1}
    assert faulty.route(prompt)[w1].blocks == 5
    assert index_view(faulty.shards, w1) == prefixed(snapshot_view(faulty.workers[w1]))
    for p in (tokens(20, 6), tokens(22, 9)):
        assert set(faulty.route(p)) <= {w1}

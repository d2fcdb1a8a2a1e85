"""Events of real CacheWorker actors reach a 2-shard index; routes, evictions, bad input, connect."""

from __future__ import annotations

import time
import uuid

import pytest
from ray_helpers import DISK_PAGES, HOST_PAGES, get, index_view, poll, prefixed, snapshot_view, tokens

import raykv
from actors.cache.cluster import RayKVCluster
from raykv import TierKind
from raykv.core.types import WorkerId
from raykv.index.prefix_index import OP_REMOVE, OP_STORE, EventBatch


def test_events_reach_the_index(deployment: RayKVCluster) -> None:
    a, b, c = deployment.worker_ids
    wa = deployment.workers[a]
    prompt = tokens(1, 8)
    first = get(wa.run_request.remote(prompt))
    assert first.committed_blocks == 8
    # 12 more blocks on a 16-page host tier push part of the first prompt down to disk.
    get(wa.run_request.remote(tokens(2, 12)))
    deployment.flush()

    probe = get(wa.probe.remote(prompt))
    assert probe.num_blocks == 8
    route = deployment.route(prompt)
    assert set(route) == {a}, route
    match = route[a]
    assert match.worker == a
    assert match.blocks == probe.num_blocks
    assert (match.gpu, match.host, match.disk) == tuple(probe.blocks_on(k) for k in TierKind)
    assert match.predicted == 0
    assert match.host > 0 and match.disk > 0, match
    assert index_view(deployment.shards, a) == prefixed(snapshot_view(wa))
    assert index_view(deployment.shards, b) == {} and index_view(deployment.shards, c) == {}


def test_route_reports_each_workers_prefix(deployment: RayKVCluster) -> None:
    a, b = deployment.worker_ids[:2]
    prompt = tokens(3, 6)
    get(deployment.workers[a].run_request.remote(prompt[:12]))
    get(deployment.workers[b].run_request.remote(prompt))
    deployment.flush()

    route = deployment.route(prompt)
    assert set(route) == {a, b}, route
    assert route[a].blocks == 3 and route[b].blocks == 6
    assert max(route.values(), key=lambda m: m.blocks).worker == b
    assert route[a].host + route[a].disk == 3 and route[b].host + route[b].disk == 6
    # A query shorter than both prefixes: both match all of it.
    short = deployment.route(prompt[:8])
    assert {w: m.blocks for w, m in short.items()} == {a: 2, b: 2}
    # A partial trailing block has no key, so it changes nothing.
    assert deployment.route([*prompt, 7]) == route
    assert deployment.route(tokens(4, 3)) == {}


def test_evicted_blocks_leave_the_index(deployment: RayKVCluster) -> None:
    ids = deployment.worker_ids
    c = ids[2]
    wc = deployment.workers[c]
    first = tokens(10, 5)
    prompts = [first] + [tokens(11 + i, 5) for i in range(14)]
    assert 5 * len(prompts) > HOST_PAGES + DISK_PAGES
    for prompt in prompts:
        get(wc.run_request.remote(prompt))
    deployment.flush()

    stats = get(wc.stats.remote())
    assert stats.evictions[-1] > 0, stats
    snap = snapshot_view(wc)
    assert len(snap) == HOST_PAGES + DISK_PAGES
    view = index_view(deployment.shards, c)
    assert view == prefixed(snap)
    probe = get(wc.probe.remote(first))
    assert probe.num_blocks < 5
    keys = deployment.keys(first)
    for key in keys:
        assert (key in view) == (key in snap)
    route = deployment.route(first)
    if probe.num_blocks:
        assert route[c].blocks == probe.num_blocks
    else:
        assert c not in route
    # Every worker's view stays exact, not only the one that evicted.
    for worker in ids:
        assert index_view(deployment.shards, worker) == prefixed(snapshot_view(deployment.workers[worker]))


def test_bad_batches_are_rejected_and_change_nothing(deployment: RayKVCluster) -> None:
    a = deployment.worker_ids[0]
    wa = deployment.workers[a]
    prompt = tokens(30, 4)
    get(wa.run_request.remote(prompt))
    deployment.flush()
    _, _, incarnation = get(wa.identity.remote())
    key = deployment.keys(prompt)[0]
    route = deployment.route(prompt)
    views = {w: index_view(deployment.shards, w) for w in deployment.worker_ids}
    counters = [info["counters"] for info in deployment.index_info()]
    assert route[a].blocks == 4

    far = 10**9
    cases = [
        (EventBatch(WorkerId("nobody"), 1, 1, 1, ((OP_REMOVE, key, 0),)), "unknown_worker", "unknown_worker"),
        (EventBatch(a, incarnation, far, far, ((OP_STORE, b"\x01" * 31, 1),)), "malformed", "malformed"),
        (EventBatch(a, incarnation, far, far, ((OP_STORE, key, 7),)), "malformed", "malformed"),
        (EventBatch(a, incarnation, 0, 0, ((OP_REMOVE, key, 0),)), "malformed", "malformed"),
        (EventBatch(a, incarnation - 1, far, far, ((OP_REMOVE, key, 0),)), "stale_incarnation", None),
    ]
    for batch, result, _ in cases:
        for shard in deployment.shards:
            assert get(shard.apply_batch.remote(batch)) == result, batch

    after = [info["counters"] for info in deployment.index_info()]
    for before_c, after_c in zip(counters, after):
        assert after_c["rejected_unknown_worker"] == before_c.get("rejected_unknown_worker", 0) + 1
        assert after_c["rejected_malformed"] == before_c.get("rejected_malformed", 0) + 3
        assert after_c["rejected_stale_incarnation"] == before_c.get("rejected_stale_incarnation", 0) + 1
    assert deployment.route(prompt) == route
    assert {w: index_view(deployment.shards, w) for w in deployment.worker_ids} == views
    # The real stream still flows afterwards.
    more = tokens(31, 2)
    get(wa.run_request.remote(more))
    deployment.flush()
    assert deployment.route(more)[a].blocks == 2


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_route_rejects_bad_tokens(deployment: RayKVCluster, bad: int) -> None:
    prompt = [1, 2, 3, bad]
    with pytest.raises(ValueError):
        raykv.block_keys(prompt, 4)
    with pytest.raises(ValueError):
        deployment.route(prompt)
    with pytest.raises(ValueError):
        deployment.keys(prompt)


def test_start_twice_and_connect(deployment: RayKVCluster) -> None:
    with pytest.raises(raykv.StateError):
        raykv.start(num_workers=1, config=deployment.config, namespace=deployment.namespace)
    b = deployment.worker_ids[1]
    prompt = tokens(40, 3)
    get(deployment.workers[b].run_request.remote(prompt))
    deployment.flush()

    other = raykv.connect(deployment.namespace)
    assert other.worker_ids == deployment.worker_ids
    assert other.config == deployment.config
    assert len(other.shards) == len(deployment.shards) == 2
    route = other.route(prompt)
    assert route == deployment.route(prompt)
    assert route[b].blocks == 3
    other.flush()  # a connected handle can drive the same actors
    with pytest.raises(raykv.StateError):
        raykv.connect(f"raykv-nothing-{uuid.uuid4().hex[:8]}")
    # The failed start left the running deployment alone.
    assert len(deployment.index_info()) == 2
    assert all(get(w.health.remote())["worker"] == n for n, w in deployment.workers.items())


def test_workers_keep_answering_with_metrics_exported(deployment: RayKVCluster) -> None:
    poll(lambda: time.time() - deployment.spec.created_at > 1.5, timeout=10, what="deployment age")
    for name, handle in deployment.workers.items():
        health = get(handle.health.remote())
        assert health["worker"] == name and health["open_requests"] == 0
        assert health["metrics_exports"] >= 1  # through ray.util.metrics, every METRICS_INTERVAL_S
    stats = deployment.stats()
    assert set(stats) == set(deployment.worker_ids)

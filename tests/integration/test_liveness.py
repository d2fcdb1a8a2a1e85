"""Liveness and bounded waits on a deployment of its own (3 workers that Ray restarts once,
2 index shards): a stopped shard costs a route or flush at most the call timeout, a stopped or
dead worker is skipped within 2 s and a restarted one taken back, and connect() to a deployment
with a dead worker works with the rest and reports it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import ray
from ray_helpers import TPB, get, poll, running, tokens

import raykv
from actors.cache.cluster import RayKVCluster
from actors.cache.liveness import CALL_TIMEOUT_S
from actors.serve.deployments import PDPairer
from actors.serve.routed import RoutedRequest
from raykv.core.errors import TransferError, TransferFailure, UnavailableError
from raykv.core.keys import ReuseScope
from raykv.index.prefix_index import shard_of
from raykv.routing.policy import DEFAULT_ROUTING, WorkerLoad

SKIP_S = 2.0  # a dead or stopped worker is skipped within this long
SLACK_S = 2.0  # scheduling slack on a loaded machine


@pytest.fixture(scope="module")
def dep(ray_local: None) -> Iterator[RayKVCluster]:
    # the cached prefix and liveness alone pick: these tests pick in loops without sending any
    # request, so no recent-work charge, and no balance rule (hundreds of picks of one holder
    # put it past its share, and it would be left out while still up); DEFAULT_ROUTING's other
    # parameters, this block size
    routing = replace(DEFAULT_ROUTING, tokens_per_block=TPB, recent_weight=0.0, balance_limit=1e9)
    with running("raykv-it-live", num_workers=3, index_shards=2, max_restarts=1, routing=routing) as d:
        yield d


def _cache(dep: RayKVCluster, worker: str, prompt: list[int]) -> None:
    get(dep.workers[raykv.WorkerId(worker)].run_request.remote(prompt))
    assert not dep.flush()


def _picks_until_skipped(dep: RayKVCluster, prompt: list[int], victim: str, start: float) -> float:
    """Pick until 60 picks in a row avoid ``victim``; seconds from ``start`` to the first of them.
    Every picked worker must answer (callers never meet a dead one)."""
    streak, first = 0, time.monotonic()
    while streak < 60:
        assert time.monotonic() - start < 30, f"{victim} still picked"
        worker = dep.pick_worker(prompt).worker
        if worker == victim:
            streak = 0
            continue
        if streak == 0:
            first = time.monotonic()
        streak += 1
        get(dep.workers[worker].identity.remote(), timeout=10)
    return first - start


def _pick_idle(dep: RayKVCluster, idle: str) -> str:
    """The pick for a prompt no worker holds when ``idle`` is the only idle worker."""
    loads = [WorkerLoad(w, 0 if w == idle else 10_000) for w in dep.worker_ids]
    return dep.pick_worker(tokens(49, 2), loads=loads).worker


def test_stopped_shard_costs_route_and_flush_at_most_the_timeout(dep: RayKVCluster) -> None:
    w0 = dep.worker_ids[0]
    prompt = tokens(40, 8)
    _cache(dep, w0, prompt)
    keys = dep.keys(prompt)
    assert dep.route(prompt)[w0].blocks == 8
    lead = next((i for i, k in enumerate(keys) if shard_of(k, 2) == 1), len(keys))
    name = dep.spec.shards[1]
    pid = get(dep.shards[1].info.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        route = dep.route(prompt)  # the first route waits for the stopped shard, then degrades
        first_s = time.monotonic() - t0
        assert first_s <= CALL_TIMEOUT_S + SLACK_S, first_s
        assert route.get(w0, None) is None if lead == 0 else route[w0].blocks == lead
        assert dep.health()["shards"][name] == "late" and name in dep.unavailable
        t0 = time.monotonic()
        assert dep.route(prompt) == route  # later ones skip it without waiting
        assert dep.pick_worker(prompt).worker in dep.worker_ids
        again_s = time.monotonic() - t0
        assert again_s < 1.0, again_s
        get(dep.workers[w0].run_request.remote(tokens(44, 3)))  # events the stopped shard owes
        t0 = time.monotonic()
        with pytest.raises(UnavailableError) as err:
            dep.flush()
        flush_s = time.monotonic() - t0
        assert flush_s <= CALL_TIMEOUT_S + SLACK_S, flush_s
        assert err.value.shards == (name,) and err.value.reason == "timeout"
        print(f"stopped shard: first route {first_s:.2f}s, then {again_s:.3f}s, flush {flush_s:.2f}s")
    finally:
        os.kill(pid, signal.SIGCONT)
    poll(lambda: dep.route(prompt)[w0].blocks == 8, timeout=30, what="the shard taken back")
    assert dep.health()["shards"][name] == "up"


def test_stopped_worker_is_skipped_then_taken_back(dep: RayKVCluster) -> None:
    w0, w1 = dep.worker_ids[:2]
    prompt = tokens(41, 6)
    _cache(dep, w1, prompt)
    assert dep.pick_worker(prompt).worker == w1
    pid = get(dep.workers[w1].health.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        skip_s = _picks_until_skipped(dep, prompt, w1, t0)
        assert skip_s <= SKIP_S, skip_s
        assert dep.health()["workers"][w1] == "late" and w1 not in dep.live_workers()
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            dep.pull(w0, w1, dep.keys(prompt))
        assert err.value.reason is TransferFailure.UNAVAILABLE and time.monotonic() - t0 < 1.0
        print(f"stopped worker skipped after {skip_s:.2f}s")
    finally:
        os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    poll(lambda: dep.health()["workers"][w1] == "up", timeout=10, what=f"{w1} up again")
    poll(lambda: _pick_idle(dep, w1) == w1, timeout=20, what=f"{w1} picked again")
    print(f"stopped worker taken back after {time.monotonic() - t0:.2f}s")


def test_worker_restarted_by_ray_is_taken_back(dep: RayKVCluster) -> None:
    w2 = dep.worker_ids[2]
    before = get(dep.workers[w2].health.remote())["incarnation"]
    ray.kill(dep.workers[w2], no_restart=False)
    poll(lambda: dep.liveness.workers.restarts(w2) == 1, timeout=60, what=f"{w2} restarted")
    assert dep.health()["workers"][w2] == "up" and w2 in dep.live_workers()
    assert get(dep.workers[w2].health.remote())["incarnation"] != before
    poll(lambda: _pick_idle(dep, w2) == w2, timeout=20, what=f"{w2} picked again")
    prompt = tokens(42, 5)
    _cache(dep, w2, prompt)  # the restarted worker's events reach the index again
    assert dep.route(prompt)[w2].blocks == 5


def test_dead_worker_is_skipped_and_connect_reports_it(dep: RayKVCluster) -> None:
    w0, w1, w2 = dep.worker_ids
    prompt = tokens(43, 7)
    _cache(dep, w0, prompt)
    assert dep.pick_worker(prompt).worker == w0
    t0 = time.monotonic()
    ray.kill(dep.workers[w0], no_restart=True)
    skip_s = _picks_until_skipped(dep, prompt, w0, t0)
    assert skip_s <= SKIP_S, skip_s
    print(f"dead worker skipped after {skip_s:.2f}s")
    poll(lambda: dep.health()["workers"][w0] == "dead", timeout=10, what=f"{w0} dead")
    assert dep.flush() == [w0]
    with pytest.raises(TransferError) as err:
        dep.pull(w1, w0, dep.keys(prompt))
    assert err.value.reason is TransferFailure.UNAVAILABLE

    other = raykv.connect(dep.namespace)  # no ValueError for the dead worker
    try:
        assert other.health()["workers"][w0] == "dead" and other.unavailable == [w0]
        assert w0 not in other.workers and set(other.live_workers()) == {w1, w2}
        assert {other.pick_worker(prompt).worker for _ in range(60)} <= {w1, w2}
        assert other.flush() == [w0]
    finally:
        other.close()

    pairer = PDPairer([w0, w1], [w2], dep.namespace, time_budget_s=2.0)

    async def pairs() -> set[str]:
        request = RoutedRequest(tuple(prompt), ReuseScope())
        poll_until = time.monotonic() + 10
        while pairer.liveness.workers.health(w0, time.monotonic()) != "dead":
            assert time.monotonic() < poll_until, "the pairer never saw the dead worker"
            await asyncio.sleep(0.1)
        return {(await pairer.pair(request)).prefill for _ in range(60)}

    try:
        assert asyncio.run(pairs()) == {w1}
    finally:
        pairer.close()

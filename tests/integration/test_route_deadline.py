"""Request-path deadlines of the index client (issue 40) on the module's own deployment (3 CPU
workers, 2 index shards): with one shard stopped (SIGSTOP), a route answers within its budget
with the live shard's part (the prefix up to the first key the stopped shard owns), later
routes skip the stopped shard without waiting, and after SIGCONT its keys come back once it
answers a ping. Both the blocking route of a cluster handle (whose Pinger takes the shard back)
and ``route_async`` of a client without one (as a Serve router builds it: it pings the shard
itself) are checked. The times are printed; the bounds leave ``SLACK_S`` for a loaded machine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence

from ray_helpers import get, poll, tokens

from actors.cache.cluster import RayKVCluster
from actors.cache.index import IndexClient
from actors.cache.liveness import ROUTE_BUDGET_MS
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch, shard_of

STOPPED = 1  # the shard position that is stopped
SLACK_S = 0.25  # scheduling slack on a loaded machine, over a route's budget
BACK_S = 10.0  # a resumed shard's keys are routed again within this long


def _stored(dep: RayKVCluster, worker: WorkerId, first_seed: int) -> tuple[list[bytes], int]:
    """Cache a prompt of 8 blocks on ``worker`` whose first 2 or more keys (but not all) belong to
    the shard that stays up; its keys and how many lead before the first key of shard STOPPED."""
    for seed in range(first_seed, first_seed + 500):
        prompt = tokens(seed, 8)
        keys = dep.keys(prompt)
        lead = next((i for i, k in enumerate(keys) if shard_of(k, 2) == STOPPED), len(keys))
        if 2 <= lead < len(keys):
            get(dep.workers[worker].run_request.remote(prompt))
            assert not dep.flush()
            assert dep.route_keys(keys)[worker].blocks == len(keys)
            return keys, lead
    raise AssertionError("no prompt splits over both shards")


@contextlib.contextmanager
def _stopped(dep: RayKVCluster, position: int) -> Iterator[None]:
    """Shard ``position``'s process stopped (SIGSTOP) for the block, resumed (SIGCONT) after it,
    whatever happens."""
    pid = get(dep.shards[position].info.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _timed_async(
    client: IndexClient, keys: Sequence[bytes], budget_ms: float | None = None
) -> tuple[dict[WorkerId, RouteMatch], float]:
    """``client.route_async(keys, budget_ms)`` on a fresh event loop: (answer, seconds)."""

    async def run() -> tuple[dict[WorkerId, RouteMatch], float]:
        t0 = time.monotonic()
        answer = await client.route_async(keys, budget_ms)
        return answer, time.monotonic() - t0

    return asyncio.run(run())


def test_stopped_shard_costs_one_route_its_budget_then_is_skipped(deployment: RayKVCluster) -> None:
    dep, index = deployment, deployment.index
    budget_s = index.route_budget_ms / 1000
    assert index.route_budget_ms == ROUTE_BUDGET_MS <= 250  # the handle's CALL_TIMEOUT_S only caps it
    w0 = dep.worker_ids[0]
    keys, lead = _stored(dep, w0, first_seed=60)
    name = dep.spec.shards[STOPPED]
    late, skipped = index.late, index.skipped
    with _stopped(dep, STOPPED):
        t0 = time.monotonic()
        route = dep.route_keys(keys)  # waits out the budget, then merges the live shard's answer
        first_s = time.monotonic() - t0
        print(f"stopped shard: first route {first_s * 1000:.0f} ms (budget {budget_s * 1000:.0f} ms)")
        assert first_s <= budget_s + SLACK_S, first_s
        assert route[w0].blocks == lead and index.late == late + 1
        assert dep.health()["shards"][name] == "late"
        later = []
        for _ in range(5):  # later routes skip the stopped shard without waiting
            t0 = time.monotonic()
            assert dep.route_keys(keys) == route
            later.append(time.monotonic() - t0)
        t0 = time.monotonic()
        many = dep.route_many([keys, keys[:lead], keys[lead:]])
        later.append(time.monotonic() - t0)
        assert many[:2] == [route, route] and w0 not in many[2]
        answer, async_s = _timed_async(index, keys)
        later.append(async_s)
        assert answer == route
        print(f"stopped shard: later routes {max(later) * 1000:.1f} ms at most")
        assert index.late == late + 1 and index.skipped == skipped + 7
        assert max(later) < budget_s, later
    t0 = time.monotonic()
    poll(lambda: dep.route_keys(keys)[w0].blocks == len(keys), timeout=BACK_S, what="the shard back")
    print(f"resumed shard routed again after {time.monotonic() - t0:.2f} s")
    assert dep.health()["shards"][name] == "up"


def test_route_async_merges_what_answered_and_pings_the_stopped_shard_back(
    deployment: RayKVCluster,
) -> None:
    dep = deployment
    client = IndexClient(dep.shards, {lane: WorkerId(n) for n, lane in dep.spec.workers})
    assert client.probing  # no Pinger behind it (as in a Serve router): it pings skipped shards
    w1 = dep.worker_ids[1]
    keys, lead = _stored(dep, w1, first_seed=700)
    assert _timed_async(client, keys)[0][w1].blocks == len(keys)
    with _stopped(dep, STOPPED):
        first, first_s = _timed_async(client, keys, budget_ms=100)  # a call's own budget
        print(f"stopped shard: first route_async {first_s * 1000:.0f} ms (budget 100 ms)")
        assert first_s <= 0.1 + SLACK_S, first_s
        assert first[w1].blocks == lead and client.late == 1
        later = [_timed_async(client, keys) for _ in range(3)]
        print(f"stopped shard: later route_async {max(s for _, s in later) * 1000:.1f} ms at most")
        assert all(answer == first for answer, _ in later) and client.late == 1
        assert client.skipped == 3 and max(s for _, s in later) < client.route_budget_ms / 1000
    t0 = time.monotonic()
    poll(lambda: _timed_async(client, keys)[0][w1].blocks == len(keys), timeout=BACK_S, what="the shard back")
    print(f"resumed shard routed again (route_async) after {time.monotonic() - t0:.2f} s")
    assert client.live() == [0, 1]

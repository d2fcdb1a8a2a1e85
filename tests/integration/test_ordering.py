"""Out-of-order, duplicated and gapped event batches delivered to a real IndexShard actor.

A test-only actor (``EventTap``, a TestingCacheWorker that keeps its events instead of publishing them)
produces a real event stream; the test hands its batches to a dedicated single-shard deployment's
shard in whatever order it likes. The shard only knows named actors, so the tap is a named actor
in the deployment's namespace (the shard pulls its snapshot when a gap cannot be closed).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray_helpers import expected_route, get, poll, running, small_config, snapshot_view, tokens

from actors.cache.cluster import RayKVCluster
from actors.testing import TestingCacheWorker
from raykv.index.prefix_index import KEY_PREFIX, OP_STORE, REORDER_WINDOW, EventBatch

INCARNATION = 7
_lanes = itertools.count(50)


def _tap_class() -> Any:
    """Defined in a function so Ray pickles the class by value (test modules are not importable
    from Ray's worker processes)."""

    class EventTap(TestingCacheWorker):
        def drain_batches(self, max_events_per_batch: int) -> list[EventBatch]:
            events = self.manager.drain_events()
            n = max_events_per_batch
            return [
                EventBatch.from_events(self.worker_id, self.incarnation, events[i : i + n])
                for i in range(0, len(events), n)
            ]

    return ray.remote(EventTap)


@pytest.fixture(scope="module")
def single(ray_local: None) -> Iterator[RayKVCluster]:
    with running("raykv-it-single", num_workers=1, index_shards=1) as dep:
        yield dep


@pytest.fixture
def tap(single: RayKVCluster) -> Iterator[tuple[str, Any]]:
    """(name, handle) of a fresh EventTap registered with the single shard under a lane of its own."""
    lane = next(_lanes)
    name = f"event-tap-{lane}"
    handle = (
        _tap_class()
        .options(name=name, namespace=single.namespace, num_cpus=0)
        .remote(name, lane, small_config(), incarnation=INCARNATION)
    )
    assert get(handle.identity.remote()) == (name, lane, INCARNATION)
    shard = single.shards[0]
    get(shard.register_worker.remote(name, lane, INCARNATION))
    yield name, handle
    get(shard.remove_worker.remote(name))
    ray.kill(handle, no_restart=True)


def _drive(handle: Any, first_seed: int, count: int) -> list[list[int]]:
    """Run ``count`` 5-block requests (enough for demotions and evictions); returns the prompts."""
    prompts = [tokens(first_seed + i, 5) for i in range(count)]
    for prompt in prompts:
        get(handle.run_request.remote(prompt))
    return prompts


def _deliver(shard: Any, batches: list[EventBatch]) -> list[str]:
    return [get(shard.apply_batch.remote(b)) for b in batches]


def _assert_mirrors(single: RayKVCluster, name: str, handle: Any, prompts: list[list[int]]) -> None:
    shard = single.shards[0]
    snap = snapshot_view(handle)
    assert get(shard.worker_blocks.remote(name)) == {k[:KEY_PREFIX]: t for k, t in snap.items()}
    for prompt in prompts:
        keys = single.keys(prompt)
        want = expected_route({name: snap}, keys)  # type: ignore[dict-item]
        got = {w: m for w, m in single.route(prompt).items() if w == name}
        assert got == want, prompt


def test_shuffled_and_duplicated_batches_converge(single: RayKVCluster, tap: tuple[str, Any]) -> None:
    name, handle = tap
    shard = single.shards[0]
    prompts = _drive(handle, 50, 12)
    batches = get(handle.drain_batches.remote(5))
    assert 10 < len(batches) < REORDER_WINDOW
    rng = random.Random(1234)
    later = batches[1:]
    rng.shuffle(later)
    half = len(later) // 2
    dups = rng.sample(batches, len(batches) // 3)
    order = [*later[:half], batches[0], *later[half:], *dups, *dups[:3]]
    counters = get(shard.info.remote())["counters"]

    results = _deliver(shard, order)
    assert set(results) <= {"applied", "buffered", "duplicate"}, results
    assert results[0] == "buffered" and "duplicate" in results
    after = get(shard.info.remote())["counters"]
    assert after.get("gaps", 0) == counters.get("gaps", 0)
    assert after.get("snapshots", 0) == counters.get("snapshots", 0)
    _assert_mirrors(single, name, handle, prompts)


def test_gap_is_closed_by_a_snapshot(single: RayKVCluster, tap: tuple[str, Any]) -> None:
    name, handle = tap
    shard = single.shards[0]
    prompts = _drive(handle, 70, 12)
    batches = get(handle.drain_batches.remote(1))
    assert len(batches) > REORDER_WINDOW + 10
    counters = get(shard.info.remote())["counters"]

    assert _deliver(shard, batches[:1]) == ["applied"]
    # batches[1] is lost: the following ones wait in the reorder window until it overflows.
    waiting = batches[2 : 2 + REORDER_WINDOW]
    assert set(_deliver(shard, waiting)) == {"buffered"}
    assert _deliver(shard, [batches[2 + REORDER_WINDOW]]) == ["needs_snapshot"]
    # The shard pulled a snapshot covering every event emitted so far: the rest are duplicates.
    assert set(_deliver(shard, batches[3 + REORDER_WINDOW :] + batches[1:2])) == {"duplicate"}
    after = get(shard.info.remote())["counters"]
    assert after.get("gaps", 0) == counters.get("gaps", 0) + 1
    assert after.get("snapshots", 0) == counters.get("snapshots", 0) + 1
    _assert_mirrors(single, name, handle, prompts)

    # The stream continues in order after the snapshot.
    prompts += _drive(handle, 90, 3)
    assert set(_deliver(shard, get(handle.drain_batches.remote(4)))) == {"applied"}
    _assert_mirrors(single, name, handle, prompts)


def test_malformed_batch_of_newer_incarnation_changes_nothing(
    single: RayKVCluster, tap: tuple[str, Any]
) -> None:
    """A rejected batch must change nothing (prefix_index docstring), whatever its incarnation."""
    name, handle = tap
    shard = single.shards[0]
    prompts = _drive(handle, 95, 2)
    assert set(_deliver(shard, get(handle.drain_batches.remote(4)))) == {"applied"}
    before = get(shard.worker_blocks.remote(name))
    assert before == {k[:KEY_PREFIX]: t for k, t in snapshot_view(handle).items()}

    bad = EventBatch(name, INCARNATION + 1, 1, 1, ((OP_STORE, b"\x02" * 31, 1),))  # type: ignore[arg-type]
    assert get(shard.apply_batch.remote(bad)) == "malformed"
    assert get(shard.worker_blocks.remote(name)) == before
    # The worker's real (current-incarnation) stream must still be accepted.
    prompts += _drive(handle, 98, 1)
    assert set(_deliver(shard, get(handle.drain_batches.remote(4)))) == {"applied"}
    _assert_mirrors(single, name, handle, prompts)


def test_tap_is_purged_when_killed(single: RayKVCluster) -> None:
    """The heartbeat also watches actors registered by hand."""
    lane = next(_lanes)
    name = f"event-tap-{lane}"
    handle = (
        _tap_class()
        .options(name=name, namespace=single.namespace, num_cpus=0)
        .remote(name, lane, small_config(), incarnation=INCARNATION)
    )
    shard = single.shards[0]
    get(shard.register_worker.remote(name, lane, INCARNATION))
    prompt = tokens(99, 3)
    get(handle.run_request.remote(prompt))
    assert set(_deliver(shard, get(handle.drain_batches.remote(100)))) == {"applied"}
    assert single.route(prompt)[name].blocks == 3

    ray.kill(handle, no_restart=True)
    poll(lambda: name not in get(shard.info.remote())["workers"], timeout=20, what="tap purged")
    assert name not in single.route(prompt)

"""The pure global prefix index (raykv/index/prefix_index.py): shard routing, event batches, route results
(prefix length, tier counts, predicted credit) against a brute-force reference, the event-stream
rules (duplicates, reordering, gaps and snapshots, overlaps, incarnations, rejections), and
convergence of a real CacheManager's event stream however it is delivered."""

from __future__ import annotations

import hashlib
import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from raykv.core.events import AllCleared, BlockRemoved, BlockStored, BlockTierChanged
from raykv.core.types import TierKind
from raykv.index.prefix_index import (
    KEY_PREFIX,
    MAX_LANES,
    MAX_ROUTE_BLOCKS,
    OP_CLEAR,
    OP_REMOVE,
    OP_STORE,
    REORDER_WINDOW,
    EventBatch,
    PrefixIndex,
    RouteMatch,
    shard_of,
)
from raykv.index.prefix_index import ApplyResult as R

KEYS = [hashlib.sha256(i.to_bytes(8, "big")).digest() for i in range(64)]
CLEAR = (OP_CLEAR, b"", 0)
GPU, HOST, DISK = 0, 1, 2


def put(k: bytes, tier: int) -> tuple[int, bytes, int]:
    return (OP_STORE, k, tier)


def rm(k: bytes) -> tuple[int, bytes, int]:
    return (OP_REMOVE, k, 0)


def mk(worker: str, first: int, ops: list, inc: int = 1) -> EventBatch:
    return EventBatch(worker, inc, first, first + len(ops) - 1, tuple(ops))


def split(worker: str, ops: list, sizes: list[int]) -> list[EventBatch]:
    """A worker's ops (ids 1..len) cut into consecutive batches of the given sizes (cycled)."""
    out, i = [], 0
    while i < len(ops):
        out.append(mk(worker, i + 1, ops[i : i + sizes[len(out) % len(sizes)]]))
        i = out[-1].last_event_id
    return out


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def prefixed(held: dict[bytes, int]) -> dict[bytes, int]:
    """``held`` as the index lists it: by each key's first KEY_PREFIX bytes (all it keeps)."""
    return {k[:KEY_PREFIX]: t for k, t in held.items()}


def model_apply(held: dict[bytes, int], ops) -> dict[bytes, int]:
    for op, k, t in ops:
        if op == OP_STORE:
            held[k] = t
        elif op == OP_REMOVE:
            held.pop(k, None)
        else:
            held.clear()
    return held


def reference_route(held: dict[str, dict[bytes, int]], predicted: dict[str, set[bytes]], keys) -> dict:
    """Per worker: walk keys while it holds or is predicted for each; count tiers."""
    out = {}
    for w in set(held) | set(predicted):
        counts, n = [0, 0, 0, 0], 0  # gpu, host, disk, predicted
        for k in keys[:MAX_ROUTE_BLOCKS]:
            tier = held.get(w, {}).get(k)
            if tier is None and k not in predicted.get(w, ()):
                break
            counts[3 if tier is None else tier] += 1
            n += 1
        if n:
            out[w] = RouteMatch(w, n, *counts)
    return out


def index_state(ix: PrefixIndex) -> tuple:
    return (
        {w: ix.worker_blocks(w) for w in ix.workers},
        {w: ix.last_event_id(w) for w in ix.workers},
        len(ix),
        ix.lookup(KEYS)[0],
        ix.workers,
    )


def manager_stream(make_manager, run_request, seed: int):
    """Requests on a host(6 pages) + disk(16 pages) manager that commit, demote, promote, evict and
    clear. Returns the manager, its events, and its committed blocks at every request boundary."""
    mgr = make_manager(6, 16)
    rng = random.Random(seed)
    bases = [[b * 1000 + i for i in range(20)] for b in range(6)]
    events, states = [], {0: {}}
    for step in range(36):
        if step in (22, 34):  # the last request then stores right after a clear
            mgr.clear_reusable()
        else:
            tail = [rng.randrange(3) for _ in range(4)]
            run_request(mgr, rng.choice(bases)[: rng.randrange(4, 21)] + tail)
        events += mgr.drain_events()
        states[mgr.events.last_event_id] = {b.key: b.tier for b in mgr.committed_blocks()}
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    return mgr, events, states


# ---- shards and batches --------------------------------------------------------------------------


def test_shard_of_deterministic_in_range_and_balanced():
    rng = random.Random(0)
    keys = [rng.randbytes(32) for _ in range(4000)]
    for n in (1, 2, 4, 7):
        assert all(0 <= shard_of(k, n) < n for k in keys)
        assert [shard_of(k, n) for k in keys] == [shard_of(bytes(k), n) for k in keys]
    assert shard_of(KEYS[0][:8] + bytes(24), 4) == shard_of(KEYS[0], 4)  # only 8 bytes matter
    counts = [0] * 4
    for k in keys:
        counts[shard_of(k, 4)] += 1
    assert all(850 <= c <= 1150 for c in counts), counts


def test_from_events_and_for_shard(make_manager, run_request):
    _, events, _ = manager_stream(make_manager, run_request, 0)
    assert {type(e) for e in events} == {BlockStored, BlockRemoved, BlockTierChanged, AllCleared}
    moved = {e.new_tier for e in events if isinstance(e, BlockTierChanged)}
    assert moved == {TierKind.HOST, TierKind.DISK}  # demotions and promotions
    batch = EventBatch.from_events("w", 7, events)
    assert (batch.worker, batch.incarnation, batch.first_event_id) == ("w", 7, 1)
    assert batch.last_event_id == len(events) == len(batch.ops)
    for e, op in zip(events, batch.ops):
        if isinstance(e, BlockStored):
            assert op == (OP_STORE, e.key, int(e.tier))
        elif isinstance(e, BlockTierChanged):
            assert op == (OP_STORE, e.key, int(e.new_tier))
        elif isinstance(e, BlockRemoved):
            assert op == (OP_REMOVE, e.key, 0)
        else:
            assert op == CLEAR
    sub = EventBatch.from_events("w", 1, events[5:9])
    assert (sub.first_event_id, sub.last_event_id, len(sub.ops)) == (6, 9, 4)
    with pytest.raises(ValueError):
        EventBatch.from_events("w", 1, [])

    assert batch.for_shard(0, 1) == batch
    n_clears = batch.ops.count(CLEAR)
    for n in (2, 4):
        subs = [batch.for_shard(s, n) for s in range(n)]
        for s, part in enumerate(subs):
            assert (part.worker, part.incarnation, part.first_event_id) == ("w", 7, 1)
            assert part.last_event_id == batch.last_event_id
            assert part.ops.count(CLEAR) == n_clears
            assert all(shard_of(k, n) == s for op, k, _ in part.ops if op != OP_CLEAR)
            it = iter(batch.ops)
            assert all(op in it for op in part.ops)  # an order-preserving subsequence
        assert sum(len(p.ops) - n_clears for p in subs) == len(batch.ops) - n_clears


# ---- route ---------------------------------------------------------------------------------------


def test_route_prefix_tiers_and_omission():
    ix = PrefixIndex()
    for w, lane in (("a", 0), ("b", 1), ("c", 5), ("idle", 2)):
        ix.register_worker(w, lane, 1)
    a_ops = [put(KEYS[0], GPU), put(KEYS[1], HOST), put(KEYS[2], DISK)]
    assert ix.apply_batch(mk("a", 1, a_ops)) == R.APPLIED
    ix.apply_batch(mk("b", 1, [put(KEYS[0], HOST), put(KEYS[2], GPU)]))  # hole at key 1
    ix.apply_batch(mk("c", 1, [put(KEYS[1], GPU), put(KEYS[2], GPU)]))  # no key 0
    ix.apply_batch(mk("idle", 1, [put(KEYS[9], GPU)]))
    assert ix.route(KEYS[:4]) == {"a": RouteMatch("a", 3, 1, 1, 1), "b": RouteMatch("b", 1, 0, 1, 0)}
    assert ix.route(KEYS[1:3]) == {"a": RouteMatch("a", 2, 0, 1, 1), "c": RouteMatch("c", 2, 2, 0, 0)}
    assert ix.route([KEYS[30]]) == {}
    ix.apply_batch(mk("a", 4, [put(KEYS[2], GPU), rm(KEYS[0])]))  # tier change and removal
    assert ix.route(KEYS[:3]) == {"b": RouteMatch("b", 1, 0, 1, 0)}
    assert ix.route(KEYS[1:3])["a"] == RouteMatch("a", 2, 1, 1, 0)
    assert ix.worker_blocks("a") == prefixed({KEYS[1]: TierKind.HOST, KEYS[2]: TierKind.GPU})


@pytest.mark.timeout(3)
def test_route_of_no_keys_is_empty():
    # A prompt shorter than one block has no keys; route([]) must answer, not spin.
    ix = PrefixIndex()
    ix.register_worker("a", 0, 1)
    assert ix.route([]) == {}


def test_predicted_credit_ttl_and_no_double_count():
    clock = Clock()
    ix = PrefixIndex(predict_ttl_s=2.0, clock=clock)
    ix.register_worker("a", 0, 1)
    ix.register_worker("b", 3, 1)
    ix.apply_batch(mk("a", 1, [put(KEYS[0], HOST), put(KEYS[1], GPU)]))
    ix.predict("a", KEYS[:5])  # also credits the two it really holds
    ix.predict("b", [KEYS[0], KEYS[2]])  # b's prefix stops at key 1
    ix.predict("nobody", KEYS[:5])  # unknown worker: ignored
    expect = {"a": RouteMatch("a", 5, 1, 1, 0, 3), "b": RouteMatch("b", 1, 0, 0, 0, 1)}
    assert ix.route(KEYS[:6]) == expect
    clock.t += 1.999
    assert ix.route(KEYS[:6]) == expect
    ix.predict("b", [KEYS[1]])  # expires at +3.999
    clock.t += 0.001  # the first credits expire now
    assert ix.route(KEYS[:6]) == {"a": RouteMatch("a", 2, 1, 1, 0, 0)}
    ix.apply_batch(mk("b", 1, [put(KEYS[0], DISK)]))
    assert ix.route(KEYS[:6])["b"] == RouteMatch("b", 2, 0, 0, 1, 1)
    ix.remove_worker("b")
    ix.register_worker("b2", 3, 1)  # takes b's lane, not its live credit for key 1
    assert ix.route(KEYS[:6]) == {"a": RouteMatch("a", 2, 1, 1, 0, 0)}
    assert ix.route(KEYS[1:2]) == {"a": RouteMatch("a", 1, 1, 0, 0, 0)}
    clock.t += 5
    ix.predict("a", [KEYS[3]])  # a hole in the real chain is bridged by a prediction
    ix.apply_batch(mk("a", 3, [put(KEYS[2], DISK), put(KEYS[4], DISK)]))
    assert ix.route(KEYS[:6]) == {"a": RouteMatch("a", 5, 1, 1, 2, 1)}


def test_route_length_cap_and_no_lane_bleed():
    n = MAX_ROUTE_BLOCKS + 5
    keys = [hashlib.sha256(b"cap%d" % i).digest() for i in range(n)]
    ix = PrefixIndex()
    ix.register_worker("a", 0, 1)
    ix.register_worker("b", 1, 1)
    ix.apply_batch(mk("a", 1, [put(k, GPU) for k in keys]))
    ix.apply_batch(mk("b", 1, [put(k, (i // 7) % 3) for i, k in enumerate(keys[:2000])]))
    normal = ix.route(keys[:2000])
    assert normal["a"] == RouteMatch("a", 2000, 2000, 0, 0)
    tiers = [sum((i // 7) % 3 == t for i in range(2000)) for t in range(3)]
    assert normal["b"] == RouteMatch("b", 2000, *tiers)
    capped = RouteMatch("a", MAX_ROUTE_BLOCKS, MAX_ROUTE_BLOCKS, 0, 0)
    assert ix.route(keys) == {"a": capped, "b": normal["b"]}


@pytest.mark.parametrize("seed", range(6))
def test_many_workers_match_brute_force(seed):
    rng = random.Random(seed)
    clock = Clock()
    ix = PrefixIndex(clock=clock)
    # sparse lanes up to 117, 39 dense lanes and the last one, 40 dense lanes (the dense path)
    lanes = (list(range(0, 120, 3)), [*range(39), MAX_LANES - 1], list(range(40)))[seed % 3]
    held, predicted = {}, {}
    for i, lane in enumerate(lanes):
        w = f"w{i}"
        ix.register_worker(w, lane, 1)
        chain = KEYS[: rng.randrange(1, 30)]
        held[w] = {k: rng.choice((GPU, HOST, DISK)) for k in chain if rng.random() < 0.93}
        ix.apply_batch(mk(w, 1, [put(k, t) for k, t in held[w].items()]))
        if rng.random() < 0.4:
            predicted[w] = set(rng.sample(KEYS[:30], 5))
            ix.predict(w, predicted[w])
    for keys in (KEYS[:30], KEYS[:1], KEYS[2:20], rng.sample(KEYS[:30], 10)):
        assert ix.route(keys) == reference_route(held, predicted, keys)
    assert len(ix.route(KEYS[:2])) > 8  # the vectorized (or the dense) path ran
    if seed % 3 == 2:  # the dense path lists workers by lane
        route = ix.route(KEYS[:30])
        assert list(route) == sorted(route, key=lambda w: lanes[int(w[1:])])
    clock.t += 10
    assert ix.route(KEYS[:30]) == reference_route(held, {}, KEYS[:30])


def test_route_walks_past_lookup_chunks_and_stops_at_the_first_gap():
    # Keys are looked up in doubling chunks (merge_route): runs that cross chunk edges, a tier
    # change inside a chunk, and keys after the first gap (held, yet not part of any prefix).
    ix = fresh("a", "b", "c")
    ix.apply_batch(mk("a", 1, [put(k, HOST if i < 37 else DISK) for i, k in enumerate(KEYS[:45])]))
    ix.apply_batch(mk("b", 1, [put(k, GPU) for k in KEYS[:9]]))
    ix.apply_batch(mk("c", 1, [put(k, GPU) for k in KEYS[50:60]]))  # after a's gap at 45
    expect = {"a": RouteMatch("a", 45, 0, 37, 8), "b": RouteMatch("b", 9, 9, 0, 0)}
    assert ix.route(KEYS[:60]) == expect
    assert ix.route(KEYS[:60]) == expect  # the memoized answer, as a fresh dict
    assert ix.route(KEYS[:3]) == {"a": RouteMatch("a", 3, 0, 3, 0), "b": RouteMatch("b", 3, 3, 0, 0)}
    assert ix.route(KEYS[50:]) == {"c": RouteMatch("c", 10, 10, 0, 0)}
    ix.route(KEYS[:60]).clear()  # callers own their answer
    assert ix.route(KEYS[:60]) == expect


def test_memoized_routes_follow_membership_changes():
    ix = fresh("a", "b")
    ix.apply_batch(mk("a", 1, [put(k, GPU) for k in KEYS[:4]]))
    assert ix.route(KEYS[:4]) == {"a": RouteMatch("a", 4, 4, 0, 0)}
    ix.remove_worker("a")
    ix.register_worker("z", 0, 1)  # a's lane, the same blocks: the same lane counters as before
    ix.apply_batch(mk("z", 1, [put(k, GPU) for k in KEYS[:4]]))
    assert ix.route(KEYS[:4]) == {"z": RouteMatch("z", 4, 4, 0, 0)}


OPS = st.tuples(st.integers(0, 4), st.integers(0, 9), st.integers(0, 11), st.integers(0, 2))


def to_op(code: int, key: int, tier: int) -> tuple[int, bytes, int]:
    return put(KEYS[key], tier) if code < 7 else rm(KEYS[key]) if code < 9 else CLEAR


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lanes=st.lists(st.integers(0, 70), min_size=1, max_size=5, unique=True),
    ops=st.lists(OPS, max_size=80),
    data=st.data(),
)
def test_random_streams_match_model(lanes, ops, data):
    workers = [f"w{lane}" for lane in lanes]
    per_worker: dict[str, list] = {w: [] for w in workers}
    for wi, code, key, tier in ops:
        per_worker[workers[wi % len(workers)]].append(to_op(code, key, tier))
    clock = Clock()
    ix = PrefixIndex(predict_ttl_s=2.0, clock=clock)
    for w, lane in zip(workers, lanes):
        ix.register_worker(w, lane, 1)
    queues = [split(w, per_worker[w], data.draw(st.lists(st.integers(1, 5), min_size=1))) for w in workers]
    while any(queues):  # interleave the workers, each in order
        q = data.draw(st.sampled_from([q for q in queues if q]))
        assert ix.apply_batch(q.pop(0)) == R.APPLIED
    held = {w: model_apply({}, per_worker[w]) for w in workers}
    for w in workers:
        assert ix.worker_blocks(w) == prefixed(held[w])
        assert ix.last_event_id(w) == len(per_worker[w])
    assert len(ix) == len(set().union(*held.values()))
    expiry: dict[tuple[str, bytes], float] = {}
    for _ in range(data.draw(st.integers(0, 3))):
        w, ks = data.draw(st.sampled_from(workers)), data.draw(st.lists(st.sampled_from(KEYS[:12])))
        ix.predict(w, ks)
        expiry.update({(w, k): clock.t + 2.0 for k in ks})
        clock.t += data.draw(st.sampled_from([0.0, 0.5, 1.5]))
    predicted = {w: {k for (v, k), t in expiry.items() if v == w and t > clock.t} for w in workers}
    keys = [KEYS[i] for i in data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=14))]
    assert ix.route(keys) == reference_route(held, predicted, keys)
    assert ix.route(KEYS[:12]) == reference_route(held, predicted, KEYS[:12])


# ---- stream rules --------------------------------------------------------------------------------


def stream(n: int, seed: int = 0) -> list:
    """Stores and removes (no clears: test_clear_then_store_in_one_batch covers those)."""
    rng = random.Random(seed)
    return [to_op(rng.randrange(9), rng.randrange(12), rng.randrange(3)) for _ in range(n)]


def test_clear_then_store_in_one_batch():
    ix = fresh("w", "v")
    ix.apply_batch(mk("w", 1, [put(KEYS[0], GPU), put(KEYS[1], GPU)]))
    assert ix.apply_batch(mk("w", 3, [CLEAR, put(KEYS[1], HOST), put(KEYS[2], DISK)])) == R.APPLIED
    assert ix.worker_blocks("w") == prefixed({KEYS[1]: TierKind.HOST, KEYS[2]: TierKind.DISK})
    ix.apply_batch(mk("w", 6, [rm(KEYS[1]), rm(KEYS[2])]))
    assert ix.worker_blocks("w") == {} and ix.route(KEYS[:3]) == {} and len(ix) == 0
    ix.apply_batch(mk("w", 8, [CLEAR, put(KEYS[3], GPU)]))
    assert ix.remove_worker("w") == 1 and len(ix) == 0
    ix.register_worker("x", 0, 1)  # w's lane: must not inherit w's blocks
    assert ix.route(KEYS[3:4]) == {}


def fresh(*workers: str) -> PrefixIndex:
    ix = PrefixIndex()
    for lane, w in enumerate(workers):
        ix.register_worker(w, lane, 1)
    return ix


def test_duplicates_and_reordering_within_window():
    ops = stream(12)
    b = split("w", ops, [3])
    ref = fresh("w")
    for bt in b:
        ref.apply_batch(bt)
    ix = fresh("w")
    assert ix.apply_batch(b[0]) == R.APPLIED
    assert ix.apply_batch(b[0]) == R.DUPLICATE
    assert ix.apply_batch(b[3]) == R.BUFFERED
    assert ix.apply_batch(b[2]) == R.BUFFERED
    assert ix.last_event_id("w") == 3
    assert ix.worker_blocks("w") == prefixed(model_apply({}, ops[:3]))
    assert ix.apply_batch(b[1]) == R.APPLIED  # the gap closes: 2 and 3 drain
    assert index_state(ix) == index_state(ref)
    assert ix.worker_blocks("w") == prefixed(model_apply({}, ops))
    assert ix.apply_batch(b[2]) == R.DUPLICATE
    assert ix.counters["duplicate_batches"] == 2 and ix.counters["buffered_batches"] == 2
    assert ix.counters["applied_batches"] == 4


def test_gap_overflow_needs_snapshot_then_converges():
    ops = stream(REORDER_WINDOW + 10, seed=1)
    b = split("w", ops, [1])
    ix = fresh("w", "other")
    ix.apply_batch(mk("other", 1, [put(KEYS[0], GPU)]))
    assert ix.apply_batch(b[0]) == R.APPLIED
    for bt in b[2 : 2 + REORDER_WINDOW]:  # b[1] is lost
        assert ix.apply_batch(bt) == R.BUFFERED
    overflow = b[2 + REORDER_WINDOW]
    assert ix.apply_batch(overflow) == R.NEEDS_SNAPSHOT
    assert ix.workers_needing_snapshot() == ["w"] and ix.counters["gaps"] == 1
    assert ix.worker_blocks("w") == prefixed(model_apply({}, ops[:1]))
    ix.apply_snapshot("w", 1, 2, model_apply({}, ops[:2]).items())  # the truth at id 2
    assert ix.workers_needing_snapshot() == [] and ix.counters["snapshots"] == 1
    assert ix.last_event_id("w") == 2 + REORDER_WINDOW  # the buffered batches drained
    assert ix.worker_blocks("w") == prefixed(model_apply({}, ops[: 2 + REORDER_WINDOW]))
    assert ix.apply_batch(b[5]) == R.DUPLICATE
    for bt in b[2 + REORDER_WINDOW :]:
        assert ix.apply_batch(bt) == R.APPLIED
    assert ix.worker_blocks("w") == prefixed(model_apply({}, ops))
    assert ix.worker_blocks("other") == prefixed({KEYS[0]: TierKind.GPU})
    # a snapshot alone (e.g. after the shard restarts) also reaches the truth
    ix2 = fresh("w", "other")
    ix2.apply_snapshot("w", 1, len(ops), model_apply({}, ops).items())
    assert ix2.worker_blocks("w") == ix.worker_blocks("w")


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=40), data=st.data())
def test_overlapping_batch_applied_whole_is_idempotent(ops, data):
    ops = [to_op(code, key, tier) for _, code, key, tier in ops]
    n = data.draw(st.integers(0, len(ops) - 1))  # applied so far
    first = data.draw(st.integers(1, n + 1))
    last = data.draw(st.integers(n + 1, len(ops)))
    ix = fresh("w")
    if n and data.draw(st.booleans()):
        ix.apply_snapshot("w", 1, n, model_apply({}, ops[:n]).items())
    elif n:
        for bt in split("w", ops[:n], data.draw(st.lists(st.integers(1, 4), min_size=1))):
            ix.apply_batch(bt)
    assert ix.apply_batch(mk("w", first, ops[first - 1 : last])) == R.APPLIED
    assert ix.last_event_id("w") == last
    assert ix.worker_blocks("w") == prefixed(model_apply({}, ops[:last]))


def test_incarnations():
    ix = fresh("w", "v")
    ix.apply_batch(mk("v", 1, [put(KEYS[0], GPU)]))
    ix.register_worker("w", 0, 2)  # a restart before any event
    ix.apply_batch(mk("w", 1, [put(KEYS[0], HOST), put(KEYS[1], HOST)], inc=2))
    before = index_state(ix)
    assert ix.apply_batch(mk("w", 3, [rm(KEYS[0])], inc=1)) == R.STALE_INCARNATION
    ix.apply_snapshot("w", 1, 9, [(KEYS[5], GPU)])
    ix.register_worker("w", 0, 1)
    assert index_state(ix) == before and ix.counters["rejected_stale_incarnation"] == 2
    assert ix.apply_batch(mk("w", 1, [put(KEYS[2], DISK)], inc=3)) == R.APPLIED
    assert ix.worker_blocks("w") == prefixed({KEYS[2]: TierKind.DISK}) and ix.last_event_id("w") == 1
    assert ix.worker_blocks("v") == prefixed({KEYS[0]: TierKind.GPU})
    assert ix.route(KEYS[:3]) == {"v": RouteMatch("v", 1, 1, 0, 0)}
    # a newer incarnation that starts past id 1 must be snapshotted
    assert ix.apply_batch(mk("w", 4, [put(KEYS[3], GPU)], inc=4)) == R.BUFFERED
    assert ix.worker_blocks("w") == {} and ix.workers_needing_snapshot() == ["w"]
    ix.apply_snapshot("w", 4, 3, [(KEYS[6], HOST)])
    assert ix.worker_blocks("w") == prefixed({KEYS[6]: TierKind.HOST, KEYS[3]: TierKind.GPU})
    assert ix.last_event_id("w") == 4 and ix.workers_needing_snapshot() == []


def test_rejected_batches_change_nothing():
    ix = fresh("w")
    ix.apply_batch(mk("w", 1, [put(KEYS[0], GPU), put(KEYS[1], HOST)]))
    ix.predict("w", [KEYS[2]])
    before, route = index_state(ix), ix.route(KEYS[:4])
    assert ix.apply_batch(mk("ghost", 1, [put(KEYS[3], GPU)])) == R.UNKNOWN_WORKER
    ok = [rm(KEYS[0]), put(KEYS[3], GPU), CLEAR]
    bad_batches = [
        mk("w", 3, [*ok, put(KEYS[4][:31], GPU)]),
        mk("w", 3, [*ok, rm(KEYS[4][:31])]),
        mk("w", 3, [*ok, put(KEYS[4], 3)]),
        mk("w", 3, [*ok, put(KEYS[4], -1)]),
        mk("w", 3, [*ok, (7, KEYS[4], 0)]),
        EventBatch("w", 1, 0, 2, tuple(ok)),
        EventBatch("w", 1, 5, 4, tuple(ok)),
    ]
    for bt in bad_batches:
        assert ix.apply_batch(bt) == R.MALFORMED
    with pytest.raises(ValueError):
        ix.apply_snapshot("w", 1, 10, [(KEYS[5], GPU), (KEYS[6][:31], GPU)])
    with pytest.raises(ValueError):
        ix.apply_snapshot("w", 1, 10, [(KEYS[5], 3)])
    with pytest.raises(KeyError):
        ix.apply_snapshot("ghost", 1, 10, [])
    assert index_state(ix) == before and ix.route(KEYS[:4]) == route
    assert ix.counters["rejected_unknown_worker"] == 1
    assert ix.counters["rejected_malformed"] == len(bad_batches)
    assert ix.apply_batch(mk("w", 3, ok)) == R.APPLIED  # the ids were not consumed
    assert ix.worker_blocks("w") == {} and len(ix) == 0


# ---- convergence of a real manager's stream -----------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_real_stream_converges_however_delivered(make_manager, run_request, seed, num_shards):
    mgr, events, states = manager_stream(make_manager, run_request, seed)
    end = mgr.events.last_event_id
    truth = {b.key: b.tier for b in mgr.committed_blocks()}
    assert truth and truth == states[end] and events[-1].event_id == end
    rng = random.Random(seed)
    a, i = [], 0
    while i < len(events):  # batches of 4, but a clear always shares its batch with what follows
        j = min(i + 4, len(events))
        j += isinstance(events[j - 1], AllCleared) and j < len(events)
        a.append(EventBatch.from_events("w", 1, events[i:j]))
        i = j
    b = []
    while sum(len(x.ops) for x in b) < len(events):
        i = sum(len(x.ops) for x in b)
        b.append(EventBatch.from_events("w", 1, events[i : i + rng.randint(1, 9)]))

    def deliver(plan: list) -> tuple[dict, set]:
        shards = [PrefixIndex(s, num_shards) for s in range(num_shards)]
        results = set()
        for ix in shards:
            ix.register_worker("w", 3, 1)
        for item in plan:
            for s, ix in enumerate(shards):
                if isinstance(item, EventBatch):
                    results.add(ix.apply_batch(item.for_shard(s, num_shards)))
                else:
                    ix.apply_snapshot("w", 1, *item)
        merged: dict = {}
        for ix in shards:
            assert ix.last_event_id("w") == end and ix.workers_needing_snapshot() == []
            part = ix.worker_blocks("w")
            assert all(shard_of(k, num_shards) == ix.shard for k in part)
            merged.update(part)
        return merged, results

    shuffled = [bt for g in range(0, len(a), 40) for bt in rng.sample(a[g : g + 40], len(a[g : g + 40]))]
    dups = []
    for i, bt in enumerate(a):
        dups.append(bt)
        if rng.random() < 0.5:  # a batch cut elsewhere: old, overlapping, or a little ahead
            dups.append(rng.choice([x for x in b if x.first_event_id <= bt.last_event_id + 12]))
        if rng.random() < 0.3:
            dups.append(rng.choice(a[: i + 1]))
    snap_end = (end, [(info.key, int(info.tier)) for info in mgr.committed_blocks()])
    dropped = [bt for bt in b if rng.random() < 0.7] + [snap_end]
    mid = rng.choice([i for i in states if end // 3 <= i <= 2 * end // 3])
    mid_plan = [bt for bt in a if bt.last_event_id <= mid and rng.random() < 0.5]
    mid_plan += [(mid, list(states[mid].items()))] + [bt for bt in a if bt.last_event_id > mid]

    got_in_order, res_in_order = deliver(a)
    assert res_in_order == {R.APPLIED}
    got_shuffled, res_shuffled = deliver(shuffled)
    assert R.BUFFERED in res_shuffled and R.NEEDS_SNAPSHOT not in res_shuffled
    got_dups, res_dups = deliver(dups)
    assert R.DUPLICATE in res_dups
    got_dropped, _ = deliver(dropped)
    got_mid, _ = deliver(mid_plan)
    assert got_in_order == got_shuffled == got_dups == got_dropped == got_mid == prefixed(truth)


# ---- membership ----------------------------------------------------------------------------------


def test_register_and_remove_workers():
    ix = PrefixIndex()
    ix.register_worker("a", 0, 1)
    ix.register_worker("b", 7, 1)
    with pytest.raises(ValueError, match="lane 7"):
        ix.register_worker("c", 7, 1)
    for lane in (-1, MAX_LANES):
        with pytest.raises(ValueError):
            ix.register_worker("c", lane, 1)
    with pytest.raises(ValueError):
        PrefixIndex(shard=4, num_shards=4)
    assert ix.workers == {"a": 0, "b": 7}
    ix.apply_batch(mk("a", 1, [put(KEYS[0], GPU), put(KEYS[1], HOST), put(KEYS[2], DISK)]))
    ix.apply_batch(mk("b", 1, [put(KEYS[0], DISK), put(KEYS[1], DISK)]))
    ix.register_worker("a", 0, 1)  # same incarnation again: a no-op
    assert len(ix.worker_blocks("a")) == 3 and len(ix) == 3
    assert ix.remove_worker("a") == 3
    assert ix.remove_worker("a") == 0 and ix.workers == {"b": 7} and len(ix) == 2
    assert ix.route(KEYS[:3]) == {"b": RouteMatch("b", 2, 0, 0, 2)}
    assert ix.apply_batch(mk("a", 4, [put(KEYS[3], GPU)])) == R.UNKNOWN_WORKER
    ix.register_worker("c", 0, 1)  # the freed lane is reusable and starts empty
    assert ix.worker_blocks("c") == {} and ix.route(KEYS[:1]) == {"b": RouteMatch("b", 1, 0, 0, 1)}
    assert ix.remove_worker("b") == 2 and len(ix) == 0

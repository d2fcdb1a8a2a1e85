"""EventQueue (ids, bound, drain), event value semantics; CacheStats / StatsDelta arithmetic."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import pickle
import threading
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.core.events import AllCleared, BlockRemoved, BlockStored, BlockTierChanged, EventQueue
from raykv.core.records import (
    CommittedBlockInfo,
    ExportedBlock,
    ImportResult,
    ProbeResult,
    page_checksum,
)
from raykv.core.stats import CacheStats, StatsDelta
from raykv.core.types import TierKind


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little", signed=True)).digest()


def emit_mixed(q: EventQueue, n: int) -> None:
    for i in range(n):
        kind = i % 4
        if kind == 0:
            q.stored(key(i), key(i - 1), TierKind.GPU, 16, request_id=i)
        elif kind == 1:
            q.removed(key(i), TierKind.DISK)
        elif kind == 2:
            q.tier_changed(key(i), TierKind.GPU, TierKind.HOST)
        else:
            q.cleared()


# ----------------------------------------------------------------------------- EventQueue
def test_ids_start_at_one_and_are_monotonic():
    q = EventQueue(max_events=100)
    assert q.last_event_id == 0 and len(q) == 0
    e1 = q.stored(key(1), key(0), TierKind.GPU, 16, None)
    e2 = q.tier_changed(key(1), TierKind.GPU, TierKind.HOST)
    e3 = q.removed(key(1), TierKind.HOST)
    e4 = q.cleared()
    assert [e.event_id for e in (e1, e2, e3, e4)] == [1, 2, 3, 4]
    assert q.last_event_id == 4 and len(q) == 4
    assert e1 == BlockStored(1, key(1), key(0), TierKind.GPU, 16, None)
    assert e2 == BlockTierChanged(2, key(1), TierKind.GPU, TierKind.HOST)
    assert e3 == BlockRemoved(3, key(1), TierKind.HOST)
    assert e4 == AllCleared(4)
    assert q.drain() == [e1, e2, e3, e4]
    assert len(q) == 0 and q.drain() == []
    # ids are never reused after draining
    assert q.cleared().event_id == 5
    assert q.last_event_id == 5


def test_bounded_queue_drops_oldest_and_shows_gap():
    q = EventQueue(max_events=3)
    emit_mixed(q, 3)
    assert q.dropped == 0 and len(q) == 3
    emit_mixed(q, 4)  # 7 emitted in total
    assert q.dropped == 4 and len(q) == 3
    assert q.last_event_id == 7
    assert [e.event_id for e in q.drain()] == [5, 6, 7]
    e = q.removed(key(99), TierKind.HOST)
    assert e.event_id == 8 and q.dropped == 4
    assert q.drain() == [BlockRemoved(8, key(99), TierKind.HOST)]


def test_consumer_sees_gap_equal_to_dropped():
    q = EventQueue(max_events=3)
    emit_mixed(q, 2)
    last_seen = q.drain()[-1].event_id
    assert last_seen == 2
    emit_mixed(q, 5)  # ids 3..7, only 5..7 fit
    events = q.drain()
    assert [e.event_id for e in events] == [5, 6, 7]
    gap = events[0].event_id - (last_seen + 1)
    assert gap == q.dropped == 2
    # ids stay contiguous inside a drained batch
    assert all(b.event_id == a.event_id + 1 for a, b in itertools.pairwise(events))


def test_bound_of_one():
    q = EventQueue(max_events=1)
    for _ in range(5):
        q.cleared()
    assert q.drain() == [AllCleared(5)]
    assert q.dropped == 4


def test_drain_n_in_order():
    q = EventQueue(max_events=100)
    emit_mixed(q, 10)
    assert [e.event_id for e in q.drain(3)] == [1, 2, 3]
    assert q.drain(0) == []
    assert [e.event_id for e in q.drain(4)] == [4, 5, 6, 7]
    assert len(q) == 3
    assert [e.event_id for e in q.drain(50)] == [8, 9, 10]
    assert q.drain(5) == []
    assert q.dropped == 0


def test_drained_contents():
    q = EventQueue(max_events=100)
    emit_mixed(q, 4)
    assert q.drain() == [
        BlockStored(1, key(0), key(-1), TierKind.GPU, 16, 0),
        BlockRemoved(2, key(1), TierKind.DISK),
        BlockTierChanged(3, key(2), TierKind.GPU, TierKind.HOST),
        AllCleared(4),
    ]


def test_concurrent_emit_unique_ids():
    q = EventQueue(max_events=10_000)
    n_threads, per_thread = 8, 500

    def work():
        for _ in range(per_thread):
            q.cleared()

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = q.drain()
    assert [e.event_id for e in events] == list(range(1, n_threads * per_thread + 1))
    assert q.last_event_id == n_threads * per_thread and q.dropped == 0


# ----------------------------------------------------------------------------- event values
EVENTS = [
    BlockStored(1, key(1), key(0), TierKind.GPU, 16, 2**64 - 1),
    BlockStored(2, key(2), key(1), TierKind.HOST, 8),
    BlockRemoved(3, key(1), TierKind.DISK),
    BlockTierChanged(4, key(2), TierKind.HOST, TierKind.DISK),
    AllCleared(5),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_events_frozen_pickle_value(event):
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.event_id = 99
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(event, protocol=proto))
        assert back == event and type(back) is type(event)
        assert hash(back) == hash(event)
    assert dataclasses.replace(event) == event
    assert dataclasses.replace(event, event_id=event.event_id + 1) != event


def test_event_fields_round_trip():
    back = pickle.loads(pickle.dumps(EVENTS[0]))
    assert back.key == key(1) and back.parent_key == key(0)
    assert back.tier is TierKind.GPU and back.num_tokens == 16 and back.request_id == 2**64 - 1
    assert EVENTS[1].request_id is None
    assert BlockRemoved(3, key(1), TierKind.DISK) != BlockRemoved(3, key(1), TierKind.HOST)
    assert AllCleared(5) != BlockRemoved(5, key(1), TierKind.DISK)
    assert len(set(EVENTS)) == len(EVENTS)


# ----------------------------------------------------------------------------- stats
def stats(hits=(0, 0), hit_tok=(0, 0), miss=0, miss_tok=0, ev=(0, 0), dem=(0, 0), pro=(0, 0), **kw):
    base = dict(
        hit_blocks=hits,
        hit_tokens=hit_tok,
        miss_blocks=miss,
        miss_tokens=miss_tok,
        evictions=ev,
        demotions=dem,
        promotions=pro,
        imported_blocks=kw.pop("imp", 0),
        exported_blocks=kw.pop("exp", 0),
        committed_blocks=kw.pop("com", 0),
        tiers=(TierKind.GPU, TierKind.HOST),
        bytes_in_use=kw.pop("used", (0, 0)),
        capacity_bytes=(1 << 20, 1 << 22),
    )
    base.update(kw)
    return CacheStats(**base)


EARLIER = stats((2, 1), (32, 16), 3, 48, (1, 0), (1, 0), (0, 0), imp=1, exp=0, com=4, used=(4096, 0))
LATER = stats((7, 4), (112, 64), 5, 80, (3, 1), (3, 0), (0, 2), imp=2, exp=5, com=10, used=(0, 8192))


def test_subtraction_gives_delta_by_value():
    delta = LATER - EARLIER
    assert type(delta) is StatsDelta
    assert delta == StatsDelta(
        hit_blocks=(5, 3),
        hit_tokens=(80, 48),
        miss_blocks=2,
        miss_tokens=32,
        evictions=(2, 1),
        demotions=(2, 0),
        promotions=(0, 2),
        imported_blocks=1,
        exported_blocks=5,
        committed_blocks=6,
    )
    same = EARLIER - EARLIER
    assert same == StatsDelta.zero(2)
    assert delta != StatsDelta.zero(2)


def test_delta_addition():
    d1 = LATER - EARLIER
    d2 = EARLIER - stats()
    total = d1 + d2
    assert total == LATER - stats()
    assert d1 + StatsDelta.zero(2) == d1
    assert StatsDelta.zero(2) + d1 == d1
    assert d1 + d2 == d2 + d1
    assert total.hit_blocks == (7, 4) and total.committed_blocks == 10


def test_mismatched_tier_counts_rejected():
    with pytest.raises(ValueError):
        StatsDelta.zero(2) + StatsDelta.zero(3)
    three = dataclasses.replace(stats(), hit_blocks=(0, 0, 0))
    with pytest.raises(ValueError):
        three - stats()


def test_hit_ratio():
    assert StatsDelta.zero(3).hit_ratio == 0.0
    assert stats().hit_ratio == 0.0
    assert (LATER - EARLIER).hit_ratio == pytest.approx(8 / 10)
    assert EARLIER.hit_ratio == pytest.approx(3 / 6)
    all_hits = dataclasses.replace(StatsDelta.zero(2), hit_blocks=(1, 1))
    assert all_hits.hit_ratio == 1.0
    all_miss = dataclasses.replace(StatsDelta.zero(2), miss_blocks=4)
    assert all_miss.hit_ratio == 0.0


def test_stats_pickle_and_value():
    for obj in (EARLIER, LATER - EARLIER, StatsDelta.zero(1)):
        back = pickle.loads(pickle.dumps(obj))
        assert back == obj and type(back) is type(obj)
    assert pickle.loads(pickle.dumps(LATER)).tiers == (TierKind.GPU, TierKind.HOST)
    assert stats() == stats()
    assert stats(pinned_pages=1) != stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        LATER.miss_blocks = 0  # type: ignore[misc]


def test_table_lists_tiers():
    text = LATER.table()
    assert "GPU" in text and "HOST" in text
    assert LATER.hit_ratio == pytest.approx(11 / 16)
    assert "hit ratio 0.688" in text
    assert "pinned pages 0" in text


# ----------------------------------------------------------------------------- records
def test_records_value_and_pickle():
    data = bytes(range(256)) * 4
    assert page_checksum(data) == zlib.crc32(data) & 0xFFFFFFFF
    assert page_checksum(memoryview(data)) == page_checksum(data)
    exp = ExportedBlock(key(1), key(0), True, 16, page_checksum(data), data)
    probe = ProbeResult(3, 48, (TierKind.GPU, TierKind.DISK, TierKind.GPU))
    assert probe.blocks_on(TierKind.GPU) == 2 and probe.blocks_on(TierKind.HOST) == 0
    for rec in (
        exp,
        probe,
        ImportResult((key(1),), (key(2), key(3))),
        CommittedBlockInfo(key(1), key(0), TierKind.HOST, 16),
    ):
        assert pickle.loads(pickle.dumps(rec)) == rec
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(rec, dataclasses.fields(rec)[0].name, None)


@pytest.mark.parametrize("listen", [False, True])
@pytest.mark.parametrize("bound", [2, 5, 100])
def test_stored_many_matches_one_by_one(listen, bound):
    """A batch of stores gets consecutive ids and drains (and reaches listeners) exactly as the
    same stores emitted one by one, bound and drops included; mixed with single emits."""
    rows = [(key(i), key(i + 100), TierKind.GPU, 16, i) for i in range(4)]
    one, many = EventQueue(max_events=bound), EventQueue(max_events=bound)
    heard: tuple[list, list] = ([], [])
    if listen:
        one.listeners.append(heard[0].append)
        many.listeners.append(heard[1].append)
    for q in (one, many):
        q.cleared()
    for row in rows:
        one.stored(*row)
    many.stored_many(rows)
    many.stored_many([])
    for q in (one, many):
        q.removed(key(7), TierKind.HOST)
    assert many.last_event_id == one.last_event_id == 6
    assert many.dropped == one.dropped == max(0, 6 - bound)
    assert many.drain() == one.drain()
    assert heard[1] == heard[0] and len(heard[0]) == (6 if listen else 0)
    assert all(type(e) is BlockStored for e in heard[1][1:5])


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("one"), st.integers(0, 3)),
        st.tuples(st.just("many"), st.integers(0, 6)),
        st.tuples(st.just("chain"), st.integers(0, 6)),
        st.tuples(st.just("drain"), st.integers(-1, 8)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, bound=st.integers(1, 12), listen=st.booleans())
def test_batched_stores_drain_and_drop_as_one_by_one(
    ops: list[tuple[str, int]], bound: int, listen: bool
) -> None:
    """Against a queue fed one event at a time: stored_many / stored_chain batches (queued raw,
    one item each) give the same ids, drains (whole, partial, of batches cut by the bound),
    drops, lengths and listener calls, in any interleaving with single events and drains."""
    ref, q = EventQueue(max_events=bound), EventQueue(max_events=bound)
    heard: tuple[list, list] = ([], [])
    if listen:
        ref.listeners.append(heard[0].append)
        q.listeners.append(heard[1].append)
    n = 0
    for op, arg in ops:
        if op == "drain":
            limit = None if arg < 0 else arg
            assert q.drain(limit) == ref.drain(limit)
        elif op == "one":
            ref.removed(key(n), TierKind.DISK)
            q.removed(key(n), TierKind.DISK)
            n += 1
        else:
            keys, parents, tokens = (
                [key(n + i) for i in range(arg)],
                [key(n + i - 1) for i in range(arg)],
                list(range(arg)),
            )
            tier, rid = TierKind.HOST, (None if op == "chain" else 7)
            for k, p, t in zip(keys, parents, tokens):
                ref.stored(k, p, tier, t, rid)
            if op == "chain":
                q.stored_chain(keys, parents, tier, tokens)
                keys.clear()  # the queue kept its own copy
            else:
                q.stored_many([(k, p, tier, t, rid) for k, p, t in zip(keys, parents, tokens)])
            n += arg
        assert (len(q), q.dropped, q.last_event_id) == (len(ref), ref.dropped, ref.last_event_id)
    assert q.drain() == ref.drain() and heard[1] == heard[0]

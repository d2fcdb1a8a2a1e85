"""Stateful (model-based) test of the pure global prefix index (raykv/index/prefix_index.py).

A hypothesis RuleBasedStateMachine plays a few workers. Each worker has a true op history per
incarnation (ids 1, 2, 3...); its batches go to an outbox and are delivered in order, out of
order, duplicated, re-cut over any id range, lost (a gap), or after the worker restarted (a dead
incarnation). Snapshots, restarts (with or without register_worker), purges, re-registrations,
predictions and a fake clock complete the picture. The model follows the module docstring's
event-stream contract: a worker's entries are its true state at the last id the index applied
(replays are idempotent), early batches wait in a reorder window (shrunk to REORDER_WINDOW_TEST
here) and a gap that overflows it asks for a snapshot, which replaces the entries.

After every step: each registered worker's blocks, last id and snapshot flag match the model,
``len(index)`` is the number of distinct keys held, and route() on probe chains equals the
brute-force reference (per worker, the leading keys it holds or is predicted for; ``blocks``
counts both, the tier fields count only confirmed stores, ``predicted`` only keys credited by
predict() and not stored). No removed worker and no dead incarnation's entries ever show.

Predicted credit ends at its TTL, or earlier when the worker's state is replaced wholesale (an
applied clear op, or an accepted snapshot, even of the same incarnation), as predict() documents.
"""

from __future__ import annotations

import random
from unittest import mock

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_index import CLEAR, KEYS, Clock, model_apply, put, reference_route, rm

from raykv.index import prefix_index
from raykv.index.prefix_index import ApplyResult as R
from raykv.index.prefix_index import EventBatch, PrefixIndex

POOL = KEYS[:12]  # keys the workers store: small, so chains overlap across workers
WORKERS = ("w0", "w1", "w2")
TTL = 2.0
REORDER_WINDOW_TEST = 3  # so that rules can overflow the window in a few steps
_rng = random.Random(7)
PROBES = [POOL, POOL[:1], POOL[2:9], POOL[5:], *(_rng.sample(POOL, 6) for _ in range(3))]


class _Seen:
    """What the index should hold for one registered worker (the model's side)."""

    def __init__(self, inc: int) -> None:
        self.inc = inc
        self.last = 0
        self.needs_snapshot = False
        self.pending: dict[int, EventBatch] = {}


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._window = mock.patch.object(prefix_index, "REORDER_WINDOW", REORDER_WINDOW_TEST)
        self._window.start()
        self.clock = Clock()
        self.ix = PrefixIndex(predict_ttl_s=TTL, clock=self.clock)
        self.lanes: dict[str, int] = {}
        self.truth: dict[str, dict[int, list]] = {w: {1: []} for w in WORKERS}  # w -> inc -> ops
        self.inc = dict.fromkeys(WORKERS, 1)  # each worker's live incarnation
        self.outbox: list[EventBatch] = []
        self.seen: dict[str, _Seen] = {}  # registered workers
        self.preds: dict[str, dict[bytes, float]] = {}  # w -> key -> expiry

    def teardown(self) -> None:
        self._window.stop()

    # ---- the model -------------------------------------------------------------------------
    def held(self, w: str) -> dict[bytes, int]:
        s = self.seen[w]
        return model_apply({}, self.truth[w][s.inc][: s.last])

    def _register(self, w: str, inc: int) -> None:
        s = self.seen.get(w)
        if s is not None and inc <= s.inc:
            return
        self.seen[w] = _Seen(inc)
        self.preds.pop(w, None)

    def _applied(self, s: _Seen, b: EventBatch) -> None:
        s.last = b.last_event_id
        if CLEAR in b.ops:
            # a clear drops the worker's predicted credit before its TTL (also when replayed by an
            # overlapping batch), as predict() documents
            self.preds.pop(b.worker, None)

    def _drain(self, s: _Seen) -> None:
        while True:
            ready = sorted(f for f in s.pending if f <= s.last + 1)
            if not ready:
                return
            for f in ready:
                b = s.pending.pop(f)
                if b.last_event_id > s.last:
                    self._applied(s, b)

    def expect_apply(self, b: EventBatch) -> R:
        s = self.seen.get(b.worker)
        if s is None:
            return R.UNKNOWN_WORKER
        if b.incarnation < s.inc:
            return R.STALE_INCARNATION
        if b.incarnation > s.inc:  # a batch of a newer incarnation restarts the worker
            self._register(b.worker, b.incarnation)
            s = self.seen[b.worker]
            s.needs_snapshot = b.first_event_id != 1
        if b.last_event_id <= s.last:
            return R.DUPLICATE
        if b.first_event_id > s.last + 1:
            if len(s.pending) >= REORDER_WINDOW_TEST:
                s.needs_snapshot = True
                return R.NEEDS_SNAPSHOT
            s.pending[b.first_event_id] = b
            return R.BUFFERED
        self._applied(s, b)
        self._drain(s)
        return R.NEEDS_SNAPSHOT if s.needs_snapshot else R.APPLIED

    def deliver(self, b: EventBatch) -> None:
        expect = self.expect_apply(b)
        assert self.ix.apply_batch(b) == expect

    def emit(self, w: str, ops: list, now: bool) -> None:
        log = self.truth[w][self.inc[w]]
        first = len(log) + 1
        log.extend(ops)
        b = EventBatch(w, self.inc[w], first, len(log), tuple(ops))
        if now:
            self.deliver(b)
        else:
            self.outbox.append(b)

    # ---- rules -----------------------------------------------------------------------------
    @initialize(lanes=st.lists(st.sampled_from([0, 1, 2, 5, 17, 63]), min_size=3, max_size=3, unique=True))
    def setup(self, lanes: list[int]) -> None:
        for w, lane in zip(WORKERS, lanes):
            self.lanes[w] = lane
            self.ix.register_worker(w, lane, 1)
            self._register(w, 1)

    @rule(
        w=st.sampled_from(WORKERS),
        start=st.integers(0, len(POOL) - 1),
        n=st.integers(1, 6),
        tier=st.integers(0, 2),
        now=st.booleans(),
    )
    def store_chain(self, w: str, start: int, n: int, tier: int, now: bool) -> None:
        self.emit(w, [put(k, tier) for k in POOL[start : start + n]], now)

    @rule(
        w=st.sampled_from(WORKERS),
        keys=st.lists(st.sampled_from(POOL), min_size=1, max_size=4),
        now=st.booleans(),
    )
    def remove_keys(self, w: str, keys: list[bytes], now: bool) -> None:
        self.emit(w, [rm(k) for k in keys], now)

    @rule(w=st.sampled_from(WORKERS), n=st.integers(0, 3), now=st.booleans())
    def clear_then_store(self, w: str, n: int, now: bool) -> None:
        self.emit(w, [CLEAR, *(put(k, 0) for k in POOL[:n])], now)

    @precondition(lambda self: self.outbox)
    @rule(data=st.data())
    def deliver_held(self, data: st.DataObject) -> None:
        """Deliver a held-back batch: the oldest (in order) or any other (out of order)."""
        i = data.draw(st.integers(0, len(self.outbox) - 1))
        self.deliver(self.outbox.pop(i))

    @precondition(lambda self: self.outbox)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        """A batch is lost: a gap the index can close only with a snapshot (or a re-cut batch)."""
        self.outbox.pop(data.draw(st.integers(0, len(self.outbox) - 1)))

    @rule(w=st.sampled_from(WORKERS), data=st.data())
    def recut(self, w: str, data: st.DataObject) -> None:
        """Any id range of any incarnation's history: a duplicate, an overlap, a stale batch."""
        inc = data.draw(st.sampled_from(sorted(self.truth[w])))
        log = self.truth[w][inc]
        if not log:
            return
        first = data.draw(st.integers(1, len(log)))
        last = data.draw(st.integers(first, len(log)))
        self.deliver(EventBatch(w, inc, first, last, tuple(log[first - 1 : last])))

    @rule(w=st.sampled_from(WORKERS), data=st.data())
    def snapshot(self, w: str, data: st.DataObject) -> None:
        """The truth of some incarnation at some id (what the control plane sends on a gap)."""
        if w not in self.seen:
            return
        inc = data.draw(st.sampled_from(sorted(self.truth[w])))
        log = self.truth[w][inc]
        upto = data.draw(st.integers(0, len(log)))
        blocks = list(model_apply({}, log[:upto]).items())
        s = self.seen[w]
        if inc < s.inc or (inc == s.inc and upto < s.last):
            stale = True
        else:
            stale = False
            self._register(w, inc)
            s = self.seen[w]
            s.last, s.needs_snapshot = upto, False
            s.pending = {f: b for f, b in s.pending.items() if b.last_event_id > upto}
            # every accepted snapshot drops the worker's predicted credit, even one of the same
            # incarnation, as predict() documents
            self.preds.pop(w, None)
            self._drain(s)
        before = self.ix.counters["snapshots"]
        self.ix.apply_snapshot(w, inc, upto, blocks)
        assert self.ix.counters["snapshots"] == before + (not stale)

    @rule(w=st.sampled_from(WORKERS), register=st.booleans())
    def restart(self, w: str, register: bool) -> None:
        """A new incarnation; the index learns of it by register_worker or by its first batch."""
        self.inc[w] += 1
        self.truth[w][self.inc[w]] = []
        if register and w in self.seen:
            self.ix.register_worker(w, self.lanes[w], self.inc[w])
            self._register(w, self.inc[w])

    @rule(w=st.sampled_from(WORKERS))
    def purge(self, w: str) -> None:
        dropped = self.ix.remove_worker(w)
        if w in self.seen:
            assert dropped == len(self.held(w))
            del self.seen[w]
            self.preds.pop(w, None)
        else:
            assert dropped == 0

    @rule(w=st.sampled_from(WORKERS), old=st.booleans())
    def register(self, w: str, old: bool) -> None:
        """(Re-)register a worker with its live incarnation, or an older one (a no-op if known)."""
        inc = max(1, self.inc[w] - old)
        self.ix.register_worker(w, self.lanes[w], inc)
        self._register(w, inc)

    @rule(w=st.sampled_from(WORKERS), keys=st.lists(st.sampled_from(POOL), max_size=6))
    def predict(self, w: str, keys: list[bytes]) -> None:
        self.ix.predict(w, keys)
        if w in self.seen:
            self.preds.setdefault(w, {}).update(dict.fromkeys(keys, self.clock.t + TTL))

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5]))
    def tick(self, dt: float) -> None:
        self.clock.t += dt

    @rule(chain=st.lists(st.sampled_from(POOL), min_size=1, max_size=10))
    def probe(self, chain: list[bytes]) -> None:
        self.check_route(chain)

    # ---- invariants ------------------------------------------------------------------------
    def check_route(self, keys: list[bytes]) -> None:
        held = {w: self.held(w) for w in self.seen}
        now = self.clock.t
        live = {w: {k for k, t in p.items() if t > now} for w, p in self.preds.items()}
        got = self.ix.route(keys)
        assert set(got) <= set(self.seen), "a removed worker is routed to"
        assert got == reference_route(held, live, keys), keys

    @invariant()
    def index_matches_model(self) -> None:
        ix = self.ix
        assert ix.workers == {w: self.lanes[w] for w in self.seen}
        union: set[bytes] = set()
        for w, s in self.seen.items():
            held = self.held(w)
            union |= held.keys()
            assert ix.worker_blocks(w) == {k[: prefix_index.KEY_PREFIX]: t for k, t in held.items()}, w
            assert ix.last_event_id(w) == s.last, w
        assert sorted(ix.workers_needing_snapshot()) == sorted(
            w for w, s in self.seen.items() if s.needs_snapshot
        )
        assert len(ix) == len(union)

    @invariant()
    def routes_match_model(self) -> None:
        if not self.lanes:
            return
        for keys in PROBES:
            self.check_route(keys)


TestPrefixIndexStateful = IndexMachine.TestCase
TestPrefixIndexStateful.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)

"""The global prefix index (pure data structure; the IndexShard actor wraps it).

Which worker holds which block, on which tier. Keys are spread over shards by
:func:`shard_of` (first 8 key bytes, big-endian, mod N). Each worker has a deployment-wide *lane*
(a small int); an entry stores, per key, an immutable tuple of four lane-spread bitmasks
``(all, gpu, host, disk)`` where worker ``w``'s bit is ``1 << (LANE_BITS * lane)``. Routing ANDs
the masks of consecutive keys and adds the per-tier masks into 16-bit lanes, so one pass over the
keys yields, for every worker at once, its cached prefix length and its blocks on each tier
(:mod:`raykv.index.route`; RouteMatch and merge_route are re-exported here).

Event stream contract: each worker numbers its events 1, 2, 3... per incarnation. A batch carries
``(worker, incarnation, first_event_id, last_event_id)``; a shard applies batches in id order,
buffers a few out-of-order ones, ignores duplicates and batches of dead incarnations, and flags the
worker for a snapshot when a gap cannot be closed. A snapshot ``(last_event_id, blocks)`` replaces
the worker's entries; batches up to that id are then stale. A batch that overlaps ids already
applied is applied whole: every op is an upsert or removal of one key (or a clear), so replaying
ops up to id N on top of the state at id N leaves it unchanged. Every rejected batch (unknown worker,
malformed key, dead incarnation) is counted and changes nothing.
"""

from __future__ import annotations

import collections
import enum
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from raykv.core.events import AllCleared, BlockRemoved, BlockStored, BlockTierChanged, CacheEvent
from raykv.core.types import BLOCK_KEY_BYTES, TierKind, WorkerId
from raykv.index.keytable import KeyTableLike, new_key_table
from raykv.index.route import (
    FIRST_LOOKUPS,
    LANE_BITS,
    MAX_ROUTE_BLOCKS,
    Entry,
    RouteMatch,
    RouteMemo,
    merge_route,
    route_held,
)

MAX_LANES = 4096
OP_STORE, OP_REMOVE, OP_CLEAR = 0, 1, 2
REORDER_WINDOW = 64
PREFETCH_OPS = 512  # batches up to this long warm their keys' slots first
_KEY_OF_OP = operator.itemgetter(1)
COMPILED_LANES = 64  # up to this many lanes the compiled key table routes (route_held in C)
CANON_LIMIT = 65_536  # distinct entry objects kept canonical (interned); beyond it the table restarts


def shard_of(key: bytes, num_shards: int) -> int:
    """The shard that owns ``key``: its first 8 bytes (big-endian) modulo ``num_shards``."""
    return int.from_bytes(key[:8], "big") % num_shards


@dataclass(frozen=True)
class EventBatch:
    """A worker's events ``first_event_id ..= last_event_id`` as ordered ops ``(op, key, tier)``.

    ``op`` is OP_STORE (stored or tier changed: the key is now on ``tier``), OP_REMOVE or OP_CLEAR
    (key and tier unused). A per-shard sub-batch keeps the id range of the whole batch and only
    the ops of keys that shard owns (plus clears).
    """

    worker: WorkerId
    incarnation: int
    first_event_id: int
    last_event_id: int
    ops: tuple[tuple[int, bytes, int], ...]

    @classmethod
    def from_events(cls, worker: WorkerId, incarnation: int, events: Sequence[CacheEvent]) -> EventBatch:
        """Build a batch from consecutive manager events (ids must be contiguous)."""
        if not events:
            raise ValueError("an event batch needs at least one event")
        ops: list[tuple[int, bytes, int]] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                ops.append((OP_STORE, ev.key, int(ev.tier)))
            elif isinstance(ev, BlockTierChanged):
                ops.append((OP_STORE, ev.key, int(ev.new_tier)))
            elif isinstance(ev, BlockRemoved):
                ops.append((OP_REMOVE, ev.key, 0))
            elif isinstance(ev, AllCleared):
                ops.append((OP_CLEAR, b"", 0))
        return cls(worker, incarnation, events[0].event_id, events[-1].event_id, tuple(ops))

    def for_shard(self, shard: int, num_shards: int) -> EventBatch:
        """The sub-batch of ops that ``shard`` owns (same id range)."""
        if num_shards == 1:
            return self
        ops = tuple(op for op in self.ops if op[0] == OP_CLEAR or shard_of(op[1], num_shards) == shard)
        return EventBatch(self.worker, self.incarnation, self.first_event_id, self.last_event_id, ops)


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    BUFFERED = "buffered"  # arrived early; applied once the gap before it closes
    DUPLICATE = "duplicate"
    STALE_INCARNATION = "stale_incarnation"
    NEEDS_SNAPSHOT = "needs_snapshot"
    UNKNOWN_WORKER = "unknown_worker"
    MALFORMED = "malformed"


@dataclass
class _Worker:
    lane: int
    incarnation: int
    last_event_id: int = 0
    needs_snapshot: bool = False
    key_log: list[bytes] = field(default_factory=list)  # every key stored; may hold stale ones
    live: int = 0  # keys this shard currently lists for the worker
    pending: dict[int, EventBatch] = field(default_factory=dict)


def _lane_bit(lane: int) -> int:
    return 1 << (LANE_BITS * lane)


class _Memo:
    """Per-batch entry transitions, keyed by the old entry's identity (the memo holds the old
    entry, so its id cannot be reused while the memo lives). Keys sharing an entry share the
    transition's result, which is interned, so one batch creates each new entry once."""

    __slots__ = ("_cleared", "_stored")

    def __init__(self) -> None:
        self._stored: dict[tuple[int, int], tuple[Entry, Entry, bool]] = {}
        self._cleared: dict[int, tuple[Entry, Entry | None]] = {}

    def stored(
        self, e: Entry, bit: int, fresh: Entry, intern: Callable[[Entry], Entry]
    ) -> tuple[Entry, bool]:
        """``e`` with ``bit`` now on ``fresh``'s tier, and whether ``bit`` was absent from ``e``."""
        memo_key = (id(e), id(fresh))
        hit = self._stored.get(memo_key)
        if hit is None:
            was_absent = not e[0] & bit
            if not was_absent:
                clear = ~bit
                e2 = (e[0], e[1] & clear, e[2] & clear, e[3] & clear)
            else:
                e2 = e
            new = intern((e2[0] | bit, e2[1] | fresh[1], e2[2] | fresh[2], e2[3] | fresh[3]))
            hit = self._stored[memo_key] = (e, new, was_absent)
        return hit[1], hit[2]

    def cleared(self, e: Entry, clear: int, intern: Callable[[Entry], Entry]) -> Entry | None:
        """``e`` without the bit ``~clear`` (None when nobody holds the key any more)."""
        hit = self._cleared.get(id(e))
        if hit is None:
            held = e[0] & clear
            new = intern((held, e[1] & clear, e[2] & clear, e[3] & clear)) if held else None
            hit = self._cleared[id(e)] = (e, new)
        return hit[1]


class PrefixIndex:
    """One shard of the global index. Not thread-safe (the actor serializes calls).

    ``clock`` (seconds, monotonic) drives the TTL of predicted entries.
    """

    def __init__(
        self,
        shard: int = 0,
        num_shards: int = 1,
        predict_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} not in 0..{num_shards - 1}")
        self.shard = shard
        self.num_shards = num_shards
        self.predict_ttl_s = predict_ttl_s
        self._clock = clock
        self._entries: KeyTableLike = new_key_table()  # key -> Entry (compiled when built)
        self._workers: dict[WorkerId, _Worker] = {}
        self._lanes: dict[int, WorkerId] = {}
        self._predicted: dict[bytes, dict[int, float]] = {}
        self._canon: dict[Entry, Entry] = {}
        self._route_memo: RouteMemo = {}  # see raykv.index.route._collect
        self._compiled_route = getattr(self._entries, "route", None)  # the compiled table's walk
        self._lane_names: tuple[WorkerId | None, ...] | None = ()  # lane -> worker (None: > 64 lanes)
        self.counters: collections.Counter[str] = collections.Counter()

    # ---- membership ----------------------------------------------------------------------------
    def register_worker(self, worker: WorkerId, lane: int, incarnation: int) -> None:
        """Add a worker (or a new incarnation of it, which drops the old one's entries)."""
        if not 0 <= lane < MAX_LANES:
            raise ValueError(f"lane must be in 0..{MAX_LANES - 1}, got {lane}")
        owner = self._lanes.get(lane)
        if owner is not None and owner != worker:
            raise ValueError(f"lane {lane} already belongs to {owner!r}")
        state = self._workers.get(worker)
        if state is not None:
            if incarnation <= state.incarnation:
                return
            self._drop_entries(worker, state)
        self._workers[worker] = _Worker(lane=lane, incarnation=incarnation)
        self._lanes[lane] = worker
        self._lanes_changed()

    def remove_worker(self, worker: WorkerId) -> int:
        """Forget a worker (dead or gone) and all its entries; returns how many were dropped."""
        state = self._workers.pop(worker, None)
        if state is None:
            return 0
        self._lanes.pop(state.lane, None)
        self._lanes_changed()
        return self._drop_entries(worker, state)

    def _lanes_changed(self) -> None:
        """Forget route answers and rebuild the lane -> worker tuple the compiled route reads."""
        self._route_memo.clear()
        top = max(self._lanes, default=-1) + 1
        self._lane_names = tuple(map(self._lanes.get, range(top))) if top <= COMPILED_LANES else None

    def _drop_entries(self, worker: WorkerId, state: _Worker) -> int:
        live = self._live_keys(state)
        clear = ~_lane_bit(state.lane)
        entries, memo = self._entries, _Memo()
        for key in live:
            new = memo.cleared(entries[key], clear, self._intern)
            if new is None:
                del entries[key]
            else:
                entries[key] = new
        n = len(live)
        state.key_log.clear()
        state.live = 0
        for slots in self._predicted.values():
            slots.pop(state.lane, None)
        return n

    def _intern(self, entry: Entry) -> Entry:
        """The canonical object equal to ``entry`` (so route() can find runs by identity)."""
        canon = self._canon.get(entry)
        if canon is None:
            if len(self._canon) >= CANON_LIMIT:
                self._canon.clear()
            self._canon[entry] = canon = entry
        return canon

    def _live_keys(self, state: _Worker) -> list[bytes]:
        """The keys this shard lists for a worker (its key log without stale or repeated keys)."""
        bit = _lane_bit(state.lane)
        get = self._entries.get
        out = []
        for key in dict.fromkeys(state.key_log):
            e = get(key)
            if e is not None and e[0] & bit:
                out.append(key)
        return out

    @property
    def workers(self) -> dict[WorkerId, int]:
        """Registered workers and their lanes."""
        return {w: s.lane for w, s in self._workers.items()}

    def workers_needing_snapshot(self) -> list[WorkerId]:
        return [w for w, s in self._workers.items() if s.needs_snapshot]

    def last_event_id(self, worker: WorkerId) -> int:
        return self._workers[worker].last_event_id

    def incarnation(self, worker: WorkerId) -> int:
        """The registered incarnation of ``worker`` (KeyError for an unknown one)."""
        return self._workers[worker].incarnation

    def __len__(self) -> int:
        return len(self._entries)

    # ---- event ingest --------------------------------------------------------------------------
    def apply_batch(self, batch: EventBatch) -> ApplyResult:
        """Apply one (sub-)batch in event-id order; see the module docstring for the rules."""
        state = self._workers.get(batch.worker)
        if state is None:
            self.counters["rejected_unknown_worker"] += 1
            return ApplyResult.UNKNOWN_WORKER
        if batch.incarnation < state.incarnation:
            self.counters["rejected_stale_incarnation"] += 1
            return ApplyResult.STALE_INCARNATION
        if not _well_formed(batch):
            self.counters["rejected_malformed"] += 1
            return ApplyResult.MALFORMED
        if batch.incarnation > state.incarnation:
            self.register_worker(batch.worker, state.lane, batch.incarnation)
            state = self._workers[batch.worker]
            state.needs_snapshot = batch.first_event_id != 1
        if batch.last_event_id <= state.last_event_id:
            self.counters["duplicate_batches"] += 1
            return ApplyResult.DUPLICATE
        if batch.first_event_id > state.last_event_id + 1:
            if len(state.pending) >= REORDER_WINDOW:
                state.needs_snapshot = True
                self.counters["gaps"] += 1
                return ApplyResult.NEEDS_SNAPSHOT
            state.pending[batch.first_event_id] = batch
            self.counters["buffered_batches"] += 1
            return ApplyResult.BUFFERED
        self._apply_ops(batch.worker, state, batch.ops)
        state.last_event_id = batch.last_event_id
        self.counters["applied_batches"] += 1
        self.counters["applied_ops"] += len(batch.ops)
        self._drain_pending(batch.worker, state)
        return ApplyResult.NEEDS_SNAPSHOT if state.needs_snapshot else ApplyResult.APPLIED

    def _drain_pending(self, worker: WorkerId, state: _Worker) -> None:
        while state.pending:
            ready = [fid for fid in state.pending if fid <= state.last_event_id + 1]
            if not ready:
                return
            for fid in sorted(ready):
                batch = state.pending.pop(fid)
                if batch.last_event_id > state.last_event_id:
                    self._apply_ops(worker, state, batch.ops)
                    state.last_event_id = batch.last_event_id
                    self.counters["applied_batches"] += 1

    def _apply_ops(self, worker: WorkerId, state: _Worker, ops: Iterable[tuple[int, bytes, int]]) -> None:
        bit = _lane_bit(state.lane)
        clear = ~bit
        intern = self._intern
        fresh = tuple(intern(f) for f in ((bit, bit, 0, 0), (bit, 0, bit, 0), (bit, 0, 0, bit)))
        entries, log = self._entries, state.key_log
        get, append = entries.get, log.append
        memo = _Memo()
        stored = memo.stored
        seen: tuple[dict[int, tuple[Entry, bool]], ...] = ({}, {}, {})  # per tier: id(old) -> result
        added = removed = 0
        if isinstance(ops, (tuple, list)) and len(ops) <= PREFETCH_OPS:  # a worker's event batch
            entries.prefetch(list(map(_KEY_OF_OP, ops)))  # the slots load together, not one by one
        for op, key, tier in ops:
            if op == OP_STORE:
                e = get(key)
                if e is None:
                    entries[key] = fresh[tier]
                    append(key)
                    added += 1
                    continue
                hit = seen[tier].get(id(e))  # the memo keeps ``e`` alive: its id stays unique
                if hit is None:
                    hit = seen[tier][id(e)] = stored(e, bit, fresh[tier], intern)
                entries[key] = hit[0]
                if hit[1]:
                    append(key)
                    added += 1
            elif op == OP_REMOVE:
                e = get(key)
                if e is not None and e[0] & bit:
                    new_e = memo.cleared(e, clear, intern)
                    if new_e is None:
                        del entries[key]
                    else:
                        entries[key] = new_e
                    removed += 1
            else:
                state.live += added - removed
                added = removed = 0
                self._drop_entries(worker, state)
        state.live += added - removed
        if len(log) > 2 * state.live + 1024:
            log[:] = self._live_keys(state)

    def apply_snapshot(
        self, worker: WorkerId, incarnation: int, last_event_id: int, blocks: Iterable[tuple[bytes, int]]
    ) -> None:
        """Replace a worker's entries with a snapshot taken at ``last_event_id``.

        ``blocks`` are ``(key, tier)`` pairs of every committed block (only this shard's keys are
        kept). Raises KeyError for an unknown worker and ValueError for a malformed key.
        """
        state = self._workers[worker]
        if incarnation < state.incarnation:
            self.counters["rejected_stale_incarnation"] += 1
            return
        if incarnation == state.incarnation and last_event_id < state.last_event_id:
            self.counters["rejected_stale_snapshot"] += 1
            return
        mine = [
            (k, t) for k, t in blocks if self.num_shards == 1 or shard_of(k, self.num_shards) == self.shard
        ]
        for k, t in mine:
            if len(k) != BLOCK_KEY_BYTES or not 0 <= t <= 2:
                raise ValueError("snapshot holds a malformed key or tier")
        if incarnation > state.incarnation:
            self.register_worker(worker, state.lane, incarnation)
            state = self._workers[worker]
        self._drop_entries(worker, state)
        self._apply_ops(worker, state, ((OP_STORE, k, t) for k, t in mine))
        state.last_event_id = last_event_id
        state.needs_snapshot = False
        state.pending = {f: b for f, b in state.pending.items() if b.last_event_id > last_event_id}
        self._drain_pending(worker, state)
        self.counters["snapshots"] += 1

    # ---- queries -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> tuple[list[Entry | None], list[int]]:
        """Raw entries and predicted masks for ``keys`` (a copy; valid until the next change)."""
        entries = self._entries.get_many(keys)
        pred = self._predicted
        if not pred:
            return entries, []
        now = self._clock()
        predicted = [self._predicted_mask(k, now) if k in pred else 0 for k in keys]
        return entries, predicted if any(predicted) else []

    def _predicted_mask(self, key: bytes, now: float) -> int:
        slots = self._predicted.get(key)
        if not slots:
            return 0
        mask = 0
        for lane, expiry in list(slots.items()):
            if expiry <= now:
                del slots[lane]
            else:
                mask |= _lane_bit(lane)
        if not slots:
            del self._predicted[key]
        return mask

    def route(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]:
        """Per worker, the cached prefix of ``keys`` (all keys must belong to this shard; with one
        shard that is every key). Workers with no cached prefix are omitted."""
        if not self._predicted:  # the common case: keys are looked up until the prefix ends
            names = self._lane_names
            if names is not None and self._compiled_route is not None:  # it caps n itself
                out = self._compiled_route(keys, names, RouteMatch)
                if out is not None:  # None: an entry it cannot read, Python routes
                    return out  # type: ignore[no-any-return]
            n = min(len(keys), MAX_ROUTE_BLOCKS)
            if not n:
                return {}
            get_many = self._entries.get_many
            first = get_many(keys[:FIRST_LOOKUPS])
            return route_held(first, n, self._lanes, keys, get_many, self._route_memo)
        entries, predicted = self.lookup(keys)
        return merge_route(entries, predicted, self._lanes)

    def predict(self, worker: WorkerId, keys: Iterable[bytes]) -> None:
        """Credit ``worker`` with ``keys`` for ``predict_ttl_s`` seconds (until its events land).
        The credit ends earlier when the worker's state is replaced wholesale: an applied clear op
        of the worker, or an accepted snapshot for it (its real contents are known then)."""
        state = self._workers.get(worker)
        if state is None:
            return
        expiry = self._clock() + self.predict_ttl_s
        for key in keys:
            self._predicted.setdefault(key, {})[state.lane] = expiry
        if len(self._predicted) > 1_000_000:
            now = self._clock()
            for key in list(self._predicted):
                self._predicted_mask(key, now)

    def worker_blocks(self, worker: WorkerId) -> dict[bytes, TierKind]:
        """Every key this shard lists for ``worker``, with its tier (for checks and tests)."""
        state = self._workers[worker]
        bit = _lane_bit(state.lane)
        out: dict[bytes, TierKind] = {}
        for key in self._live_keys(state):
            e = self._entries[key]
            tier = 0 if e[1] & bit else 1 if e[2] & bit else 2
            out[key] = TierKind(tier)
        return out


def _well_formed(batch: EventBatch) -> bool:
    if batch.first_event_id < 1 or batch.last_event_id < batch.first_event_id:
        return False
    for op, key, tier in batch.ops:
        if op == OP_CLEAR:
            continue
        if op not in (OP_STORE, OP_REMOVE) or not isinstance(key, bytes) or len(key) != BLOCK_KEY_BYTES:
            return False
        if op == OP_STORE and not 0 <= tier <= 2:
            return False
    return True


__all__ = [
    "CANON_LIMIT",
    "LANE_BITS",
    "MAX_LANES",
    "MAX_ROUTE_BLOCKS",
    "OP_CLEAR",
    "OP_REMOVE",
    "OP_STORE",
    "REORDER_WINDOW",
    "ApplyResult",
    "Entry",
    "EventBatch",
    "PrefixIndex",
    "RouteMatch",
    "merge_route",
    "shard_of",
]

"""The global prefix index (pure data structure; the IndexShard actor wraps it).

Which worker holds which block, on which tier. Keys are spread over shards by
:func:`shard_of` (first 8 key bytes, big-endian, mod N). Each worker has a deployment-wide *lane*
(a small int). The table (:mod:`raykv.index.holders`: compiled, or its pure-Python twin) keeps,
per key prefix, the set of lanes holding the key and their tiers, with no Python object per key
or holder in the compiled one. A lookup reads an entry as the tuple of four lane-spread bitmasks
``(all, gpu, host, disk)`` where worker ``w``'s bit is ``1 << (LANE_BITS * lane)``; a route walks
the chain once and yields, for every worker at once, its cached prefix length and its blocks on
each tier (:mod:`raykv.index.route`; RouteMatch and merge_route are re-exported here).

Event stream contract: each worker numbers its events 1, 2, 3... per incarnation. A batch carries
``(worker, incarnation, first_event_id, last_event_id)`` and its ops packed (one record per op,
:data:`raykv.index.holders.RECORD` bytes); a shard applies batches in id order,
buffers a few out-of-order ones, ignores duplicates and batches of dead incarnations, and flags the
worker for a snapshot when a gap cannot be closed. A snapshot ``(last_event_id, blocks)`` replaces
the worker's entries; batches up to that id are then stale. A batch that overlaps ids already
applied is applied whole: every op is an upsert or removal of one key (or a clear), so replaying
ops up to id N on top of the state at id N leaves it unchanged. Every rejected batch (unknown worker,
malformed op, dead incarnation) is counted and changes nothing.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from raykv.core.events import AllCleared, BlockRemoved, BlockStored, BlockTierChanged, CacheEvent
from raykv.core.types import BLOCK_KEY_BYTES, TierKind, WorkerId
from raykv.index.holders import (
    KEY_PREFIX,
    OP_CLEAR,
    OP_REMOVE,
    OP_STORE,
    RECORD,
    HoldersLike,
    compiled_route,
    has_clear,
    new_holders,
    pack_ops,
    split,
    unpack_ops,
)
from raykv.index.route import (
    FIRST_LOOKUPS,
    LANE_BITS,
    MAX_ROUTE_BLOCKS,
    Entry,
    RouteMatch,
    RouteMemo,
    merge_route,
    pack_rows,
    route_held,
)

MAX_LANES = 4096
REORDER_WINDOW = 64
MOVE_SLOTS = 1 << 15  # slots of a growing table one maintain() call moves (well under a millisecond)


def shard_of(key: bytes, num_shards: int) -> int:
    """The shard that owns ``key``: its first 8 bytes (big-endian) modulo ``num_shards``."""
    return int.from_bytes(key[:8], "big") % num_shards


@dataclass(frozen=True)
class EventBatch:
    """A worker's events ``first_event_id ..= last_event_id`` as packed ops (``data``).

    ``data`` holds one :data:`~raykv.index.holders.RECORD`-byte record per op: OP_STORE (stored or
    tier changed: the key is now on its tier), OP_REMOVE or OP_CLEAR. A sequence of ``(op, key,
    tier)`` triples given instead is packed on construction (a malformed triple packs as a record
    that makes the batch MALFORMED when applied). ``ops`` reads the triples back. A per-shard
    sub-batch keeps the id range of the whole batch and only the ops of keys that shard owns
    (plus clears). Pickles as one bytes object, whatever its length.
    """

    worker: WorkerId
    incarnation: int
    first_event_id: int
    last_event_id: int
    data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes):
            object.__setattr__(self, "data", pack_ops(self.data))

    @property
    def ops(self) -> tuple[tuple[int, bytes, int], ...]:
        """The ops as ``(op, key, tier)`` triples (a clear reads ``(OP_CLEAR, b"", 0)``)."""
        return unpack_ops(self.data)

    @property
    def n_ops(self) -> int:
        """How many ops the batch holds."""
        return len(self.data) // RECORD

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
        return cls(worker, incarnation, events[0].event_id, events[-1].event_id, pack_ops(ops))

    def for_shard(self, shard: int, num_shards: int) -> EventBatch:
        """The sub-batch of ops that ``shard`` owns (same id range)."""
        if num_shards == 1:
            return self
        part = split(self.data, num_shards)[shard]
        return EventBatch(self.worker, self.incarnation, self.first_event_id, self.last_event_id, part)

    def for_shards(self, num_shards: int) -> list[EventBatch]:
        """Every shard's sub-batch at once (one pass over the ops)."""
        if num_shards == 1:
            return [self]
        w, inc, first, last = self.worker, self.incarnation, self.first_event_id, self.last_event_id
        return [EventBatch(w, inc, first, last, part) for part in split(self.data, num_shards)]


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
    pending: dict[int, EventBatch] = field(default_factory=dict)


class PrefixIndex:
    """One shard of the global index. Not thread-safe (the actor serializes calls).

    ``clock`` (seconds, monotonic) drives the TTL of predicted entries. ``capacity`` pre-sizes the
    table for that many keys (0: it grows 2x as needed, a few slots per write, never all at once).
    """

    def __init__(
        self,
        shard: int = 0,
        num_shards: int = 1,
        predict_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        capacity: int = 0,
    ) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} not in 0..{num_shards - 1}")
        self.shard = shard
        self.num_shards = num_shards
        self.predict_ttl_s = predict_ttl_s
        self._clock = clock
        self._table: HoldersLike = new_holders(capacity)
        self._compiled_route = compiled_route(self._table)  # None: the Python walk
        self._workers: dict[WorkerId, _Worker] = {}
        self._lanes: dict[int, WorkerId] = {}
        self._lane_names: tuple[WorkerId | None, ...] = ()  # lane -> worker, for the compiled route
        self._predicted: dict[bytes, dict[int, float]] = {}
        self._route_memo: RouteMemo = {}  # see raykv.index.route._collect (the Python walk)
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
            self._drop_entries(state)
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
        return self._drop_entries(state)

    def _lanes_changed(self) -> None:
        """Forget route answers and rebuild the lane -> worker tuple the compiled route reads."""
        self._route_memo.clear()
        top = max(self._lanes, default=-1) + 1
        self._lane_names = tuple(map(self._lanes.get, range(top)))

    def _drop_entries(self, state: _Worker) -> int:
        """Take the worker's lane out of every key (the table edits its holder sets in place)."""
        for slots in self._predicted.values():
            slots.pop(state.lane, None)
        self._route_memo.clear()
        return self._table.drop_lane(state.lane)

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
        return len(self._table)

    def memory(self) -> int:
        """Bytes the table uses (slots, holder sets and their lookup structures)."""
        return self._table.memory()

    def table_stats(self) -> dict[str, object]:
        """The table's capacity, fill, bytes, holder sets and growth state."""
        return self._table.stats()

    def maintain(self, slots: int = MOVE_SLOTS) -> bool:
        """Move up to ``slots`` slots of a table that is growing (between requests, so the move
        finishes without waiting for writes); returns whether a move is still under way."""
        return self._table.maintain(slots)

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
        if not self._well_formed(batch):
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
        self._apply_ops(state, batch.data)
        state.last_event_id = batch.last_event_id
        self.counters["applied_batches"] += 1
        self.counters["applied_ops"] += batch.n_ops
        self._drain_pending(state)
        return ApplyResult.NEEDS_SNAPSHOT if state.needs_snapshot else ApplyResult.APPLIED

    def _well_formed(self, batch: EventBatch) -> bool:
        if batch.first_event_id < 1 or batch.last_event_id < batch.first_event_id:
            return False
        return type(batch.data) is bytes and self._table.validate(batch.data)

    def _drain_pending(self, state: _Worker) -> None:
        while state.pending:
            ready = [fid for fid in state.pending if fid <= state.last_event_id + 1]
            if not ready:
                return
            for fid in sorted(ready):
                batch = state.pending.pop(fid)
                if batch.last_event_id > state.last_event_id:
                    self._apply_ops(state, batch.data)
                    state.last_event_id = batch.last_event_id
                    self.counters["applied_batches"] += 1

    def _apply_ops(self, state: _Worker, data: bytes) -> None:
        """Apply validated packed ops of one worker (one call into the table)."""
        if has_clear(data):
            for slots in self._predicted.values():
                slots.pop(state.lane, None)
        self._table.apply(state.lane, data)
        if self._route_memo:
            self._route_memo.clear()

    def apply_snapshot(
        self, worker: WorkerId, incarnation: int, last_event_id: int, blocks: Iterable[tuple[bytes, int]]
    ) -> None:
        """Replace a worker's entries with a snapshot taken at ``last_event_id``.

        ``blocks`` are ``(key, tier)`` pairs of every committed block (only this shard's keys are
        kept). Raises KeyError for an unknown worker and ValueError for a malformed key (nothing
        changes then).
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
        data = pack_ops((OP_STORE, k, t) for k, t in mine)
        if incarnation > state.incarnation:
            self.register_worker(worker, state.lane, incarnation)
            state = self._workers[worker]
        self._drop_entries(state)
        self._apply_ops(state, data)
        state.last_event_id = last_event_id
        state.needs_snapshot = False
        state.pending = {f: b for f, b in state.pending.items() if b.last_event_id > last_event_id}
        self._drain_pending(state)
        self.counters["snapshots"] += 1

    # ---- queries -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> tuple[list[Entry | None], list[int]]:
        """Raw entries and predicted masks for ``keys`` (a copy; valid until the next change)."""
        entries = self._table.entries(keys)
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
            if self._compiled_route is not None:  # the whole walk in C; it caps n itself
                return self._compiled_route(keys, self._lane_names, RouteMatch)  # type: ignore[no-any-return]
            n = min(len(keys), MAX_ROUTE_BLOCKS)
            if not n:
                return {}
            get = self._table.entries
            return route_held(get(keys[:FIRST_LOOKUPS]), n, self._lanes, keys, get, self._route_memo)
        entries, predicted = self.lookup(keys)
        return merge_route(entries, predicted, self._lanes)

    def route_rows(self, keys: Sequence[bytes] | bytes) -> bytes:
        """:meth:`route` without predictions, as compact rows (:func:`raykv.index.route.pack_rows`:
        ``(lane, blocks, gpu, host, disk)`` per matched lane, in route order). ``keys`` may be one
        bytes object of 32-byte keys (the compiled table reads it in place)."""
        rows = getattr(self._table, "route_rows", None)
        if rows is not None:
            return rows(keys)  # type: ignore[no-any-return]
        ks = [keys[i : i + 32] for i in range(0, len(keys), 32)] if isinstance(keys, bytes) else keys
        n = min(len(ks), MAX_ROUTE_BLOCKS)
        entries = self._table.entries
        got = route_held(entries(ks[:FIRST_LOOKUPS]), n, self._lanes, ks, entries) if n else {}
        return pack_rows(got.values(), {w: lane for lane, w in self._lanes.items()})

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
        """Every key this shard lists for ``worker``, by its first :data:`KEY_PREFIX` bytes (all
        the index keeps of a key), with its tier (for checks and tests; scans the table)."""
        blocks = self._table.lane_blocks(self._workers[worker].lane)
        return {k: TierKind(t) for k, t in blocks.items()}


def _lane_bit(lane: int) -> int:
    return 1 << (LANE_BITS * lane)


__all__ = [
    "KEY_PREFIX",
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

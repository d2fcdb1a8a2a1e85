"""Cache events: what changed in a manager's set of committed blocks.

Each event carries a monotonic ``event_id`` (per manager, starting at 1, never reused). The queue is
bounded: when it is full the oldest events are dropped, and a consumer sees the gap in ids (the
cluster index then asks for a snapshot). Events are frozen, pickle, and compare by value.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from raykv.core.types import BlockKey, TierKind


@dataclass(frozen=True)
class BlockStored:
    """A block became committed and matchable on ``tier``. ``parent_key`` is the previous block's
    key (the scope's root key for block 0); ``request_id`` is the committing request, if any."""

    event_id: int
    key: BlockKey
    parent_key: BlockKey
    tier: TierKind
    num_tokens: int
    request_id: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """A block is no longer cached anywhere on this manager (dropped from ``tier``)."""

    event_id: int
    key: BlockKey
    tier: TierKind


@dataclass(frozen=True)
class BlockTierChanged:
    """A committed block moved between tiers (demotion or promotion)."""

    event_id: int
    key: BlockKey
    old_tier: TierKind
    new_tier: TierKind


@dataclass(frozen=True)
class AllCleared:
    """Every committed block was removed (clear_reusable or shutdown)."""

    event_id: int


CacheEvent = Union[BlockStored, BlockRemoved, BlockTierChanged, AllCleared]  # noqa: UP007


class _Batch:
    """Events of one call queued raw (ids ``first_id + start`` up to ``first_id + end``, not yet
    drained or dropped): built only when drained, off the path of the change they report, and
    one queue item (no object per event) meanwhile. The sequences it holds are never changed."""

    __slots__ = ("end", "first_id", "start")

    def __init__(self, first_id: int, count: int) -> None:
        self.first_id, self.start, self.end = first_id, 0, count

    def build(self, a: int, b: int) -> list[CacheEvent]:
        raise NotImplementedError


class _Rows(_Batch):
    """``make(id, *row)`` for each row."""

    __slots__ = ("make", "rows")

    def __init__(self, make: type, first_id: int, rows: Sequence[tuple[object, ...]]) -> None:
        super().__init__(first_id, len(rows))
        self.make, self.rows = make, rows

    def build(self, a: int, b: int) -> list[CacheEvent]:
        make, rows, first = self.make, self.rows, self.first_id
        return [make(first + i, *rows[i]) for i in range(a, b)]


class _Chain(_Batch):
    """BlockStored of each block of an imported chain, as columns (no request id)."""

    __slots__ = ("keys", "parents", "tier", "tokens")

    def __init__(self, first_id: int, keys: tuple, parents: tuple, tier: TierKind, tokens: tuple) -> None:  # type: ignore[type-arg]
        super().__init__(first_id, len(keys))
        self.keys, self.parents, self.tier, self.tokens = keys, parents, tier, tokens

    def build(self, a: int, b: int) -> list[CacheEvent]:
        keys, parents, tier, tokens, first = self.keys, self.parents, self.tier, self.tokens, self.first_id
        return [BlockStored(first + i, keys[i], parents[i], tier, tokens[i], None) for i in range(a, b)]


class EventQueue:
    """Bounded FIFO of events with monotonic ids. Thread-safe.

    ``emit_*`` methods assign the next id; ``drain`` removes and returns queued events in order.
    ``dropped`` counts events lost to the bound. :meth:`stored_many` (imports, commits) and
    :meth:`stored_chain` queue their events raw, as one item per call, when there are no
    listeners; they become objects only when drained, off the path of the change they report.
    """

    def __init__(self, max_events: int) -> None:
        self._queue: collections.deque[CacheEvent | _Batch] = collections.deque()
        self._size = 0  # events queued (a batch counts its events not yet drained or dropped)
        self._max = max_events
        self._next_id = 1
        self._lock = threading.Lock()
        self.dropped = 0
        self.listeners: list[Callable[[CacheEvent], None]] = []
        """Called with each event as it is emitted (by the emitting thread, under the manager's
        lock, after the change it reports); they must be quick and must not raise."""

    @property
    def last_event_id(self) -> int:
        """Id of the most recently emitted event (0 before any)."""
        return self._next_id - 1

    def __len__(self) -> int:
        return self._size

    def _push(self, make: type, *fields: object) -> CacheEvent:
        event: CacheEvent = self._push_many(make, [fields], built=True)[0]
        return event

    def _push_many(self, make: type, rows: Sequence[tuple[object, ...]], built: bool = False) -> list[Any]:
        """Queue one ``make`` event per row of fields, with consecutive ids. The events are built
        (and returned) when ``built`` or when listeners must see them; else queued raw as one
        batch (and [] is returned)."""
        if not rows:
            return []
        listeners = self.listeners
        made: list[Any] = []
        with self._lock:
            first = self._next_id
            self._next_id = first + len(rows)
            if built or listeners:
                made = [make(first + i, *row) for i, row in enumerate(rows)]
                self._queue.extend(made)
            else:
                self._queue.append(_Rows(make, first, rows))
            self._size += len(rows)
            self._trim()
        for listener in listeners:
            for event in made:
                listener(event)
        return made

    def _trim(self) -> None:
        """Drop the oldest events over the bound (under the lock)."""
        over = self._size - self._max
        if over > 0:
            self._pop_oldest(over)
            self.dropped += over

    def _pop_oldest(self, count: int) -> list[CacheEvent | tuple[_Batch, int, int]]:
        """Remove the ``count`` oldest events (at most all; under the lock): whole events, and
        ``(batch, a, b)`` for events ``a .. b`` of a batch (the rest of it stays queued)."""
        taken: list[CacheEvent | tuple[_Batch, int, int]] = []
        queue = self._queue
        while count > 0 and queue:
            item = queue[0]
            if isinstance(item, _Batch):
                part = min(count, item.end - item.start)
                taken.append((item, item.start, item.start + part))
                item.start += part
                if item.start == item.end:
                    queue.popleft()
            else:
                part = 1
                queue.popleft()
                taken.append(item)
            count -= part
            self._size -= part
        return taken

    def stored(
        self, key: BlockKey, parent: BlockKey, tier: TierKind, num_tokens: int, request_id: int | None
    ) -> CacheEvent:
        return self._push(BlockStored, key, parent, tier, num_tokens, request_id)

    def stored_many(self, blocks: Sequence[tuple[BlockKey, BlockKey, TierKind, int, int | None]]) -> None:
        """:meth:`stored` for each ``(key, parent, tier, num_tokens, request_id)``, in order, under
        one acquisition of the queue's lock (ids stay consecutive). ``blocks`` is kept as given
        until drained: the caller must not change it."""
        self._push_many(BlockStored, blocks)

    def stored_chain(
        self, keys: Sequence[BlockKey], parents: Sequence[BlockKey], tier: TierKind, tokens: Sequence[int]
    ) -> None:
        """:meth:`stored_many` of ``zip(keys, parents, tier, tokens)`` with no request id (an
        imported chain): without listeners one queue item holds copies of the three columns."""
        if self.listeners or not keys:
            self.stored_many([(k, p, tier, t, None) for k, p, t in zip(keys, parents, tokens)])
            return
        batch = _Chain(0, tuple(keys), tuple(parents), tier, tuple(tokens))  # copied outside the lock
        with self._lock:
            batch.first_id = self._next_id
            self._next_id += batch.end
            self._queue.append(batch)
            self._size += batch.end
            self._trim()

    def removed(self, key: BlockKey, tier: TierKind) -> CacheEvent:
        return self._push(BlockRemoved, key, tier)

    def tier_changed(self, key: BlockKey, old: TierKind, new: TierKind) -> CacheEvent:
        return self._push(BlockTierChanged, key, old, new)

    def cleared(self) -> CacheEvent:
        return self._push(AllCleared)

    def drain(self, max_events: int | None = None) -> list[CacheEvent]:
        """Remove and return up to ``max_events`` (all when None) of the oldest queued events."""
        with self._lock:
            taken = self._pop_oldest(self._size if max_events is None else max_events)
        out: list[CacheEvent] = []
        for got in taken:
            if isinstance(got, tuple):
                out.extend(got[0].build(got[1], got[2]))
            else:
                out.append(got)
        return out

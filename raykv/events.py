"""Cache events: what changed in a manager's set of committed blocks.

Each event carries a monotonic ``event_id`` (per manager, starting at 1, never reused). The queue is
bounded: when it is full the oldest events are dropped, and a consumer sees the gap in ids (the
cluster index then asks for a snapshot). Events are frozen, pickle, and compare by value.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from raykv.types import BlockKey, TierKind


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


_Raw = tuple[type, int, tuple[object, ...]]  # (event class, id, other fields): built on drain


class EventQueue:
    """Bounded FIFO of events with monotonic ids. Thread-safe.

    ``emit_*`` methods assign the next id; ``drain`` removes and returns queued events in order.
    ``dropped`` counts events lost to the bound. :meth:`stored_many` (imports, commits) queues
    its events as raw fields when there are no listeners; they become objects only when drained,
    off the path of the change they report.
    """

    def __init__(self, max_events: int) -> None:
        self._queue: collections.deque[CacheEvent | _Raw] = collections.deque()
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
        return len(self._queue)

    def _push(self, make: type, *fields: object) -> CacheEvent:
        event: CacheEvent = self._push_many(make, [fields], built=True)[0]
        return event

    def _push_many(self, make: type, rows: Sequence[tuple[object, ...]], built: bool = False) -> list[Any]:
        """Queue one ``make`` event per row of fields, with consecutive ids. The events are built
        (and returned) when ``built`` or when listeners must see them; else queued raw (and []
        is returned)."""
        if not rows:
            return []
        listeners = self.listeners
        made: list[Any] = []
        with self._lock:
            first = self._next_id
            self._next_id = first + len(rows)
            if built or listeners:
                made = [make(first + i, *row) for i, row in enumerate(rows)]
                items: list[Any] = made
            else:  # (class, id, fields): one tuple per event, built at C speed
                items = list(zip(itertools.repeat(make), itertools.count(first), rows))
            queue = self._queue
            overflow = len(queue) + len(items) - self._max
            if overflow > 0:
                self.dropped += overflow
                for _ in range(min(overflow, len(queue))):
                    queue.popleft()
                if len(items) > self._max:
                    items = items[len(items) - self._max :]
            queue.extend(items)
        for listener in listeners:
            for event in made:
                listener(event)
        return made

    def stored(
        self, key: BlockKey, parent: BlockKey, tier: TierKind, num_tokens: int, request_id: int | None
    ) -> CacheEvent:
        return self._push(BlockStored, key, parent, tier, num_tokens, request_id)

    def stored_many(self, blocks: Sequence[tuple[BlockKey, BlockKey, TierKind, int, int | None]]) -> None:
        """:meth:`stored` for each ``(key, parent, tier, num_tokens, request_id)``, in order, under
        one acquisition of the queue's lock (ids stay consecutive)."""
        self._push_many(BlockStored, blocks)

    def removed(self, key: BlockKey, tier: TierKind) -> CacheEvent:
        return self._push(BlockRemoved, key, tier)

    def tier_changed(self, key: BlockKey, old: TierKind, new: TierKind) -> CacheEvent:
        return self._push(BlockTierChanged, key, old, new)

    def cleared(self) -> CacheEvent:
        return self._push(AllCleared)

    def drain(self, max_events: int | None = None) -> list[CacheEvent]:
        """Remove and return up to ``max_events`` (all when None) of the oldest queued events."""
        with self._lock:
            n = len(self._queue) if max_events is None else min(max_events, len(self._queue))
            items = [self._queue.popleft() for _ in range(n)]
        return [item[0](item[1], *item[2]) if type(item) is tuple else item for item in items]  # type: ignore[misc]

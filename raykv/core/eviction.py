"""Eviction policies: which unpinned page of a tier goes first.

A policy tracks the evictable (unpinned) pages of every tier level and yields candidates in
eviction order. It never moves or drops anything itself; the manager's planner decides what each
candidate can do (demote to the next tier, or drop when it is a droppable leaf).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Protocol

from raykv.core import page as page_module
from raykv.core.page import Page


class EvictionPolicy(Protocol):
    """What the manager needs from a policy. ``add`` queues a page at its current level as the
    most recently used; ``remove`` unqueues it; ``candidates`` yields queued pages of one level,
    first victim first, and must not be resumed after the policy changes."""

    def add(self, page: Page) -> None: ...

    def add_many(self, pages: list[Page]) -> None:
        """``add`` each page in order (a policy may do it in one step)."""
        ...

    def remove(self, page: Page) -> None: ...

    def touch(self, page: Page) -> None: ...

    def cool(self, page: Page) -> None: ...

    def candidates(self, level: int) -> Iterator[Page]: ...

    def count(self, level: int) -> int: ...


class PriorityLRU:
    """Lowest priority first (0..100), then least recently used within a priority."""

    def __init__(self, num_levels: int) -> None:
        self._levels: list[dict[int, collections.OrderedDict[int, Page]]] = [{} for _ in range(num_levels)]
        self._counts = [0] * num_levels

    def add(self, page: Page) -> None:
        if page.queued:
            raise ValueError(f"{page!r} is already queued")
        self._queue(page.level, page.priority)[page.uid] = page
        page.queued = True
        self._counts[page.level] += 1

    def _queue(self, level: int, priority: int) -> collections.OrderedDict[int, Page]:
        """The queue of ``priority`` at ``level`` (made empty when there is none)."""
        queues = self._levels[level]
        queue = queues.get(priority)
        if queue is None:
            queue = queues[priority] = collections.OrderedDict()
        return queue

    def add_many(self, pages: list[Page]) -> None:
        """:meth:`add` each page in order; pages of one level and priority (an imported chain)
        go into their queue in one step (one C call with the compiled ``raykv.native._chain``).
        ValueError, with nothing queued, if one is queued."""
        if not pages:
            return
        level, priority = pages[0].level, pages[0].priority
        fast = page_module.compiled_chain
        if fast is not None and type(pages) is list:
            queue = self._queue(level, priority)
            if fast.queue_chain(queue, pages, level, priority):
                self._counts[level] += len(pages)
                return
            if not queue:  # made for nothing: the general path below decides
                del self._levels[level][priority]
        queued = next((p for p in pages if p.queued), None)
        if queued is not None:
            raise ValueError(f"{queued!r} is already queued")
        if any(p.level != level or p.priority != priority for p in pages):
            for page in pages:
                self.add(page)
            return
        self._queue(level, priority).update((p.uid, p) for p in pages)
        for page in pages:
            page.queued = True
        self._counts[level] += len(pages)

    def remove(self, page: Page) -> None:
        queues = self._levels[page.level]
        queue = queues[page.priority]
        del queue[page.uid]
        if not queue:
            del queues[page.priority]
        page.queued = False
        self._counts[page.level] -= 1

    def touch(self, page: Page) -> None:
        """Mark a queued page as just used (moves it to the back of its priority's queue)."""
        if page.queued:
            self._levels[page.level][page.priority].move_to_end(page.uid)

    def cool(self, page: Page) -> None:
        """Mark a queued page as the least recently used of its priority (the next victim)."""
        if page.queued:
            self._levels[page.level][page.priority].move_to_end(page.uid, last=False)

    def candidates(self, level: int) -> Iterator[Page]:
        queues = self._levels[level]
        for priority in sorted(queues):
            yield from queues[priority].values()

    def count(self, level: int) -> int:
        return self._counts[level]

    def queued_uids(self, level: int) -> set[int]:
        return {uid for q in self._levels[level].values() for uid in q}

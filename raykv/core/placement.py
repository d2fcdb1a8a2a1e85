"""Room planning: decide, without changing anything, how to free slots on a tier.

To free a slot on level L the planner takes L's eviction candidates in policy order and either
demotes one to level L+1 (after recursively making room there) or, when nothing can be made room
for below, drops it if it is droppable: a committed block with no children left, no holder and no
pin. A planner made with ``prefer_drop`` drops a droppable candidate rather than demote it, which
keeps the slots below for pages that can only move (a request's private pages): the store plans
that way when the first plan fails (:meth:`raykv.core.store.PageStore.plan_room`).

The plan is a list of steps; the manager executes the drops first (children before parents),
then the moves, coldest level first, so every move finds the slot its plan reserved.
If the goal cannot be met, the plan is discarded and nothing has changed: that is how
OutOfPagesError and ``resume() -> False`` leave state untouched.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from raykv.core.eviction import EvictionPolicy
from raykv.core.page import Page


@dataclass
class Step:
    """Move ``page`` from ``src`` to ``dst`` (a level), or drop it when ``dst`` is None."""

    page: Page
    src: int
    dst: int | None


class RoomPlanner:
    """Plans evictions over ``free`` slot counts per level; never mutates the cache.
    ``prefer_drop``: drop droppable candidates instead of demoting them (see the module docstring)."""

    def __init__(
        self, free: list[int], policy: EvictionPolicy, exclude: set[int], prefer_drop: bool = False
    ) -> None:
        self.prefer_drop = prefer_drop
        self.free = list(free)
        self.policy = policy
        self.exclude = exclude
        self.levels = len(free)
        self.steps: dict[int, Step] = {}
        self._dropped_children: dict[int, int] = {}
        self._arrivals: list[list[Page]] = [[] for _ in free]
        self._iters: list[Iterator[Page] | None] = [None] * self.levels
        self._stuck = [False] * self.levels
        self._skip_order = itertools.count()
        # page uid -> (order in which the walk passed it, level it was passed at, page)
        self._skipped: dict[int, tuple[int, int, Page]] = {}
        self._revived: list[list[tuple[int, int, Page]]] = [[] for _ in free]

    def make_room(self, level: int, count: int) -> bool:
        """Plan until ``count`` slots are free on ``level``. False if impossible."""
        while self.free[level] < count:
            if self._stuck[level] or not self._evict_one(level):
                self._stuck[level] = True
                return False
        return True

    def take(self, level: int, count: int) -> None:
        """Reserve ``count`` planned-free slots on ``level`` (for the caller's own pages)."""
        assert self.free[level] >= count
        self.free[level] -= count

    def _walk(self, level: int) -> Iterator[Page]:
        yield from self.policy.candidates(level)
        arrivals = self._arrivals[level]
        i = 0
        while i < len(arrivals):  # pages moved here earlier in this plan (the list may grow)
            yield arrivals[i]
            i += 1

    def _next_candidate(self, level: int) -> Page | None:
        """Next page in policy order. A page the walk passed over because it still had children
        comes back (before anything not yet walked) once its last child is planned to drop."""
        revived = self._revived[level]
        if revived:
            return heapq.heappop(revived)[2]
        it = self._iters[level]
        if it is None:
            it = self._iters[level] = self._walk(level)
        return next(it, None)

    def _evict_one(self, level: int) -> bool:
        while (page := self._next_candidate(level)) is not None:
            if page.uid in self.exclude or page.pins or page.leases:
                continue
            step = self.steps.get(page.uid)
            if step is not None and (step.dst != level):
                continue  # already moved away or dropped in this plan
            if self.prefer_drop and self._droppable(page):
                self._plan(page, level, None)
                return True
            if level + 1 < self.levels and self.make_room(level + 1, 1):
                self._plan(page, level, level + 1)
                return True
            if self._droppable(page):
                self._plan(page, level, None)
                return True
            self._skipped[page.uid] = (next(self._skip_order), level, page)
        return False

    def _droppable(self, page: Page) -> bool:
        block = page.block
        if block is None or page.holders or page.pins or page.leases:
            return False
        return len(block.children) - self._dropped_children.get(id(block), 0) == 0

    def _plan(self, page: Page, level: int, dst: int | None) -> None:
        self.free[level] += 1
        previous = self.steps.get(page.uid)
        src = previous.src if previous is not None else level
        if dst is None:
            self.steps[page.uid] = Step(page, src, None)
            assert page.block is not None
            parent = page.block.parent
            self._dropped_children[id(parent)] = self._dropped_children.get(id(parent), 0) + 1
            self._maybe_revive(parent)
        else:
            self.free[dst] -= 1
            self.steps[page.uid] = Step(page, src, dst)
            self._arrivals[dst].append(page)

    def _maybe_revive(self, parent: object) -> None:
        """A passed-over parent page just became a droppable leaf: a level that looked stuck may
        now make room, so every passed-over page is offered again (in the order it was passed),
        ahead of pages not walked yet. Each revival follows a planned drop, so this terminates."""
        page = getattr(parent, "page", None)
        if page is None or page.uid not in self._skipped or not self._droppable(page):
            return
        self._stuck = [False] * self.levels
        skipped, self._skipped = self._skipped, {}
        for uid, (order, level, passed) in skipped.items():
            heapq.heappush(self._revived[level], (order, uid, passed))

    def ordered_steps(self) -> tuple[list[Step], list[Step]]:
        """(drops, moves) in execution order.

        Drops go first, deepest block first (a child before its parent), since a drop needs no
        room. Moves follow, coldest source level first, so each finds its reserved slot free.
        """
        drops = [s for s in self.steps.values() if s.dst is None]
        drops.sort(key=lambda s: -s.page.block.ordinal if s.page.block is not None else 0)
        moves = [s for s in self.steps.values() if s.dst is not None]
        moves.sort(key=lambda s: -s.src)
        return drops, moves

"""Where a cold request's new content goes (pure; a part of :mod:`raykv.routing.adaptive`).

Every worker evicts its own least recently used blocks. A request that finds almost nothing
cached brings many new blocks, and the worker it runs on evicts as many of its own: the cost
model, which sees only loads for such a request, would put it on the least-loaded worker whatever
that worker's eviction victims are worth. One pooled cache would evict its oldest blocks instead.
:class:`ColdPlacement` approximates that: it counts the new blocks routed to each worker
(decayed over ``place_window`` x the deployment's total cache capacity of new blocks, so a
worker's count stands for how recent the content it would evict is) and moves a cold request
from a full worker to the worker that received the fewest, among those within ``place_margin`` x
the request's prefill of the cheapest cost.

A request is *cold* when at most ``cold_blocks`` of its blocks are cached on any worker and it
brings at least ``2 x cold_blocks`` new blocks. A worker is *full* once the new blocks routed to
it since the policy started reach its capacity. Capacities are what the workers report
(:meth:`ColdPlacement.observe_capacity`); with none reported the rule is off. With pulls
(``allow_pulls``) it is off too: a pulled prefix serves any worker, so where content lives
matters less, and the rule measured no better there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.policy import Decision, RoutingConfig

_NEW = tuple.__new__  # builds a NamedTuple from its field values without the generated __new__


class ColdPlacement:
    """New blocks routed to each worker and the placement rule of the module docstring.

    The decayed counts are stored as blocks x ``exp(added / window)`` for the total ``added``
    routed before them (one growing scale for every worker: O(1) per request), renormalised before
    the floats overflow."""

    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.capacity: dict[WorkerId, int] = {}
        self.routed: dict[WorkerId, float] = {}  # new blocks routed to each worker (not decayed)
        self.recent: dict[WorkerId, float] = {}  # the same, decayed (scaled by _scale)
        self._scale = 1.0
        self._per_block = 0.0  # log of the scale's growth per new block (0: no capacity yet)
        self.moved = 0  # requests this rule placed away from the cheapest worker
        self._enabled = cfg.place_margin > 0 and not cfg.allow_pulls  # can it ever move one?
        self.active = False
        """Can the rule move a request (capacities reported, a margin, no pulls)? Callers may
        skip :meth:`place` while it is False, or for a decision with more than ``cold_blocks``
        cached blocks (it would return the decision unchanged)."""

    def observe_capacity(self, worker: WorkerId, blocks: int) -> None:
        """``worker`` holds at most ``blocks`` blocks (its report; a later one replaces it).
        InvalidArgumentError for a negative ``blocks``."""
        if blocks < 0:
            raise InvalidArgumentError("blocks", f"capacity must be >= 0, got {blocks}")
        self.capacity[worker] = blocks
        window = self.cfg.place_window * sum(self.capacity.values())
        self._per_block = 1.0 / window if window > 0 else 0.0
        self.active = self._enabled and bool(self._per_block)

    def stored(self, worker: WorkerId, blocks: float) -> None:
        """``blocks`` new blocks were routed to ``worker`` (recomputed or pulled there). Nothing
        is kept when the rule can never move a request (with pulls, or a ``place_margin`` of 0)."""
        if blocks <= 0 or not self._enabled:
            return
        self.routed[worker] = self.routed.get(worker, 0.0) + blocks
        if not self._per_block:
            return
        self._scale *= math.exp(blocks * self._per_block)
        if self._scale > 1e200:
            self.recent = {w: v / self._scale for w, v in self.recent.items()}
            self._scale = 1.0
        self.recent[worker] = self.recent.get(worker, 0.0) + blocks * self._scale

    def place(self, num_tokens: int, d: Decision, matches: Mapping[WorkerId, RouteMatch]) -> Decision:
        """``d``, or the same request moved by the rule (module docstring; decisions without
        pulls only: with pulls every worker's blocks serve every other): the chosen worker then
        holds ``cached_blocks`` of the prefix and no duplicate is reported (the move is a
        placement, not a choice the duplicate price should learn from). Changes nothing but
        :attr:`moved`."""
        cfg = self.cfg
        cold = cfg.cold_blocks
        if (
            not self.active
            or d.cached_blocks > cold
            or num_tokens < cfg.tokens_per_block * (d.cached_blocks + 2 * cold)
            or self.routed.get(d.worker, 0.0) < self.capacity.get(d.worker, math.inf)
        ):
            return d
        best = 0
        for m in matches.values():
            if m[1] > best:
                best = m[1]
        if best > cold or num_tokens < cfg.tokens_per_block * (best + 2 * cold):
            return d
        limit = d.cost + cfg.place_margin * cfg.prefill_cost * num_tokens
        get = self.recent.get
        pick, low, pick_cost = d.worker, get(d.worker, 0.0), d.cost
        for worker, cost in d.costs:
            if cost <= limit:
                count = get(worker, 0.0)
                if count < low:
                    pick, low, pick_cost = worker, count, cost
        if pick == d.worker:
            return d
        self.moved += 1
        held = matches.get(pick)
        own = held[1] if held is not None else 0
        return _NEW(Decision, (pick, pick_cost, own, None, 0, d.costs, 0))

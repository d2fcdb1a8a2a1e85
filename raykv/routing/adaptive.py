"""The one routing policy: the cost model of :mod:`raykv.routing.policy` with prices learned online.

:class:`RoutingPolicy` wraps :func:`~raykv.routing.policy.choose_loads` and keeps three prices
up to date from what the deployment shows it, instead of per-trace constants:

- ``duplicate``: what a recomputed token costs *beyond* its prefill time when another worker
  already holds it (the duplicate copy it leaves takes cache space, and the session's later
  turns hit only on one of the copies). It is the multiplier of a constraint: recompute at most
  ``recompute_budget`` of the prompt tokens that some worker holds. After each decision the price
  moves by ``exp(price_step * (share - budget) / budget)`` (bounded by ``price_max``), where
  ``share`` is the part of this prompt the chosen worker recomputes although another worker
  holds it. When load forces many duplicates, the price rises until few remain worth it; when
  queues are short, it falls until the cheaper-to-queue choice wins again (dual ascent).
- ``pull``: a pulled token's time as a fraction of its prefill time, from observed pulls and
  prefills (exponential averages of seconds per token; before any observation ``1 - w_remote``).
  With pulls enabled, a block another worker holds costs its pull, so a burst on a hot prefix
  spreads to the workers that load picks, each pulling the prefix, and no duplicate is priced.
- the load guard's ``slack``: ``guard_requests`` mean requests of work (an exponential average
  of what each routed request adds to its worker: the tokens it recomputes plus its expected
  decode work), at least ``imbalance_slack`` tokens (no guard before the first decision).

- the balance: each worker's share of the work routed over about the last ``balance_window``
  decisions (exponentially decayed, :class:`WorkShares`); a worker whose share exceeds
  ``balance_limit`` x the mean share is left out of the decision (from the
  ``balance_window / 10``-th decision on, when the shares mean something), so sessions that stay
  with their prefix cannot leave a worker idle or overloaded for long. The one exception is the
  holder of the request's longest cached prefix: it stays, its work beyond the limit added to its
  load as if still queued, so it keeps the request only while recomputing the prefix elsewhere
  costs more than that excess (which grows with every request it keeps). A duplicate that only
  this charge caused is reported as forced (``Decision.duplicated`` 0), like one the load guard
  forces, and does not raise the duplicate price.

- the recent work (only without pulls, which spread a burst by pulling): each worker's work routed
  over about the last ``recent_window_s`` seconds (exponentially decayed to the time of each
  decision, :class:`RecentWork`; the policy's clock, ``time.monotonic`` in a deployment, the
  simulated clock in the replay). Requests that
  share a prefix come in bursts (a tool-call fan-out) and sessions return within seconds, so work
  just routed to a worker predicts work about to follow it there, and a request routed to it now
  delays those followers (a FIFO worker serves it first). A decision charges each worker
  ``recent_weight`` x its recent work on top of its reported load: a burst piled onto its prefix
  holder spreads to a second copy once the recent pile outweighs the recompute, and a new session
  starts where no session is active. The load guard still judges the reported loads only (neither
  this charge nor the balance rule's excess makes a worker fail the guard).

- the placement of cold requests (:class:`~raykv.routing.placement.ColdPlacement`): a request
  that finds almost nothing cached and would fill a full worker goes, among the workers within
  ``place_margin`` x its prefill of the cheapest, to the one that was sent the fewest new blocks
  lately, whose least recently used blocks are the oldest (as one pooled cache would evict). The
  workers' capacities come from their reports (:meth:`RoutingPolicy.observe_capacity`).

A *hot* prefix (``hot(worker, blocks)``: the winner's prefix was brought by a request still in
flight on it) is a burst: a second copy then serves concurrent requests instead of going stale, so
the decision is re-made with ``hot_price`` as the duplicate price. Not thread-safe; one policy per
router.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.placement import ColdPlacement
from raykv.routing.policy import (
    DEFAULT_ROUTING,
    Charges,
    Decision,
    Prices,
    RoutingConfig,
    best_held,
    decide_at,
)

HotPrefix = Callable[[WorkerId, int], bool]
"""``hot(worker, blocks)``: is ``worker``'s cached prefix of ``blocks`` blocks in use by a request
still in flight on it?"""

_EWMA = 0.02  # weight of one observation in the running averages (about the last 50)
_NONE: dict[WorkerId, float] = {}  # no recent work (decisions with pulls): read, never written
_NEW = tuple.__new__  # builds a NamedTuple from its field values without the generated __new__


class WorkShares:
    """Work routed to each worker, decayed by ``1 - 1/window`` per decision (lazily: the newest
    work is scaled up instead of every total scaled down)."""

    def __init__(self, window: int) -> None:
        self._grow = 1.0 / (1.0 - 1.0 / window) if window > 1 else 1e6
        self._scale = 1.0
        self.totals: dict[WorkerId, float] = {}

    def add(self, worker: WorkerId, work: float) -> None:
        """``worker`` was given ``work`` token-equivalents now."""
        self._scale *= self._grow
        if self._scale > 1e200:  # renormalise before the floats overflow
            self.totals = {w: t / self._scale for w, t in self.totals.items()}
            self._scale = 1.0
        self.totals[worker] = self.totals.get(worker, 0.0) + work * self._scale

    def excess(self, workers: Sequence[WorkerId], limit: float) -> dict[WorkerId, float]:
        """The workers of ``workers`` whose share is above ``limit`` x the mean share, each with
        the decayed work (token-equivalents) it was given beyond that limit."""
        get = self.totals.get
        shares = [get(w, 0.0) for w in workers]
        cap = limit * sum(shares) / len(shares)
        scale = self._scale
        return {w: (x - cap) / scale for w, x in zip(workers, shares) if x > cap}


class RecentWork:
    """Work routed to each worker, decayed by ``exp(-dt / window_s)`` over ``dt`` seconds.

    Stored as work x ``exp((t - base) / window_s)`` for the time ``t`` it was added, so moving
    the clock is O(1) whatever the number of workers: every total shares one decay factor. The
    stored values are rebased (multiplied down) when the clock has moved 20 windows past
    ``base``, which bounds them. A window of 0 keeps nothing."""

    _REBASE = 20.0  # windows after which the stored values are rebased

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.at = -math.inf  # the clock: time of the last advance (none yet)
        self._base = 0.0  # the stored values are exact totals at this time
        self._grow = 1.0  # exp((at - base) / window_s): what work added now is stored as
        self.stored: dict[WorkerId, float] = {}
        """Each worker's work x ``exp((t - base) / window_s)`` (read it, don't change it):
        times :meth:`factor`, its total now."""

    def advance(self, now: float) -> None:
        """Move the clock to ``now`` (a time before the last one counts as the last one)."""
        if now <= self.at:
            return
        if self.at == -math.inf:
            self._base = now
        self.at = now
        w = self.window_s
        if w <= 0:
            return
        if now - self._base > self._REBASE * w:
            keep = math.exp(-(now - self._base) / w)
            self.stored = {k: v * keep for k, v in self.stored.items() if v * keep > 1e-6}
            self._base = now
        self._grow = math.exp((now - self._base) / w)

    def add(self, worker: WorkerId, work: float) -> None:
        """``worker`` was given ``work`` token-equivalents at the clock's time (nothing before
        the first :meth:`advance`)."""
        if self.window_s > 0 and self.at > -math.inf:
            self.stored[worker] = self.stored.get(worker, 0.0) + work * self._grow

    def factor(self) -> float:
        """What a stored value is multiplied by to give its total at the clock's time."""
        return 1.0 / self._grow

    def totals(self) -> dict[WorkerId, float]:
        """Each worker's decayed work at the clock's time (workers with none omitted)."""
        f = self.factor()
        return {k: v * f for k, v in self.stored.items() if v * f > 1e-6}


class RoutingPolicy:
    """Cache-aware routing with online prices (module docstring). ``cfg`` defaults to
    :data:`~raykv.routing.policy.DEFAULT_ROUTING`; ``clock`` (seconds) times the decisions a
    caller does not pass ``now`` to, and defaults to ``time.monotonic``."""

    def __init__(
        self, cfg: RoutingConfig = DEFAULT_ROUTING, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self.duplicate_price = cfg.price_start
        self._work = 0.0  # running mean work a routed request adds (token-equivalents)
        self._pull_s = 0.0  # running mean seconds per pulled token (0: none observed)
        self._prefill_s = 0.0  # running mean seconds per prefilled token
        self._down = math.exp(-cfg.price_step)
        self.decisions = 0
        self.shares = WorkShares(cfg.balance_window)
        self._warm = cfg.balance_window // 10  # decisions before the shares are trusted
        self._excess: dict[WorkerId, float] = {}  # past their share: work beyond it (by learn)
        self._workers: Sequence[WorkerId] = ()
        self.recent = RecentWork(cfg.recent_window_s)
        self.placement = ColdPlacement(cfg)
        self._prices = self._current()

    @property
    def pull_price(self) -> float:
        """Seconds per pulled token / seconds per prefilled token (``1 - w_remote`` until both
        were observed)."""
        if self._pull_s > 0 and self._prefill_s > 0:
            return min(1.0, self._pull_s / self._prefill_s)
        return 1.0 - self.cfg.w_remote

    def prices(self) -> Prices:
        """The prices the next decision uses."""
        return self._prices

    def _current(self) -> Prices:
        if not self.decisions:  # no request seen yet: no scale for the guard
            return Prices(self.duplicate_price, self.pull_price, math.inf)
        slack = max(self.cfg.imbalance_slack, self.cfg.guard_requests * self._work)
        return Prices(self.duplicate_price, self.pull_price, slack)

    def decide(
        self,
        num_tokens: int,
        workers: Sequence[WorkerId],
        loads: Sequence[float],
        matches: Mapping[WorkerId, RouteMatch],
        rng: random.Random | None = None,
        hot: HotPrefix | None = None,
        decode_work: float | None = None,
        learn: bool = True,
        now: float | None = None,
    ) -> Decision:
        """The lowest-cost worker (:func:`~raykv.routing.policy.choose_loads` at the current
        prices, leaving out workers past their share of the work, except the prefix holder, which
        is charged its excess; each cost plus ``recent_weight`` x the worker's recent work; both
        charges added after the load guard judged ``loads`` as given
        (:class:`~raykv.routing.policy.Charges`); a hot winner re-decided at ``hot_price``), then
        a cold request placed by :class:`~raykv.routing.placement.ColdPlacement`, then
        (``learn``) :meth:`learn` from it; a router that learns after dispatching passes
        ``learn=False`` and calls :meth:`learn` itself. ``decode_work``: a request's expected
        decode work in token-equivalents (default ``decode_weight``). ``now``: the time of the
        request in seconds, to which the recent work decays (None: the policy's clock; a replay
        passes its simulated clock). With ``allow_pulls`` there is no recent-work charge. Raises
        InvalidArgumentError when there is no candidate."""
        if not workers:
            raise InvalidArgumentError("candidates", "no candidate workers")
        cfg, prices = self.cfg, self._prices
        self._workers = workers
        holder, excess = None, 0.0  # the holder past its share that stays, charged its excess
        if self._excess:
            loads, holder, excess = self._balanced(workers, loads, matches)
        charges: Charges | None = None
        if not cfg.allow_pulls:  # the guard judges the loads, then the charges add up
            recent = self.recent
            recent.advance(self._clock() if now is None else now)
            charges = _NEW(Charges, (recent.stored, cfg.recent_weight * recent.factor(), holder, excess))
        elif holder is not None:
            charges = _NEW(Charges, (_NONE, 0.0, holder, excess))
        d = decide_at(num_tokens, workers, loads, matches, cfg, prices, rng, charges)
        if hot is not None and d.cached_blocks > 0 and not cfg.allow_pulls and hot(d.worker, d.cached_blocks):
            hot_prices = Prices(cfg.hot_price, prices.pull, prices.slack)
            d = decide_at(num_tokens, workers, loads, matches, cfg, hot_prices, rng, charges)
        if holder is not None and d.duplicated and d.worker != holder:
            d = self._forced(d, holder)
        placement = self.placement
        if placement.active and d.cached_blocks <= cfg.cold_blocks:  # else place() keeps d
            d = placement.place(num_tokens, d, matches)
        if learn:
            self.learn(num_tokens, d, cfg.decode_weight if decode_work is None else decode_work)
        return d

    def _balanced(
        self,
        workers: Sequence[WorkerId],
        loads: Sequence[float],
        matches: Mapping[WorkerId, RouteMatch],
    ) -> tuple[Sequence[float], WorkerId | None, float]:
        """``loads`` with the balance rule applied, the holder it charges (or None) and the
        charge: a worker past its share is left out (an infinite load), except the holder of the
        request's longest cached prefix (the first worker in ``matches`` with the most blocks, the
        cost model's best holder), which stays, charged its excess work
        (:meth:`WorkShares.excess`) after the load guard. ``loads`` unchanged (and None, 0) when
        that would leave no candidate."""
        excess = self._excess
        holder = None
        for worker in excess:
            if worker in matches:  # a worker past its share holds some of the prefix
                holder = best_held(matches)[0]
                break
        if holder not in excess:
            holder = None
        kept = list(loads)
        for worker in excess:  # one or two workers, not all of them
            if worker == holder:
                continue
            try:
                kept[workers.index(worker)] = math.inf
            except ValueError:  # not a candidate now
                continue
        if min(kept) == math.inf:
            return loads, None, 0.0
        return kept, holder, excess[holder] if holder is not None else 0.0

    def _forced(self, d: Decision, holder: WorkerId) -> Decision:
        """``d`` with no chosen duplicate when ``holder`` lost only by its excess-work charge
        (without it, its cost would not exceed the winner's): the balance rule forced the
        duplicate, as the load guard forces one, so it does not raise the duplicate price."""
        for worker, cost in d.costs:
            if worker == holder:
                if cost - self._excess[holder] <= d.cost + 1e-9:
                    return Decision(d.worker, d.cost, d.cached_blocks, d.pull_from, d.pull_blocks, d.costs, 0)
                break
        return d

    def learn(self, num_tokens: int, d: Decision, decode_work: float = 0.0) -> None:
        """After decision ``d`` (for a prompt of ``num_tokens``): update the duplicate price, the
        mean work per request, the work shares, the workers past their share, the new blocks sent
        to the chosen worker and (without pulls) its recent work, at the time of the last
        decision."""
        cfg = self.cfg
        tpb = cfg.tokens_per_block
        self.placement.stored(d.worker, num_tokens / tpb - d.cached_blocks)
        work = max(0, num_tokens - tpb * (d.cached_blocks + d.pull_blocks)) + decode_work
        self._work = work if not self.decisions else self._work + _EWMA * (work - self._work)
        self.shares.add(d.worker, work)
        self.recent.add(d.worker, work)  # kept without pulls only (no clock ever advanced)
        self.decisions += 1
        if self.decisions >= self._warm and self._workers:
            self._excess = self.shares.excess(self._workers, cfg.balance_limit)
        budget = cfg.recompute_budget
        if d.duplicated:
            share = min(1.0, d.duplicated * cfg.tokens_per_block / max(1, num_tokens))
            price = self.duplicate_price * math.exp(cfg.price_step * (share - budget) / budget)
            self.duplicate_price = min(cfg.price_max, price)
        else:
            self.duplicate_price *= self._down
        self._prices = self._current()

    def observe_capacity(self, worker: WorkerId, blocks: int) -> None:
        """``worker`` holds at most ``blocks`` blocks (from its report; the placement of cold
        requests is off until some worker reported). InvalidArgumentError for a negative count."""
        self.placement.observe_capacity(worker, blocks)

    def observe_pull(self, tokens: int, seconds: float) -> None:
        """A pull of ``tokens`` tokens took ``seconds`` (from the worker's report)."""
        if tokens > 0 and seconds > 0:
            rate = seconds / tokens
            self._pull_s = rate if not self._pull_s else self._pull_s + _EWMA * (rate - self._pull_s)
            self._prices = self._current()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds`` (from the worker's report)."""
        if tokens > 0 and seconds > 0:
            rate = seconds / tokens
            self._prefill_s = (
                rate if not self._prefill_s else self._prefill_s + _EWMA * (rate - self._prefill_s)
            )
            self._prices = self._current()

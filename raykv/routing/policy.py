"""Cache-aware routing cost model (pure; the one policy, :mod:`raykv.routing.adaptive`, uses it).

For a request of ``num_tokens`` tokens and each candidate worker, at prices ``p`` (:class:`Prices`):

    credit  = tokens_per_block * (w_gpu * gpu + w_host * host + w_disk * disk + w_pred * predicted)
    other   = blocks some other worker holds beyond this worker's own prefix
    cost    = prefill_cost * (num_tokens - credit - tokens_per_block * other)
              + tokens_per_block * other * (prefill_cost * p.pull          with pulls
                                            prefill_cost + p.duplicate)    without
              + load

``gpu/host/disk/predicted`` come from the index's RouteMatch for that worker. ``load`` is the work
queued ahead of the request on that worker, in token-equivalents as its worker reports them:
queued prefill tokens plus ``decode_weight`` (the expected decode work of one request, in
prefill-token units) per request decoding or waiting to.

Contract: the cost is the request's estimated time to first token on that worker, times the
worker's prefill speed (a FIFO worker first works off its queue, then pulls and prefills what it
does not hold; ``p.pull`` is a pulled token's time as a fraction of its prefill time), plus, for a
block another worker already holds and this one would recompute, ``p.duplicate`` token-equivalents:
the price of the duplicate copy the recompute leaves. The prices are learned online by
:class:`raykv.routing.adaptive.RoutingPolicy`; :func:`static_prices` are its starting values.

A load-imbalance guard drops candidates whose load exceeds ``imbalance_factor`` x the least-loaded
candidate's load plus ``p.slack`` tokens (so a prefix cannot pile everything on one worker).
The lowest cost wins; ties break by a seeded RNG, so a router replays identically.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from raykv import native
from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch


@dataclass(frozen=True)
class RoutingConfig:
    """Weights of the cost model (module docstring; all finite and >= 0, tier weights at most 1);
    the online parts' parameters (:mod:`raykv.routing.adaptive`; ``place_margin``,
    ``place_window`` and ``cold_blocks``: :mod:`raykv.routing.placement`, a ``place_margin`` of 0
    turns that rule off)."""

    tokens_per_block: int = 16
    w_gpu: float = 1.0
    w_host: float = 0.9
    w_disk: float = 0.6
    w_predicted: float = 1.0
    w_remote: float = 0.5
    allow_pulls: bool = False
    prefill_cost: float = 1.0
    decode_weight: float = 64.0
    imbalance_factor: float = 1.0
    imbalance_slack: float = 4096.0
    guard_requests: float = 8.0
    recompute_budget: float = 0.003
    price_start: float = 4.0
    price_step: float = 0.01
    price_max: float = 64.0
    hot_price: float = 2.25
    balance_limit: float = 1.2
    balance_window: int = 3000
    recent_weight: float = 0.5
    recent_window_s: float = 2.0
    place_margin: float = 0.2
    place_window: float = 4.0
    cold_blocks: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise InvalidArgumentError("tokens_per_block", "must be >= 1")
        for name in ("w_gpu", "w_host", "w_disk", "w_predicted", "w_remote"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise InvalidArgumentError(name, f"tier weight must be in [0, 1], got {value!r}")
        for name in (
            "prefill_cost",
            "decode_weight",
            "imbalance_slack",
            "guard_requests",
            "recompute_budget",
            "price_start",
            "price_step",
            "price_max",
            "hot_price",
            "recent_weight",
            "recent_window_s",
            "place_margin",
            "place_window",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(name, f"must be finite and >= 0, got {value!r}")
        if not (isinstance(self.cold_blocks, int) and self.cold_blocks >= 0):
            raise InvalidArgumentError("cold_blocks", f"must be an int >= 0, got {self.cold_blocks!r}")
        if not (math.isfinite(self.imbalance_factor) and self.imbalance_factor >= 1.0):
            raise InvalidArgumentError("imbalance_factor", "must be >= 1")
        if not 0.0 < self.recompute_budget < 1.0:
            raise InvalidArgumentError(
                "recompute_budget", f"must be in (0, 1), got {self.recompute_budget!r}"
            )
        if not self.balance_limit >= 1.0 or self.balance_window < 1:
            raise InvalidArgumentError("balance_limit", "balance_limit must be >= 1, balance_window >= 1")
        if self.price_start > self.price_max:
            raise InvalidArgumentError("price_start", "must be <= price_max")


DEFAULT_ROUTING = RoutingConfig()
"""The one shipped routing configuration: the Serve router, ``RayKVCluster.pick_worker``, the replay,
the demo and the examples all start from this object (deployment facts such as
``tokens_per_block``, the tier weights of a replay worker or ``allow_pulls`` are set with
``dataclasses.replace``; the policy's prices are learned online, :mod:`raykv.routing.adaptive`)."""


@dataclass(frozen=True)
class WorkerLoad:
    """A candidate's outstanding work."""

    worker: WorkerId
    queued_prefill_tokens: int = 0
    running_decodes: int = 0

    def tokens(self, decode_weight: float) -> float:
        return self.queued_prefill_tokens + decode_weight * self.running_decodes


HotPrefix = Callable[[WorkerId, int], bool]
"""``hot(worker, blocks)``: is ``worker``'s cached prefix of ``blocks`` blocks in use by a request
still in flight on it? (see the module docstring)"""


class Decision(NamedTuple):
    """The chosen worker, its cost, the blocks it already holds, any pull it should do, and the
    blocks it will recompute although a worker that passed the load guard holds them
    (``duplicated``: a duplicate chosen, not one the guard forced)."""

    worker: WorkerId
    cost: float
    cached_blocks: int
    pull_from: WorkerId | None
    pull_blocks: int
    costs: tuple[tuple[WorkerId, float], ...]
    duplicated: int = 0


def choose(
    num_tokens: int,
    candidates: Sequence[WorkerLoad],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    rng: random.Random | None = None,
    prices: Prices | None = None,
) -> Decision:
    """Pick the lowest-cost candidate. Raises InvalidArgumentError when there is none."""
    dw = cfg.decode_weight
    return choose_loads(
        num_tokens,
        [c.worker for c in candidates],
        [c.queued_prefill_tokens + dw * c.running_decodes for c in candidates],
        matches,
        cfg,
        rng,
        prices,
    )


class Prices(NamedTuple):
    """What one decision charges (token-equivalents per token; see the module docstring):
    ``duplicate`` per recomputed token another worker holds, ``pull`` per pulled token, and the
    load guard's ``slack``."""

    duplicate: float
    pull: float
    slack: float


class Charges(NamedTuple):
    """What a decision adds to candidates' costs after the load guard judged their loads:
    ``scale`` x ``totals[worker]`` (0 for a worker not in it), plus ``excess`` for ``holder``."""

    totals: Mapping[WorkerId, float]
    scale: float
    holder: WorkerId | None
    excess: float


def static_prices(cfg: RoutingConfig) -> Prices:
    """The prices before anything was observed: ``price_start``, ``1 - w_remote`` and
    ``imbalance_slack`` (what :class:`raykv.routing.adaptive.RoutingPolicy` starts from)."""
    return Prices(cfg.price_start, 1.0 - cfg.w_remote, cfg.imbalance_slack)


def choose_loads(
    num_tokens: int,
    workers: Sequence[WorkerId],
    loads: Sequence[float],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    rng: random.Random | None = None,
    prices: Prices | None = None,
) -> Decision:
    """:func:`choose` with the candidates as parallel lists: ``workers[i]`` has ``loads[i]``
    token-equivalents queued (no per-call objects: the hot path of a router). The lowest cost wins,
    ties (within 1e-9) break by ``rng`` (else by a fresh ``Random(cfg.seed)``), and ``costs`` lists
    every candidate the load guard kept, in order. ``prices`` default to :func:`static_prices`."""
    if not workers:
        raise InvalidArgumentError("candidates", "no candidate workers")
    return decide_at(num_tokens, workers, loads, matches, cfg, prices or static_prices(cfg), rng)


def decide_at(
    num_tokens: int,
    workers: Sequence[WorkerId],
    loads: Sequence[float],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    prices: Prices,
    rng: random.Random | None,
    charges: Charges | None = None,
) -> Decision:
    """:func:`choose_loads` at explicit ``prices``, for callers that checked ``workers`` is not
    empty (a router's hot path; ValueError from ``min`` otherwise), each kept candidate's cost
    plus its ``charges`` (the guard judges ``loads`` alone). With ``raykv.native._cost``
    built (and not switched off when this module was imported) the loop runs in C for lists of
    workers and loads, a dict of matches and a dict of charged totals of floats, with the same
    result, float for float and the same draws from ``rng``; otherwise, and for other argument
    kinds, :func:`decide_at_py`."""
    if _COMPILED is not None:
        weights = _WEIGHTS.get(id(cfg))
        if weights is None or weights[0] is not cfg:
            weights = _weights(cfg)
        d = _COMPILED.decide(
            num_tokens,
            workers,
            loads,
            matches,
            weights[1],
            prices,
            rng or random.Random(cfg.seed),
            Decision,
            charges,
        )
        if d is not None:
            return d  # type: ignore[no-any-return]
    return decide_at_py(num_tokens, workers, loads, matches, cfg, prices, rng, charges)


def _weights(cfg: RoutingConfig) -> tuple[RoutingConfig, tuple[float | int | bool, ...]]:
    """``cfg``'s weights as the compiled loop reads them, remembered by the config's id (the
    entry keeps the config alive, so the id is not reused while it is remembered)."""
    if len(_WEIGHTS) >= 64:
        _WEIGHTS.clear()
    row = (cfg.w_gpu, cfg.w_host, cfg.w_disk, cfg.w_predicted, cfg.tokens_per_block)
    entry = (cfg, (*row, cfg.prefill_cost, cfg.imbalance_factor, cfg.allow_pulls))
    _WEIGHTS[id(cfg)] = entry
    return entry


_COMPILED = native.load("_cost")
_WEIGHTS: dict[int, tuple[RoutingConfig, tuple[float | int | bool, ...]]] = {}


def best_held(matches: Mapping[WorkerId, RouteMatch]) -> tuple[WorkerId | None, int]:
    """The holder of the longest cached prefix in ``matches`` (the first of equals) and its
    block count; (None, 0) when no worker holds any."""
    best_holder, best_blocks = None, 0
    for holder, held in matches.items():
        if held[1] > best_blocks:
            best_holder, best_blocks = holder, held[1]
    return best_holder, best_blocks


def decide_at_py(
    num_tokens: int,
    workers: Sequence[WorkerId],
    loads: Sequence[float],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    prices: Prices,
    rng: random.Random | None,
    charges: Charges | None = None,
) -> Decision:
    """:func:`decide_at` in Python (the definition; the compiled loop must equal it)."""
    floor = min(loads)
    limit = max(floor, cfg.imbalance_factor * floor + prices.slack)  # the floor always stays
    best_holder, best_blocks = best_held(matches)
    wg, wh, wd, wp = cfg.w_gpu, cfg.w_host, cfg.w_disk, cfg.w_predicted
    tpb, pc = cfg.tokens_per_block, cfg.prefill_cost
    # a block another worker holds costs this much more than a cached one: its pull, or its
    # recompute plus the price of the duplicate copy the recompute leaves
    extra = tpb * (pc * prices.pull if cfg.allow_pulls else pc + prices.duplicate)
    left_none = num_tokens - tpb * best_blocks  # a worker holding none of the prefix
    get = matches.get
    costs: list[tuple[WorkerId, float]] = []
    low = math.inf
    kept = False  # did the best holder pass the guard? (else a duplicate is forced, not chosen)
    for worker, load in zip(workers, loads):
        if load > limit:
            continue
        if worker == best_holder:
            kept = True
        m = get(worker)
        if m is None:
            left: float = left_none
            more = best_blocks
        else:
            _, blocks, gpu, host, disk, predicted = m
            left = num_tokens - tpb * (wg * gpu + wh * host + wd * disk + wp * predicted)
            more = best_blocks - blocks if best_blocks > blocks else 0
            left -= tpb * more
        cost = (pc * left if left > 0 else 0.0) + extra * more + load
        if charges is not None:
            charge = charges.scale * charges.totals.get(worker, 0.0)
            if worker == charges.holder:
                charge += charges.excess
            cost += charge
        costs.append((worker, cost))
        if cost < low:
            low = cost
    top = low + 1e-9
    ties = []
    for c in costs:  # a loop, not a comprehension: no function object per call (Python < 3.12)
        if c[1] <= top:
            ties.append(c)
    worker, cost = ties[0] if len(ties) == 1 else (rng or random.Random(cfg.seed)).choice(ties)
    won = get(worker)
    own = won[1] if won is not None else 0
    more = best_blocks - own if best_blocks > own and best_holder != worker else 0
    if cfg.allow_pulls:
        return _NEW(Decision, (worker, cost, own, best_holder if more else None, more, tuple(costs), 0))
    return _NEW(Decision, (worker, cost, own, None, 0, tuple(costs), more if kept else 0))


_NEW = tuple.__new__  # builds a NamedTuple from its field values without the generated __new__

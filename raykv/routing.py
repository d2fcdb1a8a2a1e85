"""Cache-aware routing cost model (pure; Serve routers, the replay and plain callers share it).

For a request of ``num_tokens`` tokens and each candidate worker:

    credit  = tokens_per_block * (w_gpu * gpu + w_host * host + w_disk * disk + w_pred * predicted
                                  + w_remote * pullable)
    cost    = prefill_cost * (num_tokens - credit) + load_cost * load

``gpu/host/disk/predicted`` come from the index's RouteMatch for that worker; ``pullable`` is how
many more leading blocks some other worker holds beyond this worker's own prefix (only when
cross-worker pulls are enabled). ``load`` is the worker's outstanding work in token-equivalents:
queued prefill tokens plus ``decode_weight`` per running decode. A load-imbalance guard drops
candidates whose load exceeds ``imbalance_factor`` x the least-loaded candidate's load plus
``imbalance_slack`` tokens (so a hot prefix cannot pile everything on one worker). The lowest cost
wins; ties break by a seeded RNG, so a router replays identically.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raykv.errors import InvalidArgumentError
from raykv.index import RouteMatch
from raykv.types import WorkerId


@dataclass(frozen=True)
class RoutingConfig:
    """Weights of the cost model (all must be finite and >= 0; tier weights at most 1)."""

    tokens_per_block: int = 16
    w_gpu: float = 1.0
    w_host: float = 0.9
    w_disk: float = 0.6
    w_predicted: float = 1.0
    w_remote: float = 0.5
    allow_pulls: bool = False
    prefill_cost: float = 1.0
    load_cost: float = 1.0
    decode_weight: float = 64.0
    imbalance_factor: float = 2.0
    imbalance_slack: float = 4096.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise InvalidArgumentError("tokens_per_block", "must be >= 1")
        for name in ("w_gpu", "w_host", "w_disk", "w_predicted", "w_remote"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise InvalidArgumentError(name, f"tier weight must be in [0, 1], got {value!r}")
        for name in ("prefill_cost", "load_cost", "decode_weight", "imbalance_slack"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(name, f"must be finite and >= 0, got {value!r}")
        if not (math.isfinite(self.imbalance_factor) and self.imbalance_factor >= 1.0):
            raise InvalidArgumentError("imbalance_factor", "must be >= 1")


@dataclass(frozen=True)
class WorkerLoad:
    """A candidate's outstanding work."""

    worker: WorkerId
    queued_prefill_tokens: int = 0
    running_decodes: int = 0

    def tokens(self, decode_weight: float) -> float:
        return self.queued_prefill_tokens + decode_weight * self.running_decodes


@dataclass(frozen=True)
class Decision:
    """The chosen worker, its cost, the blocks it already holds, and any pull it should do."""

    worker: WorkerId
    cost: float
    cached_blocks: int
    pull_from: WorkerId | None
    pull_blocks: int
    costs: tuple[tuple[WorkerId, float], ...]


def _credit(match: RouteMatch | None, cfg: RoutingConfig) -> float:
    if match is None:
        return 0.0
    return (
        cfg.w_gpu * match.gpu
        + cfg.w_host * match.host
        + cfg.w_disk * match.disk
        + cfg.w_predicted * match.predicted
    )


def choose(
    num_tokens: int,
    candidates: Sequence[WorkerLoad],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    rng: random.Random | None = None,
) -> Decision:
    """Pick the lowest-cost candidate. Raises InvalidArgumentError when there is none."""
    if not candidates:
        raise InvalidArgumentError("candidates", "no candidate workers")
    loads = {c.worker: c.tokens(cfg.decode_weight) for c in candidates}
    floor = min(loads.values())
    limit = cfg.imbalance_factor * floor + cfg.imbalance_slack
    eligible = [c for c in candidates if loads[c.worker] <= limit] or list(candidates)
    best_holder, best_blocks = None, 0
    for worker, held in matches.items():
        if held.blocks > best_blocks:
            best_holder, best_blocks = worker, held.blocks
    tpb = cfg.tokens_per_block
    costs: list[tuple[WorkerId, float, int, int]] = []
    for cand in eligible:
        match = matches.get(cand.worker)
        own = match.blocks if match is not None else 0
        credit = _credit(match, cfg)
        pull = best_blocks - own if cfg.allow_pulls and best_holder != cand.worker else 0
        credit += cfg.w_remote * max(0, pull)
        left = max(0.0, num_tokens - tpb * credit)
        cost = cfg.prefill_cost * left + cfg.load_cost * loads[cand.worker]
        costs.append((cand.worker, cost, own, max(0, pull)))
    low = min(c[1] for c in costs)
    ties = [c for c in costs if c[1] <= low + 1e-9]
    pick = ties[0] if len(ties) == 1 else (rng or random.Random(cfg.seed)).choice(ties)
    worker, cost, own, pull = pick
    return Decision(
        worker, cost, own, best_holder if pull > 0 else None, pull, tuple((w, c) for w, c, _, _ in costs)
    )

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
from typing import NamedTuple

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


class Decision(NamedTuple):
    """The chosen worker, its cost, the blocks it already holds, and any pull it should do."""

    worker: WorkerId
    cost: float
    cached_blocks: int
    pull_from: WorkerId | None
    pull_blocks: int
    costs: tuple[tuple[WorkerId, float], ...]


def choose(
    num_tokens: int,
    candidates: Sequence[WorkerLoad],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    rng: random.Random | None = None,
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
    )


def choose_loads(
    num_tokens: int,
    workers: Sequence[WorkerId],
    loads: Sequence[float],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: RoutingConfig,
    rng: random.Random | None = None,
) -> Decision:
    """:func:`choose` with the candidates as parallel lists: ``workers[i]`` has ``loads[i]``
    outstanding tokens (no per-call objects: the hot path of a router). Same result as choose."""
    if not workers:
        raise InvalidArgumentError("candidates", "no candidate workers")
    floor = min(loads)
    limit = max(floor, cfg.imbalance_factor * floor + cfg.imbalance_slack)  # the floor always stays
    wg, wh, wd, wp = cfg.w_gpu, cfg.w_host, cfg.w_disk, cfg.w_predicted
    best_holder, best_blocks = None, 0
    held: dict[WorkerId, tuple[int, float]] = {}
    for worker, m in matches.items():
        if m.blocks > best_blocks:
            best_holder, best_blocks = worker, m.blocks
        held[worker] = (m.blocks, wg * m.gpu + wh * m.host + wd * m.disk + wp * m.predicted)
    tpb, pulls, w_remote = cfg.tokens_per_block, cfg.allow_pulls, cfg.w_remote
    pc, lc = cfg.prefill_cost, cfg.load_cost
    nothing = (0, 0.0)
    costs: list[tuple[WorkerId, float, int, int]] = []
    for worker, load in zip(workers, loads):
        if load > limit:
            continue
        own, credit = held.get(worker, nothing)
        pull = best_blocks - own if pulls and best_blocks > own and best_holder != worker else 0
        left = num_tokens - tpb * (credit + w_remote * pull)
        costs.append((worker, pc * left + lc * load if left > 0 else lc * load, own, pull))
    low = min(c[1] for c in costs)
    ties = [c for c in costs if c[1] <= low + 1e-9]
    pick = ties[0] if len(ties) == 1 else (rng or random.Random(cfg.seed)).choice(ties)
    worker, cost, own, pull = pick
    return Decision(
        worker, cost, own, best_holder if pull > 0 else None, pull, tuple((w, c) for w, c, _, _ in costs)
    )

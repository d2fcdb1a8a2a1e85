"""Prefill/decode pairing by cache location (pure; a PD proxy plugs it into Serve).

With disaggregated serving a request runs prefill on one worker and decode on another, and the
decode worker pulls the prompt's committed blocks from the prefill worker. For a prompt of
``num_tokens`` tokens (``n = num_tokens // tokens_per_block`` full blocks) and each pair (P, D):

    cost(P, D) = prefill(P) + transfer(P, D) + decode(D)
    prefill(P)     = the :func:`raykv.routing.policy.choose` cost of P: prefill tokens left after P's
                     tier-weighted cached prefix, plus P's load
    transfer(P, D) = transfer_cost * tokens_per_block * pull * (remote_node_factor if P and D are
                     on different nodes else 1),  pull = n - (blocks D already holds), 0 if P == D
    decode(D)      = D's load (queued prefill tokens + decode_weight x running decodes)

so prefill goes where the prefix is, and decode goes where pulling the result is cheapest: a
decode worker that still holds the conversation's earlier turns pulls only the new blocks, and a
decode worker on the prefill worker's node pulls over the fast local path. The load-imbalance guard
of :mod:`raykv.routing.policy` applies on each side. Ties break with a seeded RNG.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig, WorkerLoad, choose


@dataclass(frozen=True)
class PDConfig:
    """Pairing weights. ``transfer_cost`` is the cost of pulling one token's KV relative to
    prefilling it (``routing.prefill_cost``); ``remote_node_factor`` (>= 1) scales it when the two
    workers sit on different nodes."""

    routing: RoutingConfig = DEFAULT_ROUTING
    transfer_cost: float = 0.1
    remote_node_factor: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.routing, RoutingConfig):
            raise InvalidArgumentError("routing", "must be a RoutingConfig")
        if not (math.isfinite(self.transfer_cost) and self.transfer_cost >= 0):
            raise InvalidArgumentError("transfer_cost", f"must be finite, >= 0: {self.transfer_cost!r}")
        if not (math.isfinite(self.remote_node_factor) and self.remote_node_factor >= 1):
            raise InvalidArgumentError("remote_node_factor", "must be finite and >= 1")


@dataclass(frozen=True)
class PDDecision:
    """The chosen pair, its cost, the blocks the prefill worker already holds, and how many
    blocks the decode worker must pull from the prefill worker. ``costs`` lists every pair that
    passed the guards as ``(prefill, decode, cost)``."""

    prefill: WorkerId
    decode: WorkerId
    cost: float
    cached_blocks: int
    pull_blocks: int
    costs: tuple[tuple[WorkerId, WorkerId, float], ...]


def _guarded(cands: Sequence[WorkerLoad], cfg: RoutingConfig) -> list[WorkerLoad]:
    loads = [c.tokens(cfg.decode_weight) for c in cands]
    floor = min(loads)
    limit = max(floor, cfg.imbalance_factor * floor + cfg.imbalance_slack)
    return [c for c, load in zip(cands, loads) if load <= limit]


def choose_pair(
    num_tokens: int,
    prefill: Sequence[WorkerLoad],
    decode: Sequence[WorkerLoad],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: PDConfig | None = None,
    nodes: Mapping[WorkerId, str] | None = None,
    rng: random.Random | None = None,
) -> PDDecision:
    """Pick the lowest-cost (prefill, decode) pair; see the module docstring for the cost.

    ``matches`` is the index's answer for the prompt's block keys (any worker may appear; only
    candidates count). ``nodes`` maps workers to node ids (missing: treated as remote from every
    other worker). Raises InvalidArgumentError when either side has no candidate or
    ``num_tokens`` is negative. Pure and deterministic for a given ``rng`` (default: seeded from
    ``cfg.routing.seed``).
    """
    cfg = cfg or PDConfig()
    if not prefill or not decode:
        raise InvalidArgumentError("candidates", "need at least one prefill and one decode candidate")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidArgumentError("num_tokens", f"must be an int >= 0, got {num_tokens!r}")
    rcfg = replace(cfg.routing, allow_pulls=False)
    prefill_costs = dict(choose(num_tokens, prefill, matches, rcfg, random.Random(0)).costs)
    tpb = rcfg.tokens_per_block
    total = num_tokens // tpb
    nodes = nodes or {}
    pairs: list[tuple[WorkerId, WorkerId, float, int]] = []
    for cand in _guarded(decode, rcfg):
        held = matches.get(cand.worker)
        own = min(total, held.blocks) if held is not None else 0
        decode_cost = cand.tokens(rcfg.decode_weight)
        for pw, p_cost in prefill_costs.items():
            pull = 0 if pw == cand.worker else total - own
            same = pw in nodes and nodes.get(pw) == nodes.get(cand.worker)
            factor = 1.0 if same else cfg.remote_node_factor
            cost = p_cost + decode_cost + cfg.transfer_cost * tpb * pull * factor
            pairs.append((pw, cand.worker, cost, pull))
    low = min(c[2] for c in pairs)
    ties = [c for c in pairs if c[2] <= low + 1e-9]
    pick = ties[0] if len(ties) == 1 else (rng or random.Random(rcfg.seed)).choice(ties)
    p, d, cost, pull = pick
    held_p = matches.get(p)
    return PDDecision(
        prefill=p,
        decode=d,
        cost=cost,
        cached_blocks=held_p.blocks if held_p is not None else 0,
        pull_blocks=pull,
        costs=tuple((a, b, c) for a, b, c, _ in pairs),
    )

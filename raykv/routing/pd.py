"""Prefill/decode pairing by cache location (pure; a PD proxy plugs it into Serve).

With disaggregated serving a request runs prefill on one worker and decode on another, and the
decode worker pulls the prompt's committed blocks from the prefill worker. The pair is chosen in
two steps:

1. The prefill worker P is the one routing policy's decision
   (:class:`raykv.routing.adaptive.RoutingPolicy`, pulls off) over the prefill candidates: prefill
   goes where the prefix is, at the policy's learned duplicate price, with its load guard,
   balance, recent-work and cold-placement rules, and the policy learns from the decision.
2. The decode worker D is the guarded decode candidate of least

       decode(D) + transfer(P, D)
       decode(D)      = D's load (queued prefill tokens + decode_weight x running decodes)
       transfer(P, D) = transfer_cost * tokens_per_block * pull * (remote_node_factor if P and D
                        are on different nodes else 1),  pull = n - (blocks D already holds),
                        0 if P == D

   for ``n = num_tokens // tokens_per_block`` full blocks: decode goes where pulling the result is
   cheapest (a decode worker that still holds the conversation's earlier turns pulls only the new
   blocks; one on the prefill worker's node pulls over the fast local path).

The load-imbalance guard of :mod:`raykv.routing.policy` applies on each side. Ties break with a
seeded RNG.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig, WorkerLoad


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
    passed the guards as ``(prefill, decode, cost)``: the policy's cost of the prefill worker
    plus decode and transfer (the chosen prefill worker is the policy's decision, which its hot,
    balance and placement rules may move off the lowest of these)."""

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


def pd_policy(cfg: PDConfig) -> RoutingPolicy:
    """A fresh routing policy for the prefill side of ``cfg`` (its routing config with pulls
    off: the prefill worker computes what it does not hold)."""
    return RoutingPolicy(replace(cfg.routing, allow_pulls=False))


def choose_pair(
    num_tokens: int,
    prefill: Sequence[WorkerLoad],
    decode: Sequence[WorkerLoad],
    matches: Mapping[WorkerId, RouteMatch],
    cfg: PDConfig | None = None,
    nodes: Mapping[WorkerId, str] | None = None,
    rng: random.Random | None = None,
    policy: RoutingPolicy | None = None,
) -> PDDecision:
    """Pick the (prefill, decode) pair; see the module docstring.

    ``matches`` is the index's answer for the prompt's block keys (any worker may appear; only
    candidates count). ``nodes`` maps workers to node ids (missing: treated as remote from every
    other worker). ``policy`` chooses the prefill worker and learns from it (a proxy keeps one;
    None: a fresh :func:`pd_policy`, whose first decision uses the static prices and no load
    guard). Raises InvalidArgumentError when either side has no candidate or ``num_tokens`` is
    negative; nothing changes then. Deterministic for a given ``rng`` (default: seeded from
    ``cfg.routing.seed``) and policy state.
    """
    cfg = cfg or PDConfig()
    if not prefill or not decode:
        raise InvalidArgumentError("candidates", "need at least one prefill and one decode candidate")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidArgumentError("num_tokens", f"must be an int >= 0, got {num_tokens!r}")
    policy = policy or pd_policy(cfg)
    rcfg = policy.cfg
    rng = rng or random.Random(rcfg.seed)
    dw = rcfg.decode_weight
    chosen = policy.decide(
        num_tokens, [c.worker for c in prefill], [c.tokens(dw) for c in prefill], matches, rng
    )
    tpb = rcfg.tokens_per_block
    total = num_tokens // tpb
    nodes = nodes or {}
    pairs: list[tuple[WorkerId, WorkerId, float]] = []
    after_chosen: list[tuple[WorkerId, float, int]] = []  # decode candidates after the chosen P
    for cand in _guarded(decode, rcfg):
        held = matches.get(cand.worker)
        own = min(total, held.blocks) if held is not None else 0
        decode_cost = cand.tokens(dw)
        for pw, p_cost in chosen.costs:
            pull = 0 if pw == cand.worker else total - own
            same = pw in nodes and nodes.get(pw) == nodes.get(cand.worker)
            factor = 1.0 if same else cfg.remote_node_factor
            after = decode_cost + cfg.transfer_cost * tpb * pull * factor
            pairs.append((pw, cand.worker, p_cost + after))
            if pw == chosen.worker:
                after_chosen.append((cand.worker, after, pull))
    low = min(c[1] for c in after_chosen)
    ties = [c for c in after_chosen if c[1] <= low + 1e-9]
    d, after, pull = ties[0] if len(ties) == 1 else rng.choice(ties)
    held_p = matches.get(chosen.worker)
    return PDDecision(
        prefill=chosen.worker,
        decode=d,
        cost=chosen.cost + after,
        cached_blocks=held_p.blocks if held_p is not None else 0,
        pull_blocks=pull,
        costs=tuple(pairs),
    )

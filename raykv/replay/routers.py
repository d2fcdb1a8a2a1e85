"""The routing policies a replay compares (pure; ``ray_prefix`` gets Ray's tree from a factory).

random
    Uniform random worker.
pow2
    Two distinct random workers, the shorter queue wins (first of the pair on a tie): the shape of
    Ray Serve's default PowerOfTwoChoicesRequestRouter, which compares ongoing-request counts.
ray_prefix
    Ray Serve LLM's PrefixCacheAffinityRouter (ray 2.60) on Ray's own PrefixTree
    (``ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree``, built by the factory
    ``actors/replay/ray_tree.py`` registers in :mod:`raykv.replay.peer_tree`), fed with
    :func:`~raykv.replay.trace.block_text` of each hash id. Per request: draw the pow2 pair (the
    fallback); if max-min queue length > ``imbalanced_threshold`` use the pair; else
    ``prefix_match(text, all replicas)``; below ``match_rate_threshold`` take
    ``get_smallest_tenants()``, else the tenants of the deepest match; then the shortest queue
    among them, first wins ties (Ray's ``_select_from_candidate_replicas``); after routing
    ``insert(text, replica, now)``. Ray's defaults: imbalanced_threshold = inf,
    match_rate_threshold = 0.1, no eviction. The tree is called in-process (Ray calls it through
    an actor, adding RPC latency not counted here). Ray's router does not know cache salts.
raykv
    The global index (``PrefixIndex.route`` over the request's block keys) and the one routing
    policy, :class:`raykv.routing.adaptive.RoutingPolicy` over
    :data:`~raykv.routing.policy.DEFAULT_ROUTING` (only the replay's deployment facts changed:
    :func:`replay_routing`): estimated time to first token on each worker (the work queued ahead
    of it, from what a deployment reports, plus the prefill it does not hold), a duplicate of a
    block another worker holds charged the learned duplicate price unless the prefix is hot (in
    use by a request of this router still in flight on its holder), a load guard that scales
    with the observed work per request, a charge for the work routed to each worker over the
    last seconds of the replay's simulated clock (``now`` passed to the policy), seeded ties.
    The load it sees per worker is ``queued_prefill + (mean decode units of finished requests)
    x in_flight`` (:class:`~raykv.replay.timing.ServerQueues`), not the simulator's exact
    outstanding work, which depends on output lengths no router knows. A chat request whose
    messages could not be rendered to ids (``Prepared.unrendered``) is routed as raykv's Serve
    router routes a request without ids (``CacheRanker.fallback``): two random servers, the less
    loaded as reported wins; counted in ``stats["unrendered"]`` (the run's ``routed_unrendered``).
raykv_pull
    raykv with ``allow_pulls``: a worker may pull the part of the prefix another worker holds; the
    pull is priced at the observed pull time per token over the observed prefill time per token
    (the worker reports both after each request: :meth:`Router.observed`). A hot prefix spreads
    by pulling to the worker that load picks.
pooled
    The ideal: one cache of the same total capacity shared by every server (what pulls would make
    of the workers' caches), dispatched with the load information raykv has: the least reported
    load (:meth:`~raykv.replay.timing.ServerQueues.reported_loads`, raykv's load estimate), ties
    random. Every server sees the same cache, so that is also the least estimated TTFT. An upper
    bound on hits and the TTFT anchor for raykv_pull.
pooled_oracle
    The same pooled cache dispatched by the simulator's exact outstanding work, which includes the
    output lengths of requests still decoding (no real router knows them); ties random. It replays
    the cache exactly like ``pooled`` (one cache, requests in arrival order), so only TTFT differs.

Every router is seeded and replays identically. ``choose`` is what the replay times as the
routing decision; ``routed`` is the router's own state update afterwards (timed separately). For
raykv the timed decision is the index route over the request's block keys, the reported loads
and the cost model (with the hot-prefix rule); the keys themselves are computed before the loop
(:func:`~raykv.replay.engine.prepare`, timed there: ``Prepared.keys_ns``), though raykv's Serve
router hashes the prompt itself before it routes (``actors/serve/ranking.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.replay.peer_tree import new_prefix_tree
from raykv.replay.timing import ServerQueues, TimingConfig
from raykv.replay.trace import BLOCK_TOKENS, Request, block_text
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.policy import DEFAULT_ROUTING, Decision, RoutingConfig

ROUTERS = ("random", "pow2", "ray_prefix", "raykv", "raykv_pull", "pooled", "pooled_oracle")
_NEW = tuple.__new__  # builds a NamedTuple from its field values without the generated __new__


class Prepared(NamedTuple):
    """Request number ``seq`` with its block keys (full blocks, in its salt's scope) and the
    nanoseconds computing them took (SHA-256 over the prompt: outside the timed decision); for a
    chat request the nanoseconds rendering its messages to ids (``render_ns``, also outside),
    and ``unrendered`` when they could not be rendered (then no keys: routed by load)."""

    seq: int
    req: Request
    keys: Sequence[bytes]
    keys_ns: int = 0
    render_ns: int = 0
    unrendered: bool = False


class Choice(NamedTuple):
    """The server a request goes to, and an optional pull of ``keys[own:own + pull_blocks]``."""

    server: int
    pull_from: int | None = None
    own_blocks: int = 0
    pull_blocks: int = 0


@dataclass
class RouterContext:
    """What a router may use: servers, their cache workers (each holding at most
    ``capacity_blocks`` blocks; 0: not told), the index, clock and timing."""

    servers: int
    worker_ids: list[WorkerId]
    route: Callable[[Sequence[bytes]], dict[WorkerId, RouteMatch]]
    predict: Callable[[WorkerId, Sequence[bytes]], None]
    speed: float
    timing: TimingConfig
    mean_work: float
    seed: int = 0
    clock: Callable[[], float] = field(default=lambda: 0.0)
    capacity_blocks: int = 0


class Router:
    """Base class: a named, seeded policy over ``ctx.servers`` servers."""

    name = "base"
    pooled = False

    def start(self, ctx: RouterContext) -> None:
        """Reset all state for a new run."""
        self.ctx = ctx
        self.rng = random.Random(ctx.seed)

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        raise NotImplementedError

    def routed(self, p: Prepared, choice: Choice) -> None:
        """State update after the request was dispatched (no-op by default)."""

    def observed(self, pulled_tokens: int, pull_s: float, prefilled_tokens: int, prefill_s: float) -> None:
        """What the chosen worker reports once the request ran: tokens pulled and prefilled, and
        the seconds each took (no-op by default)."""


class RandomRouter(Router):
    name = "random"

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        return Choice(self.rng.randrange(self.ctx.servers))


def _shortest(cands: Sequence[int], qlens: Sequence[int]) -> int:
    """Lowest queue length; the first candidate wins ties (Ray's selection rule)."""
    best = cands[0]
    for c in cands[1:]:
        if qlens[c] < qlens[best]:
            best = c
    return best


class Pow2Router(Router):
    name = "pow2"

    def pair(self) -> list[int]:
        n = self.ctx.servers
        return self.rng.sample(range(n), 2) if n > 1 else [0]

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        return Choice(_shortest(self.pair(), queues.queue_lengths()))


def _least(values: Sequence[float], rng: random.Random) -> int:
    """The server with the lowest value; ``rng`` picks among those within 1e-9 of it."""
    low = min(values)
    ties = [i for i, v in enumerate(values) if v <= low + 1e-9]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class PooledRouter(Router):
    """Least reported load (raykv's estimate) over all servers; the engine gives it one cache."""

    name = "pooled"
    pooled = True

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        return Choice(_least(queues.reported_loads(), self.rng))


class PooledOracleRouter(PooledRouter):
    """Least exact outstanding work (the simulator's, output lengths included); one cache."""

    name = "pooled_oracle"

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        return Choice(_least(queues.outstanding(), self.rng))


class RayPrefixRouter(Pow2Router):
    """Ray Serve LLM's PrefixCacheAffinityRouter logic on Ray's PrefixTree (module docstring)."""

    name = "ray_prefix"

    def __init__(self, imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.stats = {"prefix": 0, "smallest": 0, "fallback": 0}

    def start(self, ctx: RouterContext) -> None:
        super().start(ctx)
        self.tree: Any = new_prefix_tree()
        names = [f"replica-{i}" for i in range(ctx.servers)]
        self.rng.shuffle(names)  # Ray iterates its replica set in a fixed, arbitrary order
        self.tenants = names
        self.server_of = {name: int(name.rsplit("-", 1)[1]) for name in names}
        self.tree.add_tenants(names, ctx.clock())
        self._texts: dict[int, str] = {}
        self._last = ""
        self.stats = {"prefix": 0, "smallest": 0, "fallback": 0}

    def text(self, req: Request) -> str:
        cache = self._texts
        parts = []
        for h in req.hash_ids:
            t = cache.get(h)
            if t is None:
                t = cache[h] = block_text(h)
            parts.append(t)
        return "".join(parts)

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        fallback = self.pair()
        qlens = queues.queue_lengths()
        text = self._last = self.text(p.req)
        chosen: list[str] | None = None
        if max(qlens) - min(qlens) <= self.imbalanced_threshold:
            matched_text, matched = self.tree.prefix_match(text, self.tenants)
            if len(matched_text) / len(text) < self.match_rate_threshold:
                chosen, kind = self.tree.get_smallest_tenants(), "smallest"
            else:
                chosen, kind = matched, "prefix"
        if not chosen:
            self.stats["fallback"] += 1
            return Choice(_shortest(fallback, qlens))
        self.stats[kind] += 1
        return Choice(_shortest([self.server_of[t] for t in chosen], qlens))

    def routed(self, p: Prepared, choice: Choice) -> None:
        self.tree.insert(self._last, f"replica-{choice.server}", self.ctx.clock())


def replay_routing(base: RoutingConfig, allow_pulls: bool, seed: int) -> RoutingConfig:
    """``base`` (the shipped default) with the replay deployment's facts: 512-token blocks, its
    workers' only tier (host memory, playing the engine's GPU memory) credited fully, loads
    computed by the router (``decode_weight`` 0: :meth:`ServerQueues.reported_loads` already
    counts decodes), pulls on or off, and the run's seed. No policy parameter changes."""
    return replace(
        base, tokens_per_block=BLOCK_TOKENS, w_host=1.0, decode_weight=0.0, allow_pulls=allow_pulls, seed=seed
    )


class RaykvRouter(Router):
    """Cache-aware routing on the global index with :class:`raykv.routing.adaptive.RoutingPolicy`."""

    name = "raykv"

    def __init__(self, allow_pulls: bool = False, routing: RoutingConfig = DEFAULT_ROUTING) -> None:
        self.allow_pulls = allow_pulls
        self.routing = routing
        if allow_pulls:
            self.name = "raykv_pull"

    def start(self, ctx: RouterContext) -> None:
        super().start(ctx)
        self.policy = RoutingPolicy(replay_routing(self.routing, self.allow_pulls, ctx.seed))
        if ctx.capacity_blocks:  # what a worker reports in a deployment
            for worker in ctx.worker_ids:
                self.policy.observe_capacity(worker, ctx.capacity_blocks)
        self.server_of = {w: i for i, w in enumerate(ctx.worker_ids)}
        self._route, self._workers = ctx.route, ctx.worker_ids
        self._routed: dict[bytes, tuple[int, float]] = {}  # key -> (server, when) of its last request
        self._keys: Sequence[bytes] = ()
        self._queues: ServerQueues | None = None
        self._decided: tuple[int, Decision, float] = (0, Decision(WorkerId(""), 0.0, 0, None, 0, ()), 0.0)
        self._hot_check = self._hot  # bound once, not per decision
        self.stats: dict[str, int] = {}  # only what happened: "unrendered"

    def choose(self, p: Prepared, queues: ServerQueues) -> Choice:
        """The decision the replay times: index route, reported loads, the policy (module doc);
        by load alone for a request that could not be rendered."""
        if p.unrendered:
            return self._by_load(queues)
        keys = p.keys
        matches = self._route(keys)
        self._keys, self._queues = keys, queues
        num_tokens, decode = p.req.input_length, queues.mean_decode_units
        d = self.policy.decide(
            num_tokens,
            self._workers,
            queues.reported_loads(),
            matches,
            self.rng,
            self._hot_check,
            decode,
            learn=False,  # the policy learns in routed(), the router's update after dispatch
            now=queues.now,  # simulated time: the recent work decays on the replay's clock
        )
        self._decided = (num_tokens, d, decode)
        server = self.server_of[d.worker]
        pull_from = d.pull_from
        if pull_from is None:
            return _NEW(Choice, (server, None, d.cached_blocks, 0))
        return _NEW(Choice, (server, self.server_of[pull_from], d.cached_blocks, d.pull_blocks))

    def _by_load(self, queues: ServerQueues) -> Choice:
        """Serve's fallback for a request without token ids: two random servers (all when at
        most two), in random order, the lower reported load first; counted."""
        n = self.ctx.servers
        picks = list(range(n)) if n <= 2 else self.rng.sample(range(n), 2)
        self.rng.shuffle(picks)
        loads = queues.reported_loads()
        picks.sort(key=lambda s: loads[s])
        self.stats["unrendered"] = self.stats.get("unrendered", 0) + 1
        return Choice(picks[0])

    def _hot(self, worker: WorkerId, blocks: int) -> bool:
        """Did a request that is still in flight on ``worker`` bring it the prefix's last block?
        In flight = routed there since the server was last idle (what its reports tell)."""
        last = self._routed.get(self._keys[blocks - 1])
        if last is None or self._queues is None:
            return False
        server = self.server_of[worker]
        q = self._queues
        return last[0] == server and q.in_flight[server] > 0 and last[1] >= q.busy_since[server]

    def routed(self, p: Prepared, choice: Choice) -> None:
        if p.unrendered:  # no keys to credit, no decision to learn from (as in Serve)
            return
        self._routed.update(dict.fromkeys(p.keys, (choice.server, self.ctx.clock())))
        self.policy.learn(*self._decided)

    def observed(self, pulled_tokens: int, pull_s: float, prefilled_tokens: int, prefill_s: float) -> None:
        """What the chosen worker reports after the request: its pull's and prefill's times."""
        self.policy.observe_pull(pulled_tokens, pull_s)
        self.policy.observe_prefill(prefilled_tokens, prefill_s)


def make_router(name: str, routing: RoutingConfig = DEFAULT_ROUTING) -> Router:
    """A fresh router by name (one of :data:`ROUTERS`). Raises InvalidArgumentError otherwise."""
    if name == "random":
        return RandomRouter()
    if name == "pow2":
        return Pow2Router()
    if name == "ray_prefix":
        return RayPrefixRouter()
    if name in ("raykv", "raykv_pull"):
        return RaykvRouter(allow_pulls=name == "raykv_pull", routing=routing)
    if name == "pooled":
        return PooledRouter()
    if name == "pooled_oracle":
        return PooledOracleRouter()
    raise InvalidArgumentError("router", f"unknown router {name!r}; known: {', '.join(ROUTERS)}")


def parse_routers(text: str | Sequence[str]) -> list[str]:
    """Router names from ``"a,b"`` or a list (``all`` = every router), order kept, no duplicates."""
    names = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for name in (n.strip() for n in names):
        for one in ROUTERS if name == "all" else (name,):
            if one not in ROUTERS:
                raise InvalidArgumentError("routers", f"unknown router {one!r}; known: {', '.join(ROUTERS)}")
            if one not in out:
                out.append(one)
    if not out:
        raise InvalidArgumentError("routers", "no router named")
    return out


__all__ = [
    "ROUTERS",
    "Choice",
    "PooledOracleRouter",
    "PooledRouter",
    "Pow2Router",
    "Prepared",
    "RandomRouter",
    "RayPrefixRouter",
    "RaykvRouter",
    "Router",
    "RouterContext",
    "make_router",
    "parse_routers",
]

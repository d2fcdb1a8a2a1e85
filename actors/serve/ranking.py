"""The Serve router's logic, without Serve: the index link and the replica ranking.

- :class:`IndexLink` connects to a raykv deployment's index (:func:`connect_index`) in the
  background and stays away for ``retry_after_s`` after a failure.
- :class:`CacheRanker` ranks replicas for a :class:`~actors.serve.routed.RoutedRequest` by the
  cost model of :class:`~raykv.routing.adaptive.RoutingPolicy`, or by power of two choices on
  reported load when the index is away, slow or failing, and keeps the in-flight load and
  hot-prefix records its decisions read. :class:`actors.serve.router.CacheAwareRouter` is its
  Serve front end; CacheRanker needs no Serve and is unit-tested directly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import ray

from actors.cache.cluster import REGISTRY
from actors.cache.index import IndexClient
from actors.cache.metrics import RouterMetrics
from actors.serve.fields import capacity_of, key_scheme, pulls_of, timing_of, worker_of
from actors.serve.match import engine_route
from actors.serve.routed import RoutedRequest
from raykv.core.errors import ConfigError
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.adaptive import HotPrefix, RoutingPolicy
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig, WorkerLoad
from raykv.routing.session_keys import SessionKeys

log = logging.getLogger(__name__)

_MAX_TRACKED = 10_000
_INFLIGHT_TTL_S = 600.0
_DONE_TTL_S = 30.0  # completed requests are remembered this long (replicas report every ~1 s)


# ---- the index, seen from a router ----------------------------------------------------------------
@dataclass(frozen=True)
class IndexView:
    """A connected index (``route_async(keys)``, ``predict(worker, keys)``) and the deployment's
    tokens_per_block."""

    index: Any
    tokens_per_block: int


async def connect_index(namespace: str) -> IndexView:
    """Attach to a raykv deployment's index shards without blocking the event loop."""
    loop = asyncio.get_running_loop()
    registry = await loop.run_in_executor(None, lambda: ray.get_actor(REGISTRY, namespace=namespace))
    spec = await registry.get.remote()
    shards = await loop.run_in_executor(
        None, lambda: [ray.get_actor(n, namespace=namespace) for n in spec.shards]
    )
    lanes = {lane: WorkerId(name) for name, lane in spec.workers}
    return IndexView(IndexClient(shards, lanes), spec.config.tokens_per_block)


class IndexLink:
    """Lazily connects to the index in the background, and stays away for ``retry_after_s``
    after a failure. ``get()`` waits at most ``budget_s`` and returns None when not connected."""

    def __init__(self, connect: Callable[[], Awaitable[IndexView]], retry_after_s: float) -> None:
        self._connect = connect
        self.retry_after_s = retry_after_s
        self.view: IndexView | None = None
        self._task: asyncio.Future[IndexView] | None = None
        self._retry_at = 0.0

    async def get(self, budget_s: float) -> IndexView | None:
        if self.view is not None:
            return self.view
        if self._task is None:
            if time.monotonic() < self._retry_at:
                return None
            self._task = asyncio.ensure_future(self._connect())
        try:
            self.view = await asyncio.wait_for(asyncio.shield(self._task), budget_s)
        except asyncio.TimeoutError:
            return None
        except Exception as exc:
            log.warning("raykv index unreachable (%s); no cache routing for %.0fs", exc, self.retry_after_s)
            self.failed()
        return self.view

    def failed(self) -> None:
        """Forget the connection; reconnect (afresh) no sooner than ``retry_after_s`` from now."""
        self.view = None
        self._task = None
        self._retry_at = time.monotonic() + self.retry_after_s


# ---- the router logic -----------------------------------------------------------------------------
@dataclass
class _Sent:
    replica: Any
    at: float
    tokens: int
    done: float = 0.0  # when it completed (0: in flight)
    keys: Sequence[bytes] = ()  # its prompt's block keys (for the hot-prefix rule)


class CacheRanker:
    """Ranks replicas for a request: cache-aware cost model, or power of two choices.

    Decisions are made by one :class:`~raykv.routing.adaptive.RoutingPolicy` (per block size
    and pull mode) over :data:`~raykv.routing.policy.DEFAULT_ROUTING`; ``routing`` overrides its
    fields. Deployment facts come from the deployment: tokens_per_block from the index, and
    ``allow_pulls`` from the replicas (when every candidate announces ``raykv_pulls``, its
    engine fetches a remote hit instead of recomputing it, so the policy prices such blocks as
    pulls, as the replay's ``raykv_pull`` does; a ``routing`` override of ``allow_pulls`` wins).
    Replicas are any objects with ``replica_id``, ``routing_stats`` and ``replica_metadata``.
    Each decision counts in ``counters`` and, given ``metrics``, in its Prometheus series.
    """

    MAX_KEYS = 200_000
    """Block keys kept for the hot-prefix rule before those of requests no longer in flight are
    swept."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[IndexView]],
        routing: Mapping[str, Any] | None = None,
        time_budget_s: float = 0.05,
        retry_after_s: float = 5.0,
        seed: int = 0,
        metrics: RouterMetrics | None = None,
    ) -> None:
        known = {f.name for f in fields(RoutingConfig)}
        unknown = sorted(set(routing or {}) - known)
        if unknown:
            raise ConfigError("routing", f"unknown RoutingConfig fields {unknown}; fields: {sorted(known)}")
        self._overrides = dict(routing or {})
        self._decode_weight = self.config(1).decode_weight  # validates the overrides now
        self._policies: dict[tuple[int, bool], RoutingPolicy] = {}
        self._session_keys: dict[int, SessionKeys] = {}
        self.link = IndexLink(connect, retry_after_s)
        self.time_budget_s = time_budget_s
        self.rng = random.Random(seed)
        # request id -> (chosen worker, block keys, tokens to prefill, tracked for the hot rule?)
        self._pending: collections.OrderedDict[str, tuple[WorkerId | None, list[bytes], int, bool]] = (
            collections.OrderedDict()
        )
        self._sent: collections.OrderedDict[str, _Sent] = collections.OrderedDict()
        self._done: collections.deque[_Sent] = collections.deque(maxlen=_MAX_TRACKED)
        self._brought: dict[bytes, str] = {}  # block key -> the last routed request holding it
        self._sweep_at = self.MAX_KEYS
        self._timing: dict[Any, tuple[int, int, int, int]] = {}  # replica id -> its last timing totals
        # request id -> the match its engine gets (actors.serve.match; taken by CacheAwareRouter)
        self.routes: collections.OrderedDict[str, dict[str, Any] | None] = collections.OrderedDict()
        self.counters: collections.Counter[str] = collections.Counter()
        self.metrics = metrics

    def _count(self, outcome: str) -> None:
        """One more ``outcome`` in ``counters`` and the metrics."""
        self.counters[outcome] += 1
        if self.metrics is not None:
            self.metrics.count(outcome)

    def config(self, tokens_per_block: int, pulls: bool = False) -> RoutingConfig:
        """The shipped default with this router's overrides, for ``tokens_per_block``; with
        ``pulls`` (the replicas' engines pull remote hits) ``allow_pulls`` unless overridden."""
        facts = {"allow_pulls": pulls, **self._overrides, "tokens_per_block": tokens_per_block}
        return replace(DEFAULT_ROUTING, **facts)

    def keys(self, request: RoutedRequest, tokens_per_block: int) -> list[bytes]:
        """The request's block keys, reusing its session's previous keys (ValueError for bad
        tokens)."""
        return list(self.sessions(tokens_per_block).keys(request.tokens, request.scope, request.session))

    def sessions(self, tokens_per_block: int) -> SessionKeys:
        """The per-session key reuse for deployments of ``tokens_per_block``."""
        sessions = self._session_keys.get(tokens_per_block)
        if sessions is None:
            sessions = self._session_keys[tokens_per_block] = SessionKeys(tokens_per_block)
        return sessions

    def policy(self, tokens_per_block: int, pulls: bool = False) -> RoutingPolicy:
        """The policy (and its learned prices) for deployments of ``tokens_per_block`` whose
        replicas pull remote hits (``pulls``) or not."""
        policy = self._policies.get((tokens_per_block, pulls))
        if policy is None:
            policy = self._policies[tokens_per_block, pulls] = RoutingPolicy(
                self.config(tokens_per_block, pulls)
            )
        return policy

    async def rank(
        self, replicas: Sequence[Any], request: RoutedRequest | None, request_id: str | None = None
    ) -> list[list[Any]]:
        """Ranked replica lists, best first. Never raises for index trouble (falls back)."""
        if not replicas:
            return []
        self.counters["decisions"] += 1
        if request is not None and request.target is not None:
            hit = [r for r in replicas if worker_of(r) == request.target]
            if hit:
                self._count("targeted")
                return [hit, [r for r in replicas if worker_of(r) != request.target]]
        if request is None or not request.tokens:
            return self.fallback(replicas)
        start = time.monotonic()
        view = await self.link.get(self.time_budget_s)
        if view is None:
            return self.fallback(replicas)
        scheme = key_scheme(replicas)
        if scheme is False:  # replicas of several models behind one router: keys cannot agree
            self._count("mixed_models")
            return self.fallback(replicas)
        tpb = view.tokens_per_block
        if scheme is not None:  # the engines' block size and model fingerprint
            tpb, model = scheme
            request = replace(request, scope=request.scope.with_model(model))
        try:
            keys = self.keys(request, tpb)
        except ValueError:  # token ids out of range: no cache routing for this request
            return self.fallback(replicas)
        try:
            left = max(0.001, self.time_budget_s - (time.monotonic() - start))
            # the index merges the shards that answer within the budget; the outer wait only
            # guards a client that would not keep it
            matches = await asyncio.wait_for(view.index.route_async(keys, budget_ms=left * 1e3), left + 0.05)
        except Exception as exc:
            self._count("index_timeouts" if isinstance(exc, asyncio.TimeoutError) else "index_errors")
            self.link.failed()
            return self.fallback(replicas)
        pulls = all(pulls_of(r) for r in replicas)  # every engine loads KV, fetching remote hits
        policy = self.policy(tpb, pulls)
        moved = policy.placement.moved
        ranks, worker, cached = self._by_cost(policy, replicas, keys, matches, len(request.tokens), tpb)
        placed = policy.placement.moved > moved
        if placed:
            self.counters["cold_placed"] += 1
        if request_id is not None:
            hot = not policy.cfg.allow_pulls  # with pulls the policy never asks whether a prefix is hot
            remember(self._pending, request_id, (worker, keys, len(request.tokens) - cached, hot))
            if pulls and scheme is not None:  # engines keyed as here: their lookups use this match
                remember(self.routes, request_id, engine_route(keys, matches, len(request.tokens), tpb))
        self._count("cache_routed")
        seconds = time.monotonic() - start
        self.counters["decision_us_total"] += int(seconds * 1e6)
        if self.metrics is not None:
            self.metrics.routed(seconds, policy.duplicate_price, policy.pull_price, placed)
        return ranks

    def _by_cost(
        self,
        policy: RoutingPolicy,
        replicas: Sequence[Any],
        keys: Sequence[bytes],
        matches: Mapping[WorkerId, RouteMatch],
        num_tokens: int,
        tpb: int,
    ) -> tuple[list[list[Any]], WorkerId | None, int]:
        ids = {WorkerId(f"replica-{i}"): r for i, r in enumerate(replicas)}
        per_replica: dict[WorkerId, RouteMatch] = {}
        for cid, r in ids.items():
            m = matches.get(worker_of(r) or WorkerId(""))
            if m is not None:
                per_replica[cid] = m._replace(worker=cid)
            blocks = capacity_of(r)  # the capacity the replica reports, for the placement rule
            if blocks is not None and policy.placement.capacity.get(cid) != blocks:
                policy.observe_capacity(cid, blocks)
            self._observe_timing(policy, r)
        dw = self._decode_weight
        loads = [self._load(cid, r).tokens(dw) for cid, r in ids.items()]
        decision = policy.decide(num_tokens, list(ids), loads, per_replica, self.rng, self._hot(keys, ids))
        costs = dict(decision.costs)
        order = sorted(costs, key=lambda c: (c != decision.worker, costs[c]))
        ranks = [[ids[c]] for c in order]
        rest = [ids[c] for c in ids if c not in costs]
        if rest:
            ranks.append(rest)
        return ranks, worker_of(ids[decision.worker]), decision.cached_blocks * tpb

    def _observe_timing(self, policy: RoutingPolicy, replica: Any) -> None:
        """Feed ``policy`` what ``replica``'s pulls and prefills took since its last report
        (:data:`~actors.serve.fields.TIMING_FIELD`; totals that went down mean a restarted
        replica: counted from 0)."""
        now = timing_of(replica)
        if now is None:
            return
        rid = replica.replica_id
        last = self._timing.get(rid)
        if last == now:
            return
        self._timing[rid] = now
        if last is None or any(n < b for n, b in zip(now, last)):
            last = (0, 0, 0, 0)
        pulled, pull_us, prefilled, prefill_us = (n - b for n, b in zip(now, last))
        if pulled and pull_us:
            policy.observe_pull(pulled, pull_us / 1e6)
        if prefilled and prefill_us:
            policy.observe_prefill(prefilled, prefill_us / 1e6)

    def _hot(self, keys: Sequence[bytes], ids: Mapping[WorkerId, Any]) -> HotPrefix:
        """The policy's hot-prefix test for one decision over ``keys``: is the request routed last
        with the prefix's last block (``keys[blocks - 1]``) still in flight on replica
        ``ids[cid]``? (A burst on that prefix: the policy re-decides at ``hot_price``, as the
        replay's router does on its simulated queues.)"""
        brought, sent = self._brought, self._sent

        def hot(cid: WorkerId, blocks: int) -> bool:
            rid = brought.get(keys[blocks - 1]) if 0 < blocks <= len(keys) else None
            s = sent.get(rid) if rid is not None else None
            return s is not None and not s.done and s.replica == ids[cid].replica_id

        return hot

    def _load(self, cid: WorkerId, replica: Any) -> WorkerLoad:
        stats = replica.routing_stats if isinstance(replica.routing_stats, Mapping) else {}
        since = float(stats.get("ts", 0.0))
        queued = int(stats.get("queued_prefill_tokens", 0))
        rid = replica.replica_id
        queued += sum(s.tokens for s in self._sent.values() if s.replica == rid and s.at > since)
        # requests the report still counted that have completed since: neither queued nor decoding
        gone = [s for s in self._done if s.replica == rid and s.at <= since < s.done]
        queued -= sum(s.tokens for s in gone)
        decodes = int(stats.get("running_decodes", 0)) - len(gone)
        return WorkerLoad(cid, max(0, queued), max(0, decodes))

    def fallback(self, replicas: Sequence[Any]) -> list[list[Any]]:
        """Power of two choices: two random replicas, the less loaded (as reported) first."""
        self._count("fallback")
        picks = list(replicas) if len(replicas) <= 2 else self.rng.sample(list(replicas), 2)
        self.rng.shuffle(picks)
        picks.sort(key=lambda r: self._load(WorkerId(""), r).tokens(self._decode_weight))
        return [picks]

    def routed(self, request_id: str, replica_id: Any, worker: WorkerId | None = None) -> None:
        """A request went to ``replica_id``: credit its worker in the index, count its load."""
        worker_, keys, tokens, hot = self._pending.pop(request_id, (None, [], 0, False))
        worker = worker or worker_
        view = self.link.view
        if keys and worker is not None and view is not None:
            try:
                view.index.predict(worker, keys)
            except Exception as exc:
                log.debug("raykv predict failed: %s", exc)
        tracked = keys if hot else ()
        remember(self._sent, request_id, _Sent(replica_id, time.time(), tokens, keys=tracked))
        if tracked:
            self._bring(request_id, tracked)

    def _bring(self, request_id: str, keys: Sequence[bytes]) -> None:
        """``request_id`` is now the last routed request holding ``keys``. Past :attr:`MAX_KEYS`
        keys, those of requests no longer tracked as in flight are swept (a completion that never
        came, a replica that died)."""
        brought = self._brought
        brought.update(dict.fromkeys(keys, request_id))
        if len(brought) > self._sweep_at:
            sent = self._sent
            self._brought = {k: r for k, r in brought.items() if r in sent}
            self._sweep_at = max(self.MAX_KEYS, 2 * len(self._brought))

    def completed(self, request_id: str) -> None:
        """A request finished: its tokens leave its replica's load at once, also from the
        replica's last report if that report was taken while it ran; the prefix it brought is no
        longer hot."""
        sent = self._sent.pop(request_id, None)
        now = time.time()
        if sent is not None:
            sent.done = now
            self._done.append(sent)
            brought = self._brought
            for key in sent.keys:
                if brought.get(key) == request_id:
                    del brought[key]
            sent.keys = ()  # kept in _done for the load reports only
        while self._done and now - self._done[0].done > _DONE_TTL_S:
            self._done.popleft()

    def forget_replica(self, replica_id: Any) -> None:
        """A replica died: drop its timing totals and every request tracked on it."""
        self._timing.pop(replica_id, None)
        for rid in [k for k, s in self._sent.items() if s.replica == replica_id]:
            del self._sent[rid]
        self._done = collections.deque((s for s in self._done if s.replica != replica_id), _MAX_TRACKED)


def remember(table: collections.OrderedDict[str, Any], key: str, value: Any) -> None:
    """Set ``table[key] = value``, then drop its oldest entries past 10,000 and, when ``value``
    is an in-flight record, those sent over 10 minutes ago (a completion that never came).
    Changes ``table`` only."""
    table[key] = value
    while len(table) > _MAX_TRACKED:
        table.popitem(last=False)
    if isinstance(value, _Sent):
        while table and time.time() - next(iter(table.values())).at > _INFLIGHT_TTL_S:
            table.popitem(last=False)

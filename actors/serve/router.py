"""Ray Serve integration: cache-aware request routing and prefill/decode pairing.

- :class:`CacheAwareRouter` is a ``ray.serve.request_router.RequestRouter`` (Ray 2.60). Attach it
  with ``@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=
  CacheAwareRouter, request_router_kwargs={"namespace": "raykv", ...}))`` to the deployment that
  runs the model (not to an HTTP ingress: the router needs token ids, see
  :func:`actors.serve.routed.parse_request`). Its logic lives in
  :class:`actors.serve.ranking.CacheRanker`, which needs no Serve and is unit-tested directly. Its
  index answer travels with the request to the engine (:mod:`actors.serve.match`).
- :class:`actors.serve.deployments.ReplicaCache` is the replica side: it pairs the replica with one raykv
  CacheWorker, moves pages between them, and keeps the load numbers the replica reports.
- :class:`actors.serve.deployments.PDPairer` picks a (prefill worker, decode worker) pair for a PD proxy
  (:func:`raykv.routing.pd.choose_pair`); the proxy sends each phase with ``target_worker`` set, and the
  CacheAwareRouter of each phase's deployment honors it.

Replica <-> worker mapping: replica ``rank`` (Serve's replica rank, 0..N-1) pairs with worker
``pool[rank % len(pool)]`` of the raykv deployment (``pool``: all workers by default, or the
subset given to that Serve deployment, e.g. prefill workers 0-1 and decode workers 2-3). The
replica announces its worker id as ``"raykv_worker"`` both in ``record_replica_metadata`` (static,
known to routers as soon as the replica is up) and in ``record_routing_stats`` (with its load:
``queued_prefill_tokens``, ``running_decodes``, ``ts``). The router translates the index's
per-worker RouteMatch into per-replica costs through that id; a replica without one gets no
cache credit. Pages move between a replica and its worker as ExportedBlock records through Ray's
object store (the worker is another process); a pull between workers goes worker to worker.

Failure policy: routing never fails a request because of raykv. The index connection and every
route query run within ``time_budget_s`` with async calls only (no ``ray.get`` on the event
loop); on error or timeout the router falls back to power-of-two choices on reported load and
skips the index for ``retry_after_s``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.cache.metrics import RouterMetrics
from actors.serve.fields import worker_of
from actors.serve.match import forward_route
from actors.serve.prompts import RENDER_BUDGET_S, RequestTokens, renderable
from actors.serve.ranking import CacheRanker, connect_index, remember
from actors.serve.routed import RoutedRequest, parse_request, routed_request

log = logging.getLogger(__name__)


_COUNTERS: dict[str, collections.Counter[str]] = {}


def router_counters() -> dict[str, dict[str, int]]:
    """Decision counters of the CacheAwareRouters living in this process (a Serve router runs in
    each caller: the proxy, an upstream replica, or a driver holding a handle), by deployment:
    ``decisions``, ``cache_routed``, ``targeted``, ``fallback``, ``index_timeouts``,
    ``index_errors``, ``decision_us_total``, ``routes_forwarded`` (:mod:`actors.serve.match`); for
    chat and text requests ``rendered``, ``render_us_total``, ``unrendered`` (and
    ``unrendered_<reason>``), ``render_timeouts``, ``render_errors``
    (:class:`actors.serve.prompts.RequestTokens`)."""
    return {dep: dict(c) for dep, c in list(_COUNTERS.items())}


class CacheAwareRouter(RequestRouter):
    """Serve request router that sends each request where its prefix is cached (see module doc).

    ``request_router_kwargs``: ``namespace`` (raykv deployment, default "raykv"), ``routing``
    (RoutingConfig overrides), ``time_budget_s`` (per decision, default 0.05), ``retry_after_s``
    (index back-off, default 5), ``seed`` (tie-breaks and fallback choices), ``tokenizer`` (where
    the model's tokenizer loads from: chat and text requests are then rendered to the engine's
    token ids, :mod:`actors.serve.prompts`; :func:`actors.serve.llm.with_raykv` sets the
    model's), ``render_budget_s`` (per request, default 0.25: past it, routed by load) and
    ``forward_route`` (default True: the index answer a request was routed by goes with it to the
    engine, which then does not ask the index again; :mod:`actors.serve.match`).
    """

    def initialize_state(  # type: ignore[override]
        self,
        namespace: str = "raykv",
        routing: Mapping[str, Any] | None = None,
        time_budget_s: float = 0.05,
        retry_after_s: float = 5.0,
        seed: int = 0,
        tokenizer: str | None = None,
        render_budget_s: float = RENDER_BUDGET_S,
        forward_route: bool = True,
        **_: Any,
    ) -> None:
        deployment = str(self._deployment_id)
        self.forwarding = forward_route
        self.ranker = CacheRanker(
            lambda: connect_index(namespace),
            routing,
            time_budget_s,
            retry_after_s,
            seed,
            RouterMetrics(deployment) if ray.is_initialized() else None,
        )
        # Serve pickles a router's module by value, so this class may be a copy with its own
        # globals: register the counters in the imported module, which router_counters() reads.
        import actors.serve.router as home

        home._COUNTERS[deployment] = self.ranker.counters
        counts = self.ranker.counters
        metrics = self.ranker.metrics
        self.prompts = (
            RequestTokens(tokenizer, render_budget_s, counters=counts, metrics=metrics) if tokenizer else None
        )
        self._rendered: collections.OrderedDict[str, RoutedRequest | None] = collections.OrderedDict()

    def _ranker(self) -> CacheRanker:
        if getattr(self, "ranker", None) is None:
            self.initialize_state()
        return self.ranker

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ranker = self._ranker()
        try:
            if pending_request is None:
                return await ranker.rank(candidate_replicas, None)
            rid = pending_request.metadata.internal_request_id
            request = await self._request(pending_request.args, pending_request.kwargs, rid)
            ranks = await ranker.rank(candidate_replicas, request, rid)
            route = ranker.routes.pop(rid, None)
            forward_route(pending_request, route if self.forwarding else None, ranker.counters)
            return ranks
        except Exception:
            log.exception("cache-aware routing failed; using power of two choices")
            return ranker.fallback(candidate_replicas)

    async def _request(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], rid: str
    ) -> RoutedRequest | None:
        """The request's token ids: given (``parse_request``), else rendered from its chat
        messages or text prompt (once per request: Serve may ask again for a retry); None when
        neither (routed by load, counted in ``unrendered`` when it had messages or text)."""
        request = parse_request(args, kwargs)
        prompts = getattr(self, "prompts", None)
        if request is not None or prompts is None:
            return request
        if rid in self._rendered:
            return self._rendered[rid]
        source = renderable(args, kwargs)
        if source is None:
            return None
        ids = await prompts.tokens(source)
        routed = routed_request(source, ids) if ids else None
        remember(self._rendered, rid, routed)
        return routed

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        try:
            worker = worker_of(self.curr_replicas.get(replica_id))
            self._ranker().routed(pending_request.metadata.internal_request_id, replica_id, worker)
        except Exception:
            log.exception("raykv: on_request_routed failed")

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ranker().completed(internal_request_id)
        getattr(self, "_rendered", {}).pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ranker().forget_replica(replica_id)


def router_config(namespace: str = "raykv", stats_period_s: float = 1.0, **kwargs: Any) -> Any:
    """A ``RequestRouterConfig`` that attaches :class:`CacheAwareRouter` to a deployment, for the
    raykv deployment in ``namespace``; ``kwargs`` go to ``initialize_state`` (``routing``,
    ``time_budget_s``, ``retry_after_s``, ``seed``). Replicas report routing stats every
    ``stats_period_s`` seconds."""
    from ray.serve.config import RequestRouterConfig

    fields: dict[str, Any] = {
        "request_router_class": CacheAwareRouter,
        "request_router_kwargs": {"namespace": namespace, **kwargs},
        "request_routing_stats_period_s": stats_period_s,
    }
    return RequestRouterConfig(**fields)

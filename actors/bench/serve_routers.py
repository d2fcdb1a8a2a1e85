"""Bench-only request routers of ``raykv bench serve``: each compared router, timed the same way.

:class:`TimedRouter` times each ``choose_replicas`` call (the decision: for Serve's power of two
choices a random pair; for Ray's ``PrefixCacheAffinityRouter`` its prefix-tree lookups; for
raykv's ``CacheAwareRouter`` rendering the chat to token ids, the index query and the cost model)
and each ``on_request_routed`` callback (where the prefix-affinity router inserts the prompt into
its tree and raykv's credits the chosen worker), and reports every call to the bench's named
:class:`~raykv.bench.serve_timings.RouterTimings` actor with a fire-and-forget call made after
the clock stops. Queue-length probes and the rest of Serve's routing loop are outside the
clock, for every router alike.

Two kinds of deployments (:mod:`actors.bench.serve`):

- **shared engines** (the default): one deployment of plain engines serves the ``pow2`` and
  ``prefix-affinity`` phases, one of raykv engines the ``raykv`` and ``raykv-pow2`` phases. Each
  request carries its phase in its ``cache_salt`` (:func:`phase_salt`), which also keeps the
  phases' cached blocks apart in vLLM's prefix cache and in raykv. :class:`PlainPhaseRouter` is
  Ray's ``PrefixCacheAffinityRouter``; for a ``pow2`` request it runs Serve's power of two
  choices instead (``PowerOfTwoChoicesRequestRouter.choose_replicas``, the very call the affinity
  router makes for its own fallback) and leaves its prefix tree alone. :class:`RaykvPhaseRouter`
  is raykv's ``CacheAwareRouter`` with Serve's locality and multiplex mixins (the state Serve's
  power of two choices reads); for a ``raykv-pow2`` request it runs Serve's power of two choices
  and leaves raykv's router state alone.
- **separate engines**: each config its own deployment, routed by the class itself:
  :class:`TimedPow2Router`, :class:`TimedPrefixAffinityRouter`, :class:`TimedCacheAwareRouter`.

The routers run where the deployment's handle is called, the OpenAI ingress replica, so this
module is imported there by path (:data:`actors.bench.serve.ROUTERS`). ``request_router_kwargs`` carries
``bench_name`` (the config's name, for the separate kind) and ``bench_namespace`` (where the
timings actor lives), removed before the router's own ``initialize_state`` sees them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin
from ray.serve.llm.request_router import PrefixCacheAffinityRouter

from actors.serve.router import CacheAwareRouter
from raykv.bench.serve_timings import TIMINGS_ACTOR, policy_of, salt_phase


def phase_of(pending_request: Any) -> str | None:
    """The phase a request's ``cache_salt`` names (None: not a bench request)."""
    if pending_request is None:
        return None
    for source in (*pending_request.args, *pending_request.kwargs.values()):
        salt = (
            source.get("cache_salt") if isinstance(source, Mapping) else getattr(source, "cache_salt", None)
        )
        phase = salt_phase(salt)
        if phase is not None:
            return phase
    return None


class TimedRouter:
    """Mixin in front of a ``RequestRouter`` subclass (module docstring). ``_name`` gives the
    name a request's timings are filed under: its warm-up phase, else the config's name (separate
    engines), else its phase. Counters (raykv's) are the router's totals when it reported: the
    bench subtracts those the warm-up left."""

    _bench_name: str = ""
    _bench_namespace: str = ""
    _bench_actor: Any = None
    _bench_lookup_at: float = 0.0

    def _bench_init(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self._bench_name = str(kwargs.pop("bench_name", "") or "")
        self._bench_namespace = str(kwargs.pop("bench_namespace", "") or "")
        return kwargs

    def _name(self, pending_request: Any) -> str:
        phase = phase_of(pending_request)
        if phase is not None and phase.startswith("warmup-"):
            return phase
        return self._bench_name or phase or "other"

    def _timings(self) -> Any:
        if self._bench_actor is None and time.monotonic() >= self._bench_lookup_at:
            self._bench_lookup_at = time.monotonic() + 5.0
            try:
                self._bench_actor = ray.get_actor(TIMINGS_ACTOR, namespace=self._bench_namespace or None)
            except ValueError:
                self._bench_actor = None
        return self._bench_actor

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return await self._choose(candidate_replicas, pending_request)
        finally:
            seconds = time.perf_counter() - start
            actor = self._timings()
            if actor is not None:
                name = self._name(pending_request)
                rid = None if pending_request is None else str(pending_request.metadata.internal_request_id)
                actor.add.remote(name, seconds, rid)
                counters = self._bench_counters(name)
                if counters is not None:
                    actor.set_counters.remote(name, counters)

    async def _choose(self, candidate_replicas: list[Any], pending_request: Any) -> Any:
        return await super().choose_replicas(candidate_replicas, pending_request)  # type: ignore[misc]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        start = time.perf_counter()
        try:
            self._routed(pending_request, replica_id, result)
        finally:
            seconds = time.perf_counter() - start
            actor = self._timings()
            if actor is not None:
                replica = str(getattr(replica_id, "unique_id", replica_id))
                actor.add_routed.remote(self._name(pending_request), seconds, replica)

    def _routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)  # type: ignore[misc]

    def _bench_counters(self, name: str) -> dict[str, int] | None:
        return None


async def _serve_pow2(router: Any, candidate_replicas: list[Any], pending_request: Any) -> Any:
    """Serve's power of two choices, run on ``router`` (which has Serve's locality and multiplex
    mixins, as ``PowerOfTwoChoicesRequestRouter`` does)."""
    return await PowerOfTwoChoicesRequestRouter.choose_replicas(router, candidate_replicas, pending_request)


# ---- shared engines: one router per deployment, the policy picked by the request's phase --------
class PlainPhaseRouter(TimedRouter, PrefixCacheAffinityRouter):  # type: ignore[misc]
    """Plain engines: ``prefix-affinity`` requests by Ray's PrefixCacheAffinityRouter, every
    other request by Serve's power of two choices (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**self._bench_init(kwargs))

    async def _choose(self, candidate_replicas: list[Any], pending_request: Any) -> Any:
        if policy_of(phase_of(pending_request)) == "prefix-affinity":
            return await PrefixCacheAffinityRouter.choose_replicas(self, candidate_replicas, pending_request)
        return await _serve_pow2(self, candidate_replicas, pending_request)

    def _routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        if policy_of(phase_of(pending_request)) == "prefix-affinity":
            PrefixCacheAffinityRouter.on_request_routed(self, pending_request, replica_id, result)


class RaykvPhaseRouter(TimedRouter, LocalityMixin, MultiplexMixin, CacheAwareRouter):  # type: ignore[misc]
    """raykv engines: ``raykv`` requests by raykv's CacheAwareRouter, every other request by
    Serve's power of two choices (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:  # type: ignore[override]
        CacheAwareRouter.initialize_state(self, **self._bench_init(kwargs))

    async def _choose(self, candidate_replicas: list[Any], pending_request: Any) -> Any:
        if policy_of(phase_of(pending_request)) == "raykv":
            return await CacheAwareRouter.choose_replicas(self, candidate_replicas, pending_request)
        return await _serve_pow2(self, candidate_replicas, pending_request)

    def _routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        if policy_of(phase_of(pending_request)) == "raykv":
            CacheAwareRouter.on_request_routed(self, pending_request, replica_id, result)

    def _bench_counters(self, name: str) -> dict[str, int] | None:
        ranker = getattr(self, "ranker", None)
        return None if ranker is None or policy_of(name) != "raykv" else dict(ranker.counters)


# ---- separate engines: each config its own deployment and router ---------------------------------
class TimedPow2Router(TimedRouter, PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Serve's default router (power of two choices), timed."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**self._bench_init(kwargs))


class TimedPrefixAffinityRouter(TimedRouter, PrefixCacheAffinityRouter):  # type: ignore[misc]
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``, timed."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**self._bench_init(kwargs))


class TimedCacheAwareRouter(TimedRouter, CacheAwareRouter):  # type: ignore[misc]
    """raykv's ``CacheAwareRouter``, timed; also reports its decision counters."""

    def initialize_state(self, **kwargs: Any) -> None:  # type: ignore[override]
        super().initialize_state(**self._bench_init(kwargs))

    def _bench_counters(self, name: str) -> dict[str, int] | None:
        ranker = getattr(self, "ranker", None)
        return None if ranker is None else dict(ranker.counters)


class LocalModelCallback(CallbackBase):  # type: ignore[misc]
    """Ray Serve LLM's per-replica init callback for a model in a local directory: skip the
    model download tasks (each a new worker process: ~10 CPU-seconds on a small VM); with
    ``callback_kwargs={"nice": n}``, lower the replica's CPU priority by ``n`` before its engine
    starts (the engine's processes inherit it)."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False
        nice = int(self.kwargs.get("nice", 0) or 0)
        if nice:
            os.nice(nice)

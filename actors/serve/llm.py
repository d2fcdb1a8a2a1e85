"""raykv in Ray Serve LLM (``ray.serve.llm``, Ray 2.60): vLLM replicas with RaykvConnector,
routed by raykv's CacheAwareRouter.

:func:`with_raykv` turns a user's ``LLMConfig`` into one whose

- engine loads and stores KV through :class:`raykv.integrations.vllm.RaykvConnector`
  (``engine_kwargs["kv_transfer_config"]``; the user's ``kv_connector_extra_config`` keys are
  kept, raykv's are added);
- replicas each pair with one CacheWorker of the raykv deployment (``pool[rank % len(pool)]``,
  as :class:`actors.serve.deployments.ReplicaCache` does) through :class:`RaykvConnectorBackend`, Ray
  Serve LLM's per-replica connector hook, which runs before the engine starts and hands the
  worker and the cluster address to the engine's connector;
- server class is :class:`RaykvLLMServer`, which announces the worker to routers
  (``record_replica_metadata`` / ``record_routing_stats``, field ``raykv_worker``) with the
  prompt tokens it has in flight that its worker does not hold, its engine's pull and prefill
  times (``raykv_timing``: totals the engine's connector hands the worker, streamed responses
  included, read back from the worker each time Serve asks for the stats), and, for a role
  whose connector loads KV (``kv_both``, ``kv_consumer``), ``raykv_pulls``: the engine fetches
  a hit another worker holds, so the router prices those blocks as pulls rather than recomputes;
- deployment routes with :class:`actors.serve.router.CacheAwareRouter` (``request_router_config``), which
  runs where the deployment's handle is called (the OpenAI ingress) and reads the token ids of a
  ``/v1/completions`` request (``prompt`` as a list of ids), or renders a chat request's messages
  or a text prompt to the ids the engine will see with the model's own tokenizer and chat
  template (:mod:`actors.serve.prompts`). A request it cannot render is routed by load.

Build the app with Ray's own builders: ``build_openai_app({"llm_configs": [with_raykv(cfg)]})``.
For prefill/decode, ``build_pd_openai_app`` with ``with_raykv(prefill, role="kv_producer",
pool=...)`` and ``with_raykv(decode, role="kv_consumer", pool=...)``: Ray's PD servers replace
the server class (the prefill server announces the backend's worker itself), the prefill
deployment routes by cache, and the decode engine's connector reads the prefill worker and block
count from the ``kv_transfer_params`` Ray's PD proxy forwards and pulls those blocks into its own
worker.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    DefaultPDProtocolMixin,
)

from actors.serve.deployments import NoWorkerOnNode, ReplicaCache
from actors.serve.prompts import RequestTokens, renderable, tokenizer_source
from actors.serve.routed import RoutedRequest, parse_request, routed_request
from actors.serve.router import router_config
from raykv.core.errors import ConfigError
from raykv.integrations.vllm.link import DISABLED_KEY

log = logging.getLogger(__name__)

CONNECTOR = "RaykvConnector"
CONNECTOR_MODULE = "raykv.integrations.vllm"
ROLES = ("kv_both", "kv_producer", "kv_consumer")
LOADING_ROLES = ("kv_both", "kv_consumer")  # roles whose connector loads (and pulls remote hits)
POOL_KEY = "raykv_pool"  # kv_connector_extra_config key: the workers this deployment pairs with
_REPLICA_CACHE: ReplicaCache | None = None
"""This replica's pairing and load numbers (a Serve replica is one process). Ray serializes the
LLMConfig, which holds the backend, so the backend keeps only the worker's name."""
_REPLICA_PROMPTS: RequestTokens | None = None
"""Renders this replica's chat and text requests to count their prompt tokens in its load."""


def with_raykv(
    llm_config: Any,
    namespace: str = "raykv",
    role: str = "kv_both",
    pool: Sequence[str | int] | None = None,
    router: Mapping[str, Any] | None = None,
    **extra: Any,
) -> Any:
    """A copy of ``llm_config`` (a ``ray.serve.llm.LLMConfig``) served with raykv (module doc).

    ``role``: vLLM's kv_role; ``pool``: worker names or indices this deployment's replicas pair
    with (default: every worker); ``router``: keyword arguments of
    :func:`actors.serve.router.router_config` (``routing``, ``time_budget_s``, ``render_budget_s``, ...;
    ``tokenizer`` defaults to the config's tokenizer or model source, from which the router
    renders chat and text requests to token ids; None turns that off); ``extra``: more
    ``kv_connector_extra_config`` keys (``inbox_bytes``, ``timeout_s``, ...). ConfigError for a
    bad role, or when the config already names another connector or server class. The original
    is not changed.
    """
    if role not in ROLES:
        raise ConfigError("role", f"must be one of {ROLES}, got {role!r}")
    engine_kwargs = copy.deepcopy(dict(llm_config.engine_kwargs or {}))
    transfer = engine_kwargs.get("kv_transfer_config") or {}
    if not isinstance(transfer, Mapping):
        raise ConfigError("kv_transfer_config", "must be a dict in engine_kwargs")
    if transfer.get("kv_connector", CONNECTOR) != CONNECTOR:
        raise ConfigError("kv_transfer_config", f"already names {transfer['kv_connector']!r}")
    if llm_config.server_cls not in (None, RaykvLLMServer):
        raise ConfigError("server_cls", f"already set to {llm_config.server_cls!r}")
    user_extra = dict(transfer.get("kv_connector_extra_config") or {})
    user_extra.update(extra, namespace=namespace)
    if pool is not None:
        user_extra[POOL_KEY] = [str(w) if isinstance(w, str) else int(w) for w in pool]
    engine_kwargs["kv_transfer_config"] = {
        **transfer,
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",  # a raykv failure never fails a request
        "kv_connector_extra_config": user_extra,
    }
    register_backend()
    deployment_config = dict(llm_config.deployment_config or {})
    router_kwargs = {"tokenizer": tokenizer_source(llm_config), **dict(router or {})}
    deployment_config["request_router_config"] = router_config(namespace, **router_kwargs)
    return llm_config.model_copy(
        update={
            "engine_kwargs": engine_kwargs,
            "server_cls": RaykvLLMServer,
            "deployment_config": deployment_config,
        }
    )


def register_backend() -> None:
    """Register :class:`RaykvConnectorBackend` as Ray Serve LLM's backend for RaykvConnector
    (once; Ray keeps it in the cluster's KV store, so replicas find it)."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if not KVConnectorBackendFactory.is_registered(CONNECTOR):
        KVConnectorBackendFactory.register_backend(CONNECTOR, f"{__name__}:RaykvConnectorBackend")


class RaykvConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):  # type: ignore[misc]
    """Ray Serve LLM's per-replica side of RaykvConnector (every server class: ``LLMServer``,
    the PD prefill and decode servers).

    :meth:`setup` runs in the replica before its engine starts: it pairs the replica with one
    CacheWorker on its own Ray node (:func:`actors.serve.deployments.pair_on_node`: rotated by replica
    rank, a worker free or serving the same model first) and writes that worker and the
    cluster's address into the connector's ``kv_connector_extra_config`` (``worker``,
    ``ray_address``); on a node without a worker it logs one warning and the engine runs
    without raykv (the connector's ``disabled``). Raises
    what :func:`actors.cache.cluster.connect` raises when the raykv deployment is not up (the replica
    then fails to start, and Serve retries it). :meth:`replica_metadata` announces the worker
    to routers (``raykv_worker``) and whether its connector loads, pulling remote hits
    (``raykv_pulls``). P/D requests follow Ray's default protocol: the decode
    request carries the prefill response's ``kv_transfer_params``, in which RaykvConnector put
    the prefill worker and block count.
    """

    worker: str | None = None
    pulls: bool = False

    def setup(self) -> None:
        global _REPLICA_CACHE, _REPLICA_PROMPTS
        extra = self.kv_transfer_config.setdefault("kv_connector_extra_config", {})
        namespace = str(extra.get("namespace", "raykv"))
        pool = extra.pop(POOL_KEY, None)
        try:
            cache = ReplicaCache(namespace, pool=pool, model=str(self.llm_config.model_id))
        except NoWorkerOnNode as exc:
            log.warning("raykv: %s; this replica's engine runs without raykv", exc)
            extra[DISABLED_KEY] = True  # the connector does nothing rather than store into nothing
            _REPLICA_CACHE = None
            return
        # a consumer's connector loads KV, fetching what another worker holds (vLLM's is_kv_consumer)
        cache.pulls = self.pulls = self.kv_transfer_config.get("kv_role") in LOADING_ROLES
        _REPLICA_CACHE = cache  # the replica's process state; the backend itself stays picklable
        _REPLICA_PROMPTS = RequestTokens(tokenizer_source(self.llm_config), eager=False)
        self.worker = str(cache.worker_id)
        extra["worker"] = self.worker
        extra["engine"] = cache.engine  # the engine binds and reports timing to the worker under this name
        extra["model_name"] = str(self.llm_config.model_id)  # as the replica claimed the worker
        extra["ray_address"] = str(ray.get_runtime_context().gcs_address)
        log.info("raykv: replica paired with %s", self.worker)

    def replica_metadata(self) -> dict[str, Any]:
        """The worker, whether the engine pulls, and the engine's keys (Ray Serve LLM asks once the
        engine started, so it has bound to its worker: a PD prefill router keys requests with
        them)."""
        cache = _REPLICA_CACHE
        if self.worker is None or cache is None:
            return {}
        cache.refresh_keys_now()
        return cache.metadata()


class RaykvLLMServer(LLMServer):  # type: ignore[misc]
    """Ray Serve LLM's ``LLMServer`` that announces its raykv worker to routers (replica
    metadata and routing stats, with the prompt tokens it has in flight); the pairing itself is
    :class:`RaykvConnectorBackend`'s."""

    def _cache(self) -> ReplicaCache | None:
        return _REPLICA_CACHE

    async def record_replica_metadata(self) -> dict[str, Any]:
        cache = self._cache()
        if cache is None:
            return {}
        await cache.refresh_keys()  # the engine started, so it bound to its worker
        return cache.metadata()

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats() or {})
        cache = self._cache()
        if cache is not None:
            await cache.refresh_timing()
            await cache.refresh_keys()
            stats.update(cache.routing_stats())
        return stats

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        """vLLM's completions, with the request counted in the replica's load while it runs
        (:meth:`_counting`: the router's load signal)."""
        stream = await super().completions(request, raw_request_info)
        return self._counting(stream, request)

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        """vLLM's chat completions, counted in the replica's load as :meth:`completions`."""
        stream = await super().chat(request, raw_request_info)
        return self._counting(stream, request)

    @staticmethod
    def _prompt(request: Any) -> asyncio.Future[RoutedRequest | None]:
        """The request's token ids and scope as the router reads them: given (a done future),
        else rendered (chat messages, a text prompt) with the model's tokenizer; None when
        neither."""
        routed = parse_request((request,), {})
        prompts = _REPLICA_PROMPTS
        if routed is not None or prompts is None or renderable((request,), {}) is None:
            done: asyncio.Future[RoutedRequest | None] = asyncio.get_running_loop().create_future()
            done.set_result(routed)
            return done

        async def render() -> RoutedRequest | None:
            assert prompts is not None
            ids = await prompts.tokens(request)
            return routed_request(request, ids) if ids else None

        return asyncio.ensure_future(render())

    async def _counting(self, stream: AsyncIterator[Any], request: Any) -> AsyncIterator[Any]:
        """``stream`` as it is, while the replica counts the request in its load: its prompt's
        tokens as queued prefill (once known: rendering a chat runs beside the request, which
        does not wait for it), less the leading blocks its paired worker turns out to hold
        (probed beside the request too: the engine loads those blocks, so the report stays in
        the units the router counts, tokens to compute) until its first streamed chunk (a whole
        response ends the request), and one running decode."""
        cache = self._cache()
        if cache is None:
            async for item in stream:
                yield item
            return
        with cache.prefilling(0) as queued, cache.decoding():
            known = self._prompt(request)
            probe: list[asyncio.Future[int]] = []

            def prompt_known(task: asyncio.Future[RoutedRequest | None]) -> None:
                routed = None if task.cancelled() or task.exception() else task.result()
                if routed is None or queued.done:
                    return
                queued.add(len(routed.tokens))
                usable = len(routed.tokens) - 1  # the engine computes the last token in any case
                tpb = cache.tokens_per_block

                def found(held: asyncio.Future[int]) -> None:
                    if not held.cancelled() and held.exception() is None:
                        queued.lower(min(usable, held.result() * tpb))

                probe.append(asyncio.ensure_future(cache.held(routed.tokens, routed.scope)))
                probe[0].add_done_callback(found)

            if known.done():  # token ids given: counted at once
                prompt_known(known)
            else:
                known.add_done_callback(prompt_known)
            try:
                async for item in stream:
                    if isinstance(item, str):  # a streamed chunk: the prompt was computed
                        queued.finish()
                    yield item
            finally:
                for task in (known, *probe):
                    task.cancel()

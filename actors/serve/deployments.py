"""The deployments' side of raykv in Ray Serve: model replicas and PD proxies.

- :class:`ReplicaCache`: a model replica's paired CacheWorker (``pool[rank % len(pool)]``, see
  :mod:`actors.serve.router`), page moves between them as ExportedBlock records, and the load numbers
  the replica reports through ``record_routing_stats``.
- :class:`PDPairer`: a prefill/decode proxy's choice of (prefill worker, decode worker) by cache
  location (:func:`raykv.routing.pd.choose_pair`) and the load it has in flight.

Everything here degrades instead of failing a request: a fetch that fails returns no blocks (the
model recomputes), a store or pull that fails stores nothing, a slow index means load-only
pairing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from actors.cache.liveness import Pinger
from actors.serve.fields import CAPACITY_FIELD, KEYS_FIELD, PULLS_FIELD, TIMING_FIELD, WORKER_FIELD
from actors.serve.ranking import IndexLink, connect_index
from actors.serve.routed import RoutedRequest
from raykv.core.errors import ConfigError
from raykv.core.keys import ReuseScope
from raykv.core.records import ExportedBlock
from raykv.core.types import WorkerId
from raykv.core.warn_every import WarnEvery
from raykv.index.prefix_index import RouteMatch
from raykv.integrations.hf import leading_blocks
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.pd import PDConfig, PDDecision, choose_pair, pd_policy
from raykv.routing.policy import DEFAULT_ROUTING, WorkerLoad
from raykv.routing.session_keys import SessionKeys

log = logging.getLogger(__name__)


def replica_rank() -> int:
    """This Serve replica's rank (0..N-1). Raises RayServeException outside a replica."""
    from ray import serve

    rank: Any = serve.get_replica_context().rank
    return int(getattr(rank, "rank", rank) or 0)


def pool_names(workers: Sequence[str], pool: Sequence[str | int]) -> list[str]:
    """The worker names of ``pool``: names, or indices into ``workers`` (the deployment's).
    ConfigError naming ``pool`` for an index out of range or an unknown name."""
    names = []
    for item in pool:
        if isinstance(item, int) and not isinstance(item, bool):
            if not 0 <= item < len(workers):
                raise ConfigError("pool", f"index {item} out of range ({len(workers)} workers)")
            names.append(workers[item])
        elif str(item) in workers:
            names.append(str(item))
        else:
            raise ConfigError("pool", f"{item!r} is none of {list(workers)}")
    return names


class NoWorkerOnNode(Exception):
    """No worker of the pool runs on the replica's node (:func:`pair_on_node`)."""


def pair_on_node(cluster: Any, names: Sequence[str], engine: str, model: str, rank: int) -> str:
    """The worker of ``names`` a replica running ``model`` pairs with: one on the replica's own
    Ray node (the engine maps its worker's inbox and host tier: same-node paths need it),
    rotated by ``rank`` (the replica's); among those, first one it can claim for ``model``
    (``CacheWorker.claim_engine``: free, or serving ``model`` already), else one serving other
    models (it shares when their layouts agree). NoWorkerOnNode when the node has none."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    handles = cluster.workers
    known = [n for n in names if WorkerId(n) in handles]
    bindings = ray.get([handles[WorkerId(n)].binding.remote() for n in known], timeout=cluster.call_timeout_s)
    local = [n for n, b in zip(known, bindings) if b.get("node_id") == node]
    if not local:
        raise NoWorkerOnNode(f"no raykv worker of {list(names)} runs on node {node}")
    shift = rank % len(local)
    local = local[shift:] + local[:shift]
    for name in local:
        if ray.get(
            handles[WorkerId(name)].claim_engine.remote(engine, model), timeout=cluster.call_timeout_s
        ):
            return name
    return local[0]


class Queued:
    """One request's prompt tokens counted in its replica's ``queued_prefill_tokens`` (see
    :meth:`ReplicaCache.prefilling`)."""

    def __init__(self, cache: ReplicaCache) -> None:
        self._cache = cache
        self.left = 0
        self.done = False

    def add(self, n: int) -> None:
        if not self.done and n > 0:
            self.left += n
            self._cache.queued_prefill_tokens += n

    def lower(self, n: int) -> None:
        n = max(0, min(n, self.left))
        self.left -= n
        self._cache.queued_prefill_tokens -= n

    def finish(self) -> None:
        self.lower(self.left)
        self.done = True


class ReplicaCache:
    """A Serve replica's side of raykv: its paired CacheWorker, page moves and load numbers.

    ``worker`` names the worker explicitly; given ``model`` (the replica's model, a name), the
    replica pairs on its own node (:func:`pair_on_node`; NoWorkerOnNode when its node has no
    worker of ``pool``); otherwise it takes ``pool[rank % len(pool)]`` (``pool``: every worker
    of the deployment by default). Every async method has a
    ``timeout_s`` bound and degrades instead of raising: a fetch that fails returns no blocks (the
    model recomputes), a store or pull that fails stores nothing.
    """

    model: bytes | None = None
    """The model fingerprint in the keys of this replica's engine, once its engine bound to its
    worker (:meth:`refresh_keys`; routers key requests with it)."""

    def __init__(
        self,
        namespace: str = "raykv",
        pool: Sequence[str | int] | None = None,
        worker: str | None = None,
        timeout_s: float = 10.0,
        model: str | None = None,
    ) -> None:
        from actors.cache.cluster import connect

        self.cluster = connect(namespace)
        everyone = [str(w) for w in self.cluster.worker_ids]
        names = pool_names(everyone, pool) if pool else everyone
        self.engine = f"replica-{uuid.uuid4().hex[:12]}"
        """The name this replica's engine binds to its worker under and reports its timing
        totals under (its connector's ``kv_connector_extra_config["engine"]``)."""
        chosen = worker or (
            pair_on_node(self.cluster, names, self.engine, model, replica_rank()) if model else None
        )
        chosen = chosen or names[replica_rank() % len(names)]
        self.worker_id = WorkerId(chosen)
        self.worker: Any = self.cluster.workers[self.worker_id]
        self.tokens_per_block = self.cluster.config.tokens_per_block
        self.timeout_s = timeout_s
        self.queued_prefill_tokens = 0
        self.running_decodes = 0
        self.pulls = False
        """Does this replica's engine pull the blocks another worker holds (the raykv vLLM
        connector with loads on)? Announced to routers, which then price such blocks as pulls."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.timing = [0, 0, 0, 0]
        """The engine's last timing totals read from the worker (:meth:`refresh_timing`)."""
        self.timing_warnings = WarnEvery(60.0)
        self.probe_warnings = WarnEvery(60.0)  # every request probes: a dead worker warns once a minute

    def metadata(self) -> dict[str, Any]:
        """For ``record_replica_metadata``: the paired worker, its capacity in blocks, whether
        the replica pulls remote hits, and the engine's keys (:data:`KEYS_FIELD`: tokens per
        block and model fingerprint, once its engine bound to the worker)."""
        keys = {KEYS_FIELD: [self.tokens_per_block, self.model.hex()]} if self.model is not None else {}
        return {
            WORKER_FIELD: str(self.worker_id),
            CAPACITY_FIELD: self.cluster.config.capacity_blocks,
            PULLS_FIELD: self.pulls,
            **keys,
        }

    def routing_stats(self) -> dict[str, Any]:
        """For ``record_routing_stats``: :meth:`metadata` and the load numbers."""
        return {
            **self.metadata(),
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "running_decodes": self.running_decodes,
            TIMING_FIELD: list(self.timing),
            "ts": time.time(),
        }

    @contextlib.contextmanager
    def prefilling(self, tokens: int) -> Iterator[Queued]:
        """Count ``tokens`` prompt tokens as queued while the block runs. Yields their
        :class:`Queued` count: ``add(n)`` more once the prompt is known, ``lower(n)`` takes up to
        ``n`` off (tokens found cached once the request started: the engine loads them, it does
        not prefill them), ``finish()`` takes all off (the prompt was computed); each a no-op once
        the block ended or ``finish`` was called."""
        queued = Queued(self)
        queued.add(tokens)
        try:
            yield queued
        finally:
            queued.finish()

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        self.running_decodes += 1
        try:
            yield
        finally:
            self.running_decodes -= 1

    async def fetch(self, keys: Sequence[bytes]) -> list[ExportedBlock]:
        """The leading cached blocks of ``keys`` from the paired worker ([] on any failure)."""
        if not keys:
            return []
        try:
            blocks = await asyncio.wait_for(self.worker.export_blocks.remote(list(keys)), self.timeout_s)
        except Exception as exc:
            self.counters["fetch_errors"] += 1
            log.warning("raykv fetch from %s failed: %s", self.worker_id, exc)
            return []
        return leading_blocks(blocks, keys)

    async def held(self, tokens: Sequence[int], scope: ReuseScope | None = None) -> int:
        """How many leading full blocks of ``tokens`` the paired worker holds, in ``scope`` (for
        the replica's engine's model when it names none) (0 on failure,
        counted as ``probe_errors`` and logged at most once a minute: every request probes)."""
        scope = scope or ReuseScope()
        if scope.model is None:
            scope = scope.with_model(self.model)
        try:
            probe = self.worker.probe.remote(list(tokens), scope.lora_id, scope.salt, scope.model)
            return int((await asyncio.wait_for(probe, self.timeout_s)).num_blocks)
        except Exception as exc:
            self.counters["probe_errors"] += 1
            if self.probe_warnings.due():
                failed = self.counters["probe_errors"]
                log.warning(
                    "raykv probe of %s failed (%d in all, one warning a minute): %s",
                    self.worker_id,
                    failed,
                    exc,
                )
            return 0

    async def refresh_timing(self) -> list[int]:
        """Read the timing totals this replica's engine last handed its paired worker
        (``CacheWorker.engine_timing``: ``[pulled tokens, pull us, prefilled tokens, prefill
        us]``, every finished request, streamed or not) into :attr:`timing` and return them. On
        failure the last totals stay, counted as ``timing_errors`` (one warning a minute)."""
        try:
            got = await asyncio.wait_for(self.worker.engine_timing.remote(self.engine), self.timeout_s)
            self.timing = [int(t) for t in got]
        except Exception as exc:
            self.counters["timing_errors"] += 1
            if self.timing_warnings.due():
                log.warning("raykv timing read from %s failed: %s", self.worker_id, exc)
        return self.timing

    def refresh_keys_now(self) -> bytes | None:
        """:meth:`refresh_keys` for synchronous callers (a connector backend's
        ``replica_metadata``, which Ray Serve LLM calls once the engine started)."""
        import ray

        if self.model is None:
            try:
                self._take_binding(ray.get(self.worker.binding.remote(), timeout=self.timeout_s))
            except Exception:
                self.counters["binding_errors"] += 1
        return self.model

    async def refresh_keys(self) -> bytes | None:
        """Until it is known, read the model fingerprint and block size the replica's engine
        bound to its worker with (``CacheWorker.binding``) into :attr:`model` and
        :attr:`tokens_per_block`; returns :attr:`model` (None before the engine bound, or on a
        failure, counted as ``binding_errors``)."""
        if self.model is not None:
            return self.model
        try:
            binding = await asyncio.wait_for(self.worker.binding.remote(), self.timeout_s)
        except Exception:
            self.counters["binding_errors"] += 1
            return None
        self._take_binding(binding)
        return self.model

    def _take_binding(self, binding: Mapping[str, Any]) -> None:
        """The fingerprint and block size this replica's engine bound with, if it did."""
        _, fingerprint = binding.get("engines", {}).get(self.engine, ("", ""))
        if fingerprint:
            self.model = bytes.fromhex(fingerprint)
            self.tokens_per_block = binding["layout"].tokens_per_block

    async def store(self, blocks: Sequence[ExportedBlock]) -> int:
        """Import ``blocks`` into the paired worker; returns how many were new (0 on failure)."""
        if not blocks:
            return 0
        try:
            result = await asyncio.wait_for(self.worker.import_blocks.remote(list(blocks)), self.timeout_s)
        except Exception as exc:
            self.counters["store_errors"] += 1
            log.warning("raykv store into %s failed: %s", self.worker_id, exc)
            return 0
        return len(result.imported)

    async def pull(self, source: WorkerId, keys: Sequence[bytes], prefer_shm: bool = True) -> tuple[int, str]:
        """Bring the blocks of ``keys`` that ``source`` holds into the paired worker.

        Uses ``CacheWorker.pull`` (the worker's page client: shared memory on one node when both
        host tiers are shared and ``prefer_shm``, else UCX); if that fails, copies worker to worker
        through Ray's object store (export, then import). Returns ``(blocks, path)``: how many
        requested blocks the paired worker now holds from this pull, and "ucx", "shm",
        "object-store", "local" (source is the paired worker) or "failed".
        """
        if not keys or source == self.worker_id:
            return 0, "local"
        try:
            outcome = await asyncio.wait_for(
                self.worker.pull.remote(str(source), list(keys), prefer_shm), self.timeout_s
            )
            self.counters[f"pull_{outcome.path}"] += 1
            return len(outcome.imported) + len(outcome.already_present), str(outcome.path)
        except Exception as exc:
            self.counters["pull_fallbacks"] += 1
            log.warning(
                "raykv pull %s -> %s failed (%s); copying through the object store",
                source,
                self.worker_id,
                exc,
            )
        try:
            source_handle: Any = self.cluster.workers[source]
            exported = source_handle.export_blocks.remote(list(keys))
            result = await asyncio.wait_for(self.worker.import_blocks.remote(exported), self.timeout_s)
        except Exception as exc:
            self.counters["pull_errors"] += 1
            log.warning("raykv pull %s -> %s failed: %s", source, self.worker_id, exc)
            return 0, "failed"
        return len(result.imported) + len(result.already_present), "object-store"


# ---- prefill/decode pairing -----------------------------------------------------------------------
class PDPairer:
    """Chooses (prefill worker, decode worker) pairs for a PD proxy from the index and the load
    this proxy has in flight on each worker. Falls back to load only when the index is slow.

    The prefill side is decided by one :class:`~raykv.routing.adaptive.RoutingPolicy` per block
    size over ``config``'s routing (default :data:`~raykv.routing.policy.DEFAULT_ROUTING`), which
    learns its prices from every pairing; prompts are keyed through
    :class:`~raykv.routing.session_keys.SessionKeys` (a request's ``session`` reuses its previous
    prompt's keys), as the Serve router keys them.

    Only live workers are paired: ``liveness`` (default: a :class:`actors.cache.liveness.Pinger` over
    these workers, started here) drops a worker whose ping failed or stayed unanswered for
    ``PING_LATE_S`` and takes it back after a good one; when no worker of a role is live, every
    worker of that role stays a candidate. ``close()`` stops the default pinger.
    """

    def __init__(
        self,
        prefill_workers: Sequence[str],
        decode_workers: Sequence[str],
        namespace: str = "raykv",
        config: PDConfig | None = None,
        nodes: Mapping[str, str] | None = None,
        time_budget_s: float = 0.05,
        seed: int = 0,
        liveness: Pinger | None = None,
    ) -> None:
        self.prefill = [WorkerId(w) for w in prefill_workers]
        self.decode = [WorkerId(w) for w in decode_workers]
        names = dict.fromkeys(str(w) for w in (*self.prefill, *self.decode))
        self._own_pinger = liveness is None
        self.liveness = (liveness or Pinger(namespace, dict.fromkeys(names))).start()
        self.config = config
        self.nodes = {WorkerId(k): v for k, v in (nodes or {}).items()}
        self.link = IndexLink(lambda: connect_index(namespace), 5.0)
        self.time_budget_s = time_budget_s
        self.rng = random.Random(seed)
        self.queued: collections.Counter[WorkerId] = collections.Counter()
        self.decodes: collections.Counter[WorkerId] = collections.Counter()
        self._policies: dict[int, tuple[PDConfig, RoutingPolicy]] = {}
        self._session_keys: dict[int, SessionKeys] = {}

    def policy(self, tokens_per_block: int) -> tuple[PDConfig, RoutingPolicy]:
        """The pairing config and the prefill side's policy (with its learned prices) for
        deployments of ``tokens_per_block``."""
        got = self._policies.get(tokens_per_block)
        if got is None:
            base = self.config or PDConfig(DEFAULT_ROUTING)
            cfg = replace(base, routing=replace(base.routing, tokens_per_block=tokens_per_block))
            got = self._policies[tokens_per_block] = (cfg, pd_policy(cfg))
        return got

    async def pair(self, request: RoutedRequest) -> PDDecision:
        """The pair for ``request`` (credits the prefill worker with the prompt's blocks; the
        prefill side's policy learns from it). ValueError for tokens that cannot be keyed."""
        view = await self.link.get(self.time_budget_s)
        tpb = view.tokens_per_block if view is not None else 16
        sessions = self._session_keys.get(tpb)
        if sessions is None:
            sessions = self._session_keys[tpb] = SessionKeys(tpb)
        keys = sessions.keys(request.tokens, request.scope, request.session)
        matches: Mapping[WorkerId, RouteMatch] = {}
        if view is not None:
            try:
                budget = self.time_budget_s
                route = view.index.route_async(keys, budget_ms=budget * 1e3)  # merges what answers in time
                matches = await asyncio.wait_for(route, budget + 0.05)
            except Exception:
                self.link.failed()
        cfg, policy = self.policy(tpb)
        pre = [WorkerLoad(w, self.queued[w], self.decodes[w]) for w in self.live(self.prefill)]
        dec = [WorkerLoad(w, self.queued[w], self.decodes[w]) for w in self.live(self.decode)]
        decision = choose_pair(len(request.tokens), pre, dec, matches, cfg, self.nodes, self.rng, policy)
        if view is not None and keys:
            view.index.predict(decision.prefill, keys)
        return decision

    def live(self, workers: Sequence[WorkerId]) -> list[WorkerId]:
        """The live ones of ``workers`` (all of them when none is live); reads state only."""
        usable = self.liveness.workers.usable(workers, time.monotonic())
        return [WorkerId(w) for w in usable] or list(workers)

    def close(self) -> None:
        """Stop the pinger this pairer started (one passed in stays with its owner)."""
        if self._own_pinger:
            self.liveness.close()

    @contextlib.contextmanager
    def running(self, decision: PDDecision, num_tokens: int) -> Iterator[None]:
        """Count a request against its pair's load while it runs."""
        self.queued[decision.prefill] += num_tokens
        self.decodes[decision.decode] += 1
        try:
            yield
        finally:
            self.queued[decision.prefill] -= num_tokens
            self.decodes[decision.decode] -= 1

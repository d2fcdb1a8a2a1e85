"""Bring a raykv deployment up on a Ray cluster (or an embedded local one), or attach to it.

``start()`` creates, in one Ray namespace, named detached actors: a registry (the deployment's
spec), ``index_shards`` IndexShard actors and one CacheWorker per GPU (or ``num_workers`` CPU
workers; ``worker_class`` picks a CacheWorker subclass, e.g. the testing one). ``connect()``
attaches from any other process through those names. Starting twice in one namespace raises
StateError instead of creating a second deployment.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from actors.cache.index import IndexClient, IndexShard
from actors.cache.liveness import CALL_TIMEOUT_S, START_TIMEOUT_S, Pinger, wait
from actors.cache.settings import DeploymentConfig
from actors.cache.transfer import deployment_transfer_config
from actors.cache.worker import CacheWorker
from raykv.core.config import CacheConfig, KVLayout, TierConfig
from raykv.core.errors import ConfigError, StateError, TransferError, TransferFailure, UnavailableError
from raykv.core.keys import MultimodalItem, ReuseScope, TokenSeq, block_keys
from raykv.core.stats import CacheStats
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.liveness import Health
from raykv.routing.policy import DEFAULT_ROUTING, Decision, RoutingConfig, WorkerLoad
from raykv.transfer import PullOutcome, TransferConfig

log = logging.getLogger(__name__)

REGISTRY = "raykv-registry"


@dataclass(frozen=True)
class DeploymentSpec:
    """What ``connect()`` needs to find a deployment's actors."""

    namespace: str
    config: CacheConfig
    workers: tuple[tuple[str, int], ...]  # (actor name, lane)
    shards: tuple[str, ...]
    created_at: float = field(default_factory=time.time)
    # Page transfers: the deployment-wide secret every page server checks (never printed), and
    # the transfer settings the workers started with (None: each worker binds its node's IP).
    token: bytes = field(default=b"", repr=False)
    transfer: TransferConfig | None = None
    # The cost model ``pick_worker`` uses by default (None: DEFAULT_ROUTING), and the
    # detached placement group holding one GPU bundle per worker (None: CPU workers).
    routing: RoutingConfig | None = None
    placement_group: Any = None
    # Whether each worker takes the page layout of the engines paired with it (a deployment
    # started without a layout; ``CacheWorker.bind_engine``).
    engine_layouts: bool = False
    index_capacity: int = 0  # keys expected over all shards (0: tables grow as needed)


class Registry:
    """A tiny named actor holding the DeploymentSpec."""

    def __init__(self, spec: DeploymentSpec) -> None:
        self.spec = spec

    def get(self) -> DeploymentSpec:
        return self.spec


def default_config(use_gpu: bool) -> CacheConfig:
    """A modest default: 8 layers x 8 KV heads x 128 dims, 16 tokens per block."""
    layout = KVLayout.uniform(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=16)
    tiers: tuple[TierConfig, ...] = (TierConfig.host(512 << 20), TierConfig.disk(2 << 30))
    if use_gpu:
        tiers = (TierConfig.gpu(4 << 30), *tiers)
    return CacheConfig(layout, tiers)


class RayKVCluster:
    """Handle on a running deployment: workers, the index client, routing, stats, shutdown.

    Liveness: a :class:`actors.cache.liveness.Pinger` thread pings every worker and index shard (every
    ``PING_INTERVAL_S``). ``pick_worker`` chooses among the workers that are up (a worker is down
    once a ping fails or stays unanswered for ``PING_LATE_S``, and up again after a good one, e.g.
    once Ray restarted it); ``route`` skips shards that are down. Decisions read that state and
    never wait on a ping. ``health()`` and ``unavailable`` report what is down; a worker or shard
    that could not be found when the handle was made (dead) is reported dead, not raised.
    Every blocking call waits at most ``call_timeout_s`` (``actors.cache.liveness.CALL_TIMEOUT_S``) and
    raises raykv errors, never Ray's. ``close()`` stops the thread (``shutdown()`` does too).
    """

    def __init__(self, spec: DeploymentSpec, owner: bool) -> None:
        self.spec = spec
        self.namespace = spec.namespace
        self.config = spec.config
        self.call_timeout_s = CALL_TIMEOUT_S
        self.worker_ids = [WorkerId(name) for name, _ in spec.workers]
        self._policies: dict[RoutingConfig, RoutingPolicy] = {}
        self.liveness = Pinger(
            spec.namespace,
            {n: _lookup(n, spec.namespace) for n, _ in spec.workers},
            {n: _lookup(n, spec.namespace) for n in spec.shards},
        )
        now = time.monotonic()
        for kind, names in ((self.liveness.workers, self.worker_ids), (self.liveness.shards, spec.shards)):
            for name in names:
                if self.liveness.handle(name) is None:
                    kind.failed(name, now, dead=True)
        self.liveness.start()
        self.shards = [self.liveness.handle(n) for n in spec.shards]
        self.index = IndexClient(
            self.shards,
            {lane: WorkerId(n) for n, lane in spec.workers},
            names=spec.shards,
            liveness=self.liveness.shards,
            timeout_s=self.call_timeout_s,
        )
        self._owner = owner

    @property
    def workers(self) -> dict[WorkerId, Any]:
        """Actor handles of the workers that exist (a dead worker found at connect has none)."""
        handles = {w: self.liveness.handle(w) for w in self.worker_ids}
        return {w: h for w, h in handles.items() if h is not None}

    def health(self) -> dict[str, dict[str, str]]:
        """``{"workers": {name: health}, "shards": {name: health}}``, each health one of "up",
        "late", "unreachable", "dead" (:class:`raykv.routing.liveness.Health`) as pinged now."""
        now = time.monotonic()
        kinds = {"workers": self.liveness.workers, "shards": self.liveness.shards}
        return {kind: {t: str(live.health(t, now)) for t in live.targets} for kind, live in kinds.items()}

    @property
    def unavailable(self) -> list[str]:
        """Names of the workers and shards that are not up right now (see :meth:`health`)."""
        now = time.monotonic()
        return [*self.liveness.workers.down(now), *self.liveness.shards.down(now)]

    def live_workers(self) -> list[WorkerId]:
        """The workers routing may use now: those up, else those not dead ([] if all are dead)."""
        return [WorkerId(w) for w in self.liveness.workers.usable(self.worker_ids, time.monotonic())]

    def keys(
        self, tokens: TokenSeq, scope: ReuseScope | None = None, mm_items: Sequence[MultimodalItem] = ()
    ) -> list[bytes]:
        """Block keys for this deployment's tokens_per_block (ValueError for bad tokens). The keys
        of a vLLM engine's blocks carry its model fingerprint and block size (in a deployment
        started without a layout, the engine's, not this default): :meth:`route_keys` takes
        those keys as they are."""
        return list(block_keys(tokens, self.config.tokens_per_block, scope, mm_items))

    def route(self, tokens: TokenSeq, scope: ReuseScope | None = None) -> dict[WorkerId, RouteMatch]:
        """Per worker, the cached prefix of ``tokens`` (workers with none are omitted). Returns
        within ``call_timeout_s``; a shard that is down or late answers for none of its keys (see
        :meth:`IndexClient.route`)."""
        return self.index.route(self.keys(tokens, scope))

    def route_keys(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]:
        return self.index.route(keys)

    def route_many(self, queries: Sequence[Sequence[bytes]]) -> list[dict[WorkerId, RouteMatch]]:
        """:meth:`route_keys` of several key lists, one index call per shard."""
        return self.index.route_many(queries)

    def pick_worker(
        self,
        tokens: TokenSeq,
        scope: ReuseScope | None = None,
        loads: Sequence[WorkerLoad] | None = None,
        routing: RoutingConfig | None = None,
    ) -> Decision:
        """Route with the routing policy and credit the chosen worker with the request's blocks.

        ``routing`` defaults to the deployment's (``start(routing=...)``), else
        :data:`~raykv.routing.policy.DEFAULT_ROUTING` (with this deployment's block size); each
        configuration keeps one :class:`~raykv.routing.adaptive.RoutingPolicy`, whose prices learn
        from these decisions. ``loads`` defaults to every worker idle. Only live workers are candidates
        (:meth:`live_workers`; a load for a worker not in the deployment is kept as given). The
        credit (a predicted index entry with a short TTL) makes parallel requests with the same
        prefix follow the first one before its events arrive. Returns within ``call_timeout_s``.
        Raises ValueError for bad tokens, UnavailableError when every candidate is dead.
        """
        keys = self.keys(tokens, scope)
        matches = self.index.route(keys)
        cfg = (
            routing
            or self.spec.routing
            or replace(DEFAULT_ROUTING, tokens_per_block=self.config.tokens_per_block)
        )
        policy = self._policies.get(cfg)
        if policy is None:
            policy = self._policies[cfg] = RoutingPolicy(cfg)
            for worker in self.worker_ids:  # every worker runs this deployment's config
                policy.observe_capacity(worker, self.config.capacity_blocks)
        cands = list(loads) if loads is not None else [WorkerLoad(w) for w in self.worker_ids]
        known = set(self.worker_ids)
        usable = set(
            self.liveness.workers.usable([c.worker for c in cands if c.worker in known], time.monotonic())
        )
        live = [c for c in cands if c.worker in usable or c.worker not in known]
        if not live:
            names = tuple(str(c.worker) for c in cands)
            raise UnavailableError(f"no live worker among {', '.join(names)}", reason="dead", actors=names)
        dw = cfg.decode_weight
        decision = policy.decide(len(tokens), [c.worker for c in live], [c.tokens(dw) for c in live], matches)
        if keys:
            self.index.predict(decision.worker, keys)
        return decision

    def flush(self) -> list[WorkerId]:
        """Publish every worker's pending events and wait until the shards applied them.

        Returns within ``call_timeout_s`` the workers that could not be flushed (dead, missing or
        no answer in time). Raises UnavailableError (``shards``: their names, ``workers``: the
        workers that could not be flushed) when a shard did not confirm a worker's events in time.
        """
        inner = max(0.1, 0.8 * self.call_timeout_s)  # the workers' wait on the shards fits in ours
        refs = {w: h.flush_and_wait.remote(inner) for w, h in self.workers.items()}
        failed = [w for w in self.worker_ids if w not in refs]
        ready, _ = (
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.call_timeout_s)
            if refs
            else ([], [])
        )
        done = set(ready)
        shards: set[str] = set()
        for worker, ref in refs.items():
            try:
                if ref not in done:
                    raise UnavailableError(f"{worker}: no answer", reason="timeout", actors=(worker,))
                ray.get(ref, timeout=self.call_timeout_s)
            except UnavailableError as exc:
                shards.update(getattr(exc, "shards", ()))
                failed.append(worker)
            except ray.exceptions.RayActorError:
                failed.append(worker)
        if shards:
            names = tuple(sorted(shards))
            raise UnavailableError(
                f"index shards {', '.join(names)} did not apply events in time",
                reason="timeout",
                actors=names,
                shards=names,
                workers=tuple(failed),
            )
        return failed

    def pull(
        self, dst: WorkerId, src: WorkerId, keys: Sequence[bytes], prefer_shm: bool = True
    ) -> PullOutcome:
        """Worker ``dst`` pulls ``keys`` from worker ``src`` (``CacheWorker.pull``).

        Raises TransferError when the pull fails, nothing imported (the caller recomputes):
        reason ``unavailable`` at once when either worker is known down or dead, ``timeout`` when
        no answer came within the transfer timeout plus ``call_timeout_s``.
        """
        now = time.monotonic()
        down = [w for w in (dst, src) if self.liveness.workers.health(w, now) is not Health.UP]
        handle = self.workers.get(dst)
        if down or handle is None:
            raise TransferError(
                f"pull {src} -> {dst}: {', '.join(down or [dst])} down", reason=TransferFailure.UNAVAILABLE
            )
        limit = (self.spec.transfer or TransferConfig()).timeout_s + self.call_timeout_s
        try:
            return ray.get(handle.pull.remote(str(src), list(keys), prefer_shm), timeout=limit)  # type: ignore[no-any-return]
        except ray.exceptions.GetTimeoutError:
            raise TransferError(
                f"pull {src} -> {dst}: no answer in {limit:g}s", reason=TransferFailure.TIMEOUT
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise TransferError(f"pull {src} -> {dst}: {exc}", reason=TransferFailure.UNAVAILABLE) from None

    def stats(self) -> dict[WorkerId, CacheStats]:
        """Stats of the workers that answered within ``call_timeout_s`` (the others are omitted)."""
        refs = {w: h.stats.remote() for w, h in self.workers.items()}
        out = {}
        for worker, ref in refs.items():
            try:
                out[worker] = wait(ref, worker, self.call_timeout_s)
            except UnavailableError:
                pass
        return out

    def index_info(self) -> list[dict[str, Any]]:
        """Every shard's info; UnavailableError when one is missing or does not answer in time."""
        missing = [n for n, s in zip(self.spec.shards, self.shards) if s is None]
        if missing:
            raise UnavailableError(
                f"index shards {', '.join(missing)} not found", reason="dead", actors=tuple(missing)
            )
        return wait([s.info.remote() for s in self.shards], "raykv index shards", self.call_timeout_s)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the liveness thread (the deployment keeps running). Idempotent."""
        self.liveness.close()

    def shutdown(self) -> None:
        """Stop every actor of the deployment (workers release their tiers first, removing their
        disk-tier files) and remove its placement group."""
        self.close()
        for handle in self.workers.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=START_TIMEOUT_S)
            except Exception:
                pass
        names = [n for n, _ in self.spec.workers] + list(self.spec.shards) + [REGISTRY]
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:
                pass
        if self.spec.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.spec.placement_group)
            except Exception:
                log.warning("raykv: could not remove placement group %s", self.spec.placement_group.id)


def _lookup(name: str, namespace: str) -> Any:
    """The named actor's handle, or None (logged) when it is dead or unknown."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        log.warning("raykv actor %s not found in namespace %r: reported dead", name, namespace)
        return None


def _ensure_ray(address: str | None, namespace: str) -> None:
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, namespace=namespace, log_to_driver=False)
    else:
        # "local": start an embedded instance, never attach to another one found on the machine
        ray.init(address="local", namespace=namespace, include_dashboard=False, log_to_driver=False)


def _registry_exists(namespace: str) -> bool:
    try:
        ray.get_actor(REGISTRY, namespace=namespace)
        return True
    except ValueError:
        return False


def _detached(namespace: str) -> dict[str, Any]:
    return {"namespace": namespace, "lifetime": "detached"}


PLACEMENT_MEMORY = 1
"""Bytes of Ray's ``memory`` resource each shard and CPU worker asks for: Ray ignores a soft node
affinity for an actor that asks for no resource at all (it lands on any node), and one byte
changes nothing else."""


def _spread(i: int) -> Any:
    """Scheduling for the i-th actor of a kind: round robin over the alive nodes (sorted by
    id), soft, so Ray places it elsewhere when that node cannot take it or is gone. The actor
    must ask for some resource (:data:`PLACEMENT_MEMORY`) for Ray to honor it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    return NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=True) if nodes else "DEFAULT"


def _start_shards(spec: DeploymentSpec) -> None:
    """Create the named IndexShard actors of ``spec`` (they restart without limit), spread over
    the nodes."""
    shard_cls = ray.remote(IndexShard)
    for i, name in enumerate(spec.shards):
        shard_cls.options(
            name=name,
            num_cpus=0,
            max_restarts=-1,
            max_concurrency=64,  # type: ignore[arg-type]
            memory=PLACEMENT_MEMORY,
            scheduling_strategy=_spread(i),
            **_detached(spec.namespace),
        ).remote(
            i,
            len(spec.shards),
            spec.namespace,
            spec.workers,
            capacity=-(-spec.index_capacity // len(spec.shards)),
        )


def placement_group_name(namespace: str) -> str:
    """The name of a deployment's placement group (in the namespace of the driver that made it)."""
    return f"raykv-workers-{namespace}"


def _gpu_placement_group(namespace: str, n: int, worker_resources: Sequence[dict[str, float]]) -> Any:
    """A detached placement group of ``n`` bundles ``{"GPU": 1, **worker_resources[i]}``, spread
    over the nodes as far as they allow; StateError (nothing left behind) when Ray cannot place
    it within ``START_TIMEOUT_S``."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [{"GPU": 1.0, **(dict(worker_resources[i]) if worker_resources else {})} for i in range(n)]
    name = placement_group_name(namespace)
    pg = placement_group(bundles, strategy="SPREAD", name=name, lifetime="detached")
    ready, _ = ray.wait([pg.ready()], timeout=START_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise StateError(f"raykv: Ray could not place {n} GPU bundles {bundles} in {START_TIMEOUT_S:g}s")
    return pg


def _start_workers(
    spec: DeploymentSpec,
    worker_class: type[CacheWorker],
    worker_resources: Sequence[dict[str, float]],
    max_restarts: int,
) -> None:
    """Create the named ``worker_class`` actors of ``spec``; each attaches to the shards and starts
    its page server with the deployment's token as it is constructed. GPU workers take bundle i
    of ``spec.placement_group``; CPU workers are spread over the nodes (round robin; a worker
    whose ``worker_resources`` its node lacks goes where they are)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    worker_cls = ray.remote(worker_class)
    pg = spec.placement_group
    for i, (name, lane) in enumerate(spec.workers):
        res = dict(worker_resources[i]) if worker_resources else {}
        opts: dict[str, Any] = {
            "name": name,
            "max_concurrency": 8,
            "max_restarts": max_restarts,
            "resources": res,
            "num_cpus": 0,
            **_detached(spec.namespace),
        }
        if pg is not None:
            opts["num_gpus"] = 1
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        else:
            opts["memory"] = PLACEMENT_MEMORY
            opts["scheduling_strategy"] = _spread(i)
        worker_cls.options(**opts).remote(
            name,
            lane,
            spec.config,
            attach_to=(spec.namespace, spec.shards),
            token=spec.token,
            transfer=spec.transfer,
            engine_layouts=spec.engine_layouts,
        )


def _plan_workers(num_workers: int | None, resources: Sequence[dict[str, float]]) -> tuple[int, bool]:
    """(how many workers, whether one per GPU): one per GPU of the cluster when ``num_workers`` is
    None and it has GPUs, else ``num_workers`` (default 2) CPU workers. ConfigError when
    ``resources`` (per worker) has another length."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = gpus > 0 and num_workers is None
    n = gpus if use_gpu else (num_workers if num_workers is not None else 2)
    if resources and len(resources) != n:
        raise ConfigError("worker_resources", f"has {len(resources)} entries for {n} workers")
    return n, use_gpu


def start(
    num_workers: int | None = None,
    config: CacheConfig | None = None,
    index_shards: int = 1,
    address: str | None = None,
    namespace: str = "raykv",
    worker_resources: Sequence[dict[str, float]] | None = None,
    max_restarts: int = 0,
    transfer: TransferConfig | None = None,
    worker_class: type[CacheWorker] = CacheWorker,
    routing: RoutingConfig | None = None,
    engine_layouts: bool | None = None,
    index_capacity: int = 0,
) -> RayKVCluster:
    """Start a deployment and return its handle.

    Uses the cluster at ``address`` (or RAY_ADDRESS), else an embedded local Ray. One worker per
    GPU by default (``num_gpus=1``, bundle i of a detached placement group spread over the nodes),
    else ``num_workers`` CPU workers (default 2); CPU workers and index shards go round robin
    over the nodes. ``worker_resources[i]``: custom resources of worker i (e.g. to pin it to a
    node). ``routing``: the cost model ``pick_worker`` uses by default. Arguments are checked as
    :class:`actors.cache.settings.DeploymentConfig` (ConfigError naming one). StateError if a
    deployment already runs in ``namespace`` or its GPU bundles cannot be placed. Every worker
    starts a page server checking a fresh deployment token; ``transfer`` sets where it binds and
    its limits (see ``actors.cache.transfer``). ``worker_class``: CacheWorker or a subclass taking the
    same arguments (tests, ``raykv demo`` and replays pass ``actors.testing.TestingCacheWorker``).
    ``engine_layouts`` (default: True when ``config`` is None): each worker takes the page layout
    of the vLLM engines paired with it (:meth:`actors.cache.worker.CacheWorker.bind_engine`; the
    tiers keep their capacities in bytes), so engines of any model attach without a layout
    written by hand; False: the workers keep ``config``'s layout and refuse other engines.
    ``index_capacity``: keys the index is expected to hold (shards sized up front; 0: they grow).
    """
    DeploymentConfig(
        namespace, num_workers, index_shards, max_restarts, tuple(worker_resources or ()), index_capacity
    )
    if not (isinstance(worker_class, type) and issubclass(worker_class, CacheWorker)):
        raise ValueError(f"worker_class must be CacheWorker or a subclass, got {worker_class!r}")
    _ensure_ray(address, namespace)
    if _registry_exists(namespace):
        raise StateError(
            f"a raykv deployment already runs in namespace {namespace!r}; "
            "use raykv.connect() or shut it down first"
        )
    resources = list(worker_resources or ())
    n, use_gpu = _plan_workers(num_workers, resources)
    engine_layouts = config is None if engine_layouts is None else bool(engine_layouts)
    config = config or default_config(use_gpu)
    transfer = deployment_transfer_config(transfer)
    workers = tuple((f"raykv-worker-{i}", i) for i in range(n))
    shards = tuple(f"raykv-index-{i}" for i in range(index_shards))
    pg = _gpu_placement_group(namespace, n, resources) if use_gpu else None
    spec = DeploymentSpec(
        namespace,
        config,
        workers,
        shards,
        token=secrets.token_bytes(32),
        transfer=transfer,
        routing=routing,
        placement_group=pg,
        engine_layouts=engine_layouts,
        index_capacity=index_capacity,
    )
    ray.remote(Registry).options(name=REGISTRY, num_cpus=0, **_detached(namespace)).remote(spec)  # type: ignore[arg-type]
    _start_shards(spec)
    _start_workers(spec, worker_class, resources, max_restarts)
    handle = RayKVCluster(spec, owner=True)
    wait([w.health.remote() for w in handle.workers.values()], "raykv workers", START_TIMEOUT_S)
    wait([s.ping.remote() for s in handle.shards], "raykv index shards", START_TIMEOUT_S)
    log.info("raykv deployment %r up: %d workers, %d index shards", namespace, n, index_shards)
    return handle


def connect(namespace: str = "raykv", address: str | None = None) -> RayKVCluster:
    """Attach to a running deployment (e.g. from a Serve replica).

    A degraded deployment still connects: dead workers and shards are reported (``health()``,
    ``unavailable``) and routing uses the rest. StateError if no deployment runs in
    ``namespace``; UnavailableError if its registry does not answer within ``CALL_TIMEOUT_S``.
    """
    _ensure_ray(address, namespace)
    try:
        registry = ray.get_actor(REGISTRY, namespace=namespace)
    except ValueError:
        raise StateError(f"no raykv deployment in namespace {namespace!r}") from None
    return RayKVCluster(wait(registry.get.remote(), REGISTRY), owner=False)

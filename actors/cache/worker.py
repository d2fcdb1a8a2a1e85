"""CacheWorker: one per GPU (or CPU slot). Wraps a CacheManager and publishes its events.

The same class runs in-process (tests, benchmarks: pass ``sink`` to receive event batches) and as
a Ray actor (``cluster.start`` wraps it with ``ray.remote``; the sink then sends per-shard
sub-batches to the IndexShard actors). Requests live inside the worker, addressed by a handle id.

Threading: the actor runs with several threads (publisher + calls); the manager's lock serializes
cache operations, so every method is safe to call concurrently.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from actors.cache.engines import EngineBindings
from actors.cache.metrics import METRICS_INTERVAL_S, WorkerMetrics
from actors.cache.transfer import PeerRef, WorkerTransfer
from raykv.core.config import CacheConfig, KVLayout
from raykv.core.errors import ConfigError, InvalidArgumentError, UnavailableError
from raykv.core.keys import MultimodalItem, ReuseScope
from raykv.core.kvcache import KvCache
from raykv.core.manager import CacheManager
from raykv.core.records import ExportedBlock, ImportResult, ProbeResult
from raykv.core.types import WorkerId
from raykv.index.prefix_index import EventBatch
from raykv.transfer import PeerAddress, PullOutcome, TransferConfig
from raykv.transfer.inbox import InboxCommit, Inboxes, InboxLease, InboxResult

MAX_ENGINES = 64  # engines whose timing totals a worker keeps (a replica restart is a new engine)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """Every committed block of a worker, consistent with its event stream at ``last_event_id``."""

    worker: WorkerId
    incarnation: int
    last_event_id: int
    blocks: tuple[tuple[bytes, int], ...]  # (key, tier)


class CacheWorker:
    """A CacheManager plus event publishing, request handles and block exchange."""

    def __init__(
        self,
        worker_id: str,
        lane: int,
        config: CacheConfig,
        sink: Callable[[EventBatch], None] | None = None,
        publish_interval_s: float = 0.02,
        incarnation: int | None = None,
        attach_to: tuple[str, Sequence[str]] | None = None,
        token: bytes | None = None,
        transfer: TransferConfig | None = None,
        engine_layouts: bool = False,
    ) -> None:
        self.worker_id = WorkerId(worker_id)
        self.lane = lane
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.manager = CacheManager(config)
        self._sink = sink
        self._requests: dict[int, KvCache] = {}
        self._ids = itertools.count(1)
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = publish_interval_s
        self._thread: threading.Thread | None = None
        self.published_batches = 0
        self.published_events = 0
        self._inflight: list[Any] = []
        self._shard_names: list[str] = []
        self._metrics: WorkerMetrics | None = None
        self._metrics_lock = threading.Lock()  # one export at a time: each sends a delta
        self.metrics_exports = 0
        self._engine_timing: dict[str, list[int]] = {}  # by engine, in reporting order
        self.engines = EngineBindings(engine_layouts)
        self.inboxes = Inboxes(self.manager)
        # Page transfers (actors/cache/transfer.py): a page server starts when a token is given.
        self._transfer_args = (attach_to[0] if attach_to else None, token, transfer)
        self.transfer = self._start_transfer()
        if attach_to is not None:
            self.attach(*attach_to)

    def _start_transfer(self) -> WorkerTransfer:
        """A page server and client on the current manager (the server only with a token)."""
        namespace, token, config = self._transfer_args
        transfer = WorkerTransfer(self.worker_id, self.manager, namespace)
        if token is not None:
            transfer.start(token, config)
        return transfer

    # ---- attaching to a deployment (actor mode) -----------------------------------------------
    # ---- engines (the vLLM connector pairs an engine with this worker) ---------------------------
    def bind_engine(self, engine: str, layout: KVLayout, model: str, fingerprint: str = "") -> KVLayout:
        """Pair engine ``engine`` (running ``model``, a name for messages, whose keys carry the
        model fingerprint ``fingerprint``, hex) whose pages are ``layout`` with this worker, and
        return the layout in force. A worker of a deployment
        started without a layout takes the layout of the engines paired with it: when ``layout``
        differs from its own and no other engine is bound and no request is open, it lays its
        tiers out anew for ``layout`` (the same capacities in bytes, pages derived; the blocks
        it held are dropped and it re-registers with the index under a new incarnation).
        ConfigError, under 300 characters, naming the differing fields and the fix, when the
        layouts differ otherwise (another engine's layout is in force, or the deployment was
        started with a layout); nothing changes then."""
        if self.engines.needs_relayout(engine, layout, self.manager.config.layout, model):
            if self.manager.num_open_requests:
                raise ConfigError("layout", f"{self.worker_id} has open requests; retry once they end")
            self._relayout(layout)
        self.engines.bind(engine, model, fingerprint)
        return self.manager.config.layout

    def claim_engine(self, engine: str, model: str) -> bool:
        """Reserve this worker for ``engine`` of ``model`` before the engine starts (a Serve
        replica pairing, ``actors.serve.deployments.pair_on_node``): True when no engine of another model
        is bound (``engine`` is then bound, its layout to follow in :meth:`bind_engine`)."""
        return self.engines.claim(engine, model)

    def unbind_engine(self, engine: str) -> None:
        """``engine`` (:meth:`bind_engine`) is gone: the worker may take another engine's layout;
        its inboxes close."""
        self.engines.unbind(engine)
        self.inboxes.close_engine(engine)

    def open_inboxes(self, engine: str, ranks: int, nbytes: int) -> tuple[InboxLease, ...]:
        """Lease ``engine`` one store inbox of ``nbytes`` per rank (:mod:`raykv.transfer.inbox`),
        replacing those it had. InvalidArgumentError for a bad name, rank count or size;
        OutOfMemoryError when /dev/shm cannot hold them."""
        return self.inboxes.open(engine, ranks, nbytes)

    def commit_inbox(self, commits: Sequence[InboxCommit]) -> InboxResult:
        """Commit blocks engines wrote into their inboxes (:meth:`raykv.transfer.inbox.Inboxes.commit`:
        keyed here, imported through the one commit path, slots freed)."""
        return self.inboxes.commit(commits)

    def binding(self) -> dict[str, Any]:
        """What engine pairing reads: ``layout`` (the pages in force), ``engine_layouts`` (whether
        it takes its engines' layouts), ``engines`` ({engine: (model, fingerprint hex)}) and
        ``node_id`` (its Ray node; None outside Ray)."""
        return {**self.engines.state(), "layout": self.manager.config.layout, "node_id": _node_id()}

    def _relayout(self, layout: KVLayout) -> None:
        """A new manager of ``layout`` (capacities kept), page server, incarnation and index
        registration; the old manager's blocks and queued events are dropped. When the new
        manager cannot be built, the worker goes on with an empty one of its old layout and the
        error propagates."""
        config = self.manager.config.replace(layout=layout)  # ConfigError: a tier smaller than a page
        try:
            with self._publish_lock:
                old = self.manager
                self.transfer.close()
                self.inboxes.close()  # of the old page size; engines open theirs after binding
                old.shutdown()  # first: a GPU tier's memory is freed before the new one is allocated
                try:
                    self.manager = CacheManager(config)
                except Exception:
                    self.manager = CacheManager(old.config)
                    raise
                finally:
                    self.incarnation = time.time_ns()
                    self.transfer = self._start_transfer()
                    self.inboxes = Inboxes(self.manager)
            log.info("%s: laid out for an engine's pages: %s", self.worker_id, layout)
        finally:
            if self._shard_names:
                self.attach(self._transfer_args[0] or "", self._shard_names)

    def attach(self, namespace: str, shard_names: Sequence[str]) -> None:
        """Actor mode: send events to the named IndexShard actors and register with them.

        Called from ``__init__`` through ``attach_to`` so a worker restarted by Ray re-registers
        with a new incarnation (the shards then drop the old incarnation's entries).
        """
        import ray

        from actors.cache.index import shard_sink

        shards = [ray.get_actor(name, namespace=namespace) for name in shard_names]
        self._shard_names = list(shard_names)
        sink = shard_sink(shards)

        def send(batch: EventBatch) -> None:
            self._inflight = sink(batch)

        self._sink = send
        self.enable_metrics()
        for shard in shards:
            shard.register_worker.remote(self.worker_id, self.lane, self.incarnation)
        self.start_publisher()

    def flush_and_wait(self, timeout_s: float | None = None) -> int:
        """Publish queued events and wait until every shard has applied them; returns how many.

        Waits at most ``timeout_s`` (default :data:`actors.cache.liveness.CALL_TIMEOUT_S`), then raises
        UnavailableError naming (``shards``) the shards that did not confirm in time or failed.
        """
        import ray

        from actors.cache.liveness import CALL_TIMEOUT_S

        n = self.flush_events()
        inflight = list(self._inflight)
        if not inflight:
            return n
        timeout = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        ready, _ = ray.wait(inflight, num_returns=len(inflight), timeout=timeout)
        late = [i for i, ref in enumerate(inflight) if ref not in set(ready)]
        for i, ref in enumerate(inflight):
            if i not in late:
                try:
                    ray.get(ref, timeout=timeout)
                except Exception:
                    late.append(i)
        if late:
            names = tuple(self._shard_names[i] for i in sorted(late))
            raise UnavailableError(
                f"{self.worker_id}: index shards {', '.join(names)} did not apply events within {timeout:g}s",
                reason="timeout",
                actors=names,
                shards=names,
            )
        return n

    # ---- publishing ----------------------------------------------------------------------------
    def start_publisher(self) -> None:
        """Publish events every ``publish_interval_s`` on a daemon thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._publish_loop, daemon=True, name=f"raykv-publish-{self.worker_id}"
            )
            self._thread.start()

    def _publish_loop(self) -> None:
        next_export = 0.0
        while not self._stop.wait(self._interval):
            try:
                self.flush_events()
                if self._metrics is not None and time.monotonic() >= next_export:
                    next_export = time.monotonic() + METRICS_INTERVAL_S
                    self.export_metrics()
            except Exception:
                log.exception("%s: publishing events or metrics failed", self.worker_id)

    # ---- Prometheus metrics (actors/cache/metrics.py) ------------------------------------------------
    def enable_metrics(self, backend: Any = None) -> None:
        """Export this worker's cache and page-transfer stats as Prometheus series, through
        ray.util.metrics (or ``backend``, see :class:`actors.cache.metrics.WorkerMetrics`): on the
        publisher thread every ``METRICS_INTERVAL_S`` and on :meth:`export_metrics`. Actor mode
        enables it when attaching. Idempotent: a second call keeps the first exporter."""
        with self._metrics_lock:
            if self._metrics is None:
                self._metrics = WorkerMetrics(self.worker_id, backend)

    def export_metrics(self) -> bool:
        """Push the stats' change since the last export to the series now; False when metrics
        are not enabled (nothing done)."""
        with self._metrics_lock:
            if self._metrics is None:
                return False
            self._metrics.update(self.manager.stats(), self.transfer.stats())
            self.metrics_exports += 1
            return True

    def flush_events(self) -> int:
        """Drain queued events and hand them to the sink as one batch; returns how many."""
        with self._publish_lock:
            events = self.manager.drain_events()
            if not events or self._sink is None:
                return len(events)
            batch = EventBatch.from_events(self.worker_id, self.incarnation, events)
            self._sink(batch)
            self.published_batches += 1
            self.published_events += len(events)
            return len(events)

    def snapshot(self) -> Snapshot:
        """All committed blocks with their tiers, at the current last event id."""
        with self.manager.locked():
            last = self.manager.events.last_event_id
            blocks = tuple((b.key, int(b.tier)) for b in self.manager.committed_blocks())
        return Snapshot(self.worker_id, self.incarnation, last, blocks)

    def identity(self) -> tuple[WorkerId, int, int]:
        """(worker id, lane, incarnation)."""
        return self.worker_id, self.lane, self.incarnation

    def event_position(self) -> tuple[int, int]:
        """(incarnation, id of the last event the cache emitted): an index shard that applied up
        to id A lags by ``last - A`` events (the shards' heartbeat asks this)."""
        return self.incarnation, self.manager.events.last_event_id

    # ---- engine-facing request lifecycle -------------------------------------------------------
    def create(
        self,
        tokens: Sequence[int],
        lora_id: int | None = None,
        salt: int | None = None,
        priority: int = 35,
        request_id: int | None = None,
        model: bytes | None = None,
    ) -> tuple[int, int]:
        """Open a request in scope ``(lora_id, salt, model)``; returns (handle,
        num_reused_tokens)."""
        cache = self.manager.create(tokens, ReuseScope(lora_id, salt, model), priority, request_id)
        handle = next(self._ids)
        self._requests[handle] = cache
        return handle, cache.num_reused_tokens

    def _cache(self, handle: int) -> KvCache:
        try:
            return self._requests[handle]
        except KeyError:
            raise InvalidArgumentError("handle", f"no open request {handle}") from None

    def resume(self, handle: int) -> bool:
        return self._cache(handle).resume()

    def suspend(self, handle: int) -> None:
        self._cache(handle).suspend()

    def extend(self, handle: int, tokens: Sequence[int]) -> None:
        self._cache(handle).extend(tokens)

    def page_ids(self, handle: int) -> list[int]:
        return [int(p) for p in self._cache(handle).page_ids()]

    def commit(self, handle: int, num_tokens: int | None = None) -> int:
        return self._cache(handle).commit(num_tokens)

    def close(self, handle: int) -> None:
        cache = self._requests.pop(handle, None)
        if cache is not None:
            cache.close()

    # ---- blocks --------------------------------------------------------------------------------
    def probe(
        self,
        tokens: Sequence[int],
        lora_id: int | None = None,
        salt: int | None = None,
        model: bytes | None = None,
        mm_items: Sequence[MultimodalItem] = (),
    ) -> ProbeResult:
        """How many leading blocks of ``tokens`` (with ``mm_items``) in scope ``(lora_id, salt,
        model)`` this worker holds, and on which tiers (``CacheManager.probe``)."""
        return self.manager.probe(tokens, ReuseScope(lora_id, salt, model), mm_items=mm_items)

    def held_many(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """How many leading blocks of each key chain this worker holds (``CacheManager.probe``
        by keys; one call answers a batch of lookups). InvalidArgumentError for a malformed key
        (nothing is answered)."""
        return [self.manager.probe(keys=chain).num_blocks for chain in chains]

    def export_blocks(self, keys: Sequence[bytes]) -> list[ExportedBlock]:
        return self.manager.export_blocks(keys)

    def import_blocks(self, blocks: Sequence[ExportedBlock]) -> ImportResult:
        return self.manager.import_blocks(blocks)

    def cool_blocks(self, keys: Sequence[bytes]) -> int:
        """First to go when room is needed (see ``CacheManager.cool_blocks``)."""
        return self.manager.cool_blocks(keys)

    def clear(self) -> int:
        return self.manager.clear_reusable()

    # ---- page transfers (issue 4; the work happens in actors/cache/transfer.py) ------------------------
    def start_page_server(self, token: bytes, config: TransferConfig | None = None) -> PeerAddress:
        """Start this worker's page server (idempotent; ``start`` does it for every worker)."""
        return self.transfer.start(token, config)

    def page_server_address(self) -> PeerAddress | None:
        """Where peers pull this worker's committed pages (None before the server starts)."""
        return self.transfer.address

    def pull(
        self, peer: PeerRef, keys: Sequence[bytes], prefer_shm: bool = True, verify: bool | None = None
    ) -> PullOutcome:
        """Pull committed blocks ``keys`` from ``peer`` (a worker id or a page-server address) and
        import them: every page intact (checked against the sender's CRC-32 over UCX; over shared
        memory copied from the owner's memory under a lease it confirmed, plus checksums with
        ``verify=True``), committed and matchable here, their BlockStored events flowing to the
        index like any other commit. TransferError (nothing imported) when the transfer fails;
        the caller recomputes.
        """
        outcome = self.transfer.pull(peer, keys, prefer_shm, verify)
        metrics = self._metrics
        if metrics is not None:
            metrics.observe_pull(outcome.path, outcome.seconds)
        return outcome

    def transfer_stats(self) -> dict[str, Any]:
        """Page-server and client counters per path (shm/ucx), and the server's open leases."""
        return self.transfer.stats()

    # ---- engine timing (reported by the vLLM connector of the engine paired with this worker) ----
    def note_engine_timing(self, engine: str, totals: Sequence[int]) -> None:
        """Keep ``engine``'s timing totals ``[pulled tokens, pull us, prefilled tokens, prefill
        us]`` (added up since that engine started; a later report replaces them). The oldest
        engine is forgotten past ``MAX_ENGINES``. InvalidArgumentError for anything but four
        ints >= 0 and a non-empty name; nothing changes then."""
        if not (isinstance(engine, str) and engine):
            raise InvalidArgumentError("engine", "must be a non-empty string")
        if len(totals) != 4 or any(type(t) is not int or t < 0 for t in totals):
            raise InvalidArgumentError("totals", f"need four ints >= 0, got {list(totals)!r}")
        timings = self._engine_timing
        timings.pop(engine, None)  # re-inserted last: the dict stays in reporting order
        timings[engine] = list(totals)
        while len(timings) > MAX_ENGINES:
            del timings[next(iter(timings))]

    def engine_timing(self, engine: str | None = None) -> list[int]:
        """The totals ``engine`` last reported (zeros when none); ``None``: summed over every
        engine that reported. A copy: it does not change with later reports."""
        if engine is not None:
            return list(self._engine_timing.get(engine, (0, 0, 0, 0)))
        return [sum(col) for col in zip((0, 0, 0, 0), *self._engine_timing.values())]

    # ---- health and stats ----------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "pid": os.getpid(),
            "incarnation": self.incarnation,
            "open_requests": self.manager.num_open_requests,
            "blocks": len(self.manager.tree),
            "metrics_exports": self.metrics_exports,
        }

    def stats(self) -> Any:
        return self.manager.stats()

    def status(self) -> dict[str, Any]:
        """What ``raykv status`` shows of this worker: its Ray node (id and IP; None outside
        Ray), per tier ``(kind, bytes in use, capacity bytes)``, the block hit ratio, committed
        blocks, pinned pages, open requests, events published to the index and the last event
        id, the page bytes it pulled and its page server sent (over every path), its engines'
        timing totals (:meth:`engine_timing`, summed) and its store inboxes (per engine; blocks
        stored, present and refused, commits and their microseconds)."""
        stats = self.manager.stats()
        transfer = self.transfer.stats()
        node_id, node_ip = _node_id(), None
        if node_id is not None:
            import ray

            node_ip = ray.util.get_node_ip_address()
        return {
            "worker": str(self.worker_id),
            "node_id": node_id,
            "node_ip": node_ip,
            "pid": os.getpid(),
            "tiers": [
                (kind.name.lower(), used, cap)
                for kind, used, cap in zip(stats.tiers, stats.bytes_in_use, stats.capacity_bytes)
            ],
            "hit_ratio": stats.hit_ratio,
            "blocks": len(self.manager.tree),
            "pinned_pages": stats.pinned_pages,
            "open_requests": stats.open_requests,
            "events_published": self.published_events,
            "last_event_id": self.manager.events.last_event_id,
            "pulled_bytes": sum(transfer.get("client", {}).get("bytes", {}).values()),
            "served_bytes": sum(transfer.get("server", {}).get("bytes", {}).values()),
            "engine_timing": self.engine_timing(),
            "inboxes": {"engines": self.inboxes.engines(), **self.inboxes.counters},
        }

    def shutdown(self) -> None:
        """Stop publishing, close open requests and release the tiers."""
        self._stop.set()
        self.transfer.close()  # ends the page server's leases before the tiers go
        self.inboxes.close()
        for handle in list(self._requests):
            self.close(handle)
        self.flush_events()
        self.manager.shutdown()


def _node_id() -> str | None:
    """This process's Ray node id (None outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

"""IndexShard actors (each wraps one raykv.index.prefix_index.PrefixIndex) and the client that fans out.

A shard owns the keys whose digest maps to it (``raykv.index.prefix_index.shard_of``). Workers push per-shard
event sub-batches; when a batch reveals a gap the shard pulls a snapshot from that worker. The
shard watches every registered worker with a heartbeat and purges a worker's entries once Ray
reports it dead. A shard restarted by Ray rebuilds from the snapshots of the workers named in its
constructor arguments (Ray replays them on restart). The heartbeat also reads each worker's last
event id, so the shard knows how many events it lags behind (``info()["lag"]``); every
``METRICS_INTERVAL_S`` it exports keys, workers, resyncs and that lag, and every route or lookup
its duration (:class:`actors.metrics.IndexMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray

from actors.liveness import CALL_TIMEOUT_S, died
from actors.metrics import METRICS_INTERVAL_S, IndexMetrics
from raykv.core.types import WorkerId
from raykv.index.prefix_index import ApplyResult, EventBatch, PrefixIndex, RouteMatch, merge_route, shard_of
from raykv.routing.liveness import Liveness

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5


class IndexShard:
    """Async Ray actor around one PrefixIndex shard."""

    def __init__(
        self,
        shard: int,
        num_shards: int,
        namespace: str,
        workers: Sequence[tuple[str, int]] = (),
        predict_ttl_s: float = 2.0,
    ) -> None:
        self.index = PrefixIndex(shard, num_shards, predict_ttl_s=predict_ttl_s)
        self.namespace = namespace
        self._expected = list(workers)
        self._handles: dict[WorkerId, Any] = {}
        self._watch: dict[WorkerId, asyncio.Task[None]] = {}
        self._syncing: set[WorkerId] = set()
        self._ready: asyncio.Task[None] | None = None
        self._positions: dict[WorkerId, tuple[int, int]] = {}  # worker -> (incarnation, last event id)
        self._metrics: IndexMetrics | None = None
        self._exporter: asyncio.Task[None] | None = None
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    async def _ensure_ready(self) -> None:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_task(self._rebuild())
            self._exporter = asyncio.get_running_loop().create_task(self._export_loop())
        await self._ready

    def lag(self) -> dict[str, int]:
        """Per registered worker, the events it emitted (as of its last heartbeat) that this
        shard has not applied yet (0 once caught up or for a worker not heard from)."""
        out = {}
        for worker in self.index.workers:
            incarnation, last = self._positions.get(worker, (0, 0))
            state_ok = incarnation == self.index.incarnation(worker)
            out[str(worker)] = max(0, last - self.index.last_event_id(worker)) if state_ok else 0
        return out

    async def _export_loop(self) -> None:
        """Export this shard's metrics every ``METRICS_INTERVAL_S`` (until the actor ends)."""
        self._metrics = IndexMetrics(self.index.shard)
        while True:
            try:
                counters = self.index.counters
                self._metrics.update(
                    len(self.index), len(self.index.workers), counters["snapshots"], self.lag()
                )
            except Exception:
                log.exception("index shard %d: exporting metrics failed", self.index.shard)
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def _rebuild(self) -> None:
        """Register the expected workers that are alive and load their snapshots."""
        for name, lane in self._expected:
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
                ident = await handle.identity.remote()
            except Exception:
                continue
            await self._register(WorkerId(name), lane, ident[2], handle)
            await self._resync(WorkerId(name))

    async def register_worker(self, worker: str, lane: int, incarnation: int) -> None:
        """Called by a worker when it starts (or restarts with a new incarnation)."""
        await self._ensure_ready()
        handle = ray.get_actor(worker, namespace=self.namespace)
        await self._register(WorkerId(worker), lane, incarnation, handle)

    async def _register(self, worker: WorkerId, lane: int, incarnation: int, handle: Any) -> None:
        self.index.register_worker(worker, lane, incarnation)
        self._handles[worker] = handle
        if worker not in self._watch:
            self._watch[worker] = asyncio.get_running_loop().create_task(self._heartbeat(worker))

    async def _heartbeat(self, worker: WorkerId) -> None:
        while worker in self._handles:
            try:
                self._positions[worker] = await self._handles[worker].event_position.remote()
            except ray.exceptions.ActorDiedError:
                self._purge(worker, "died")
                return
            except ray.exceptions.RayActorError:
                pass  # restarting or unreachable: keep entries until Ray says it is dead
            await asyncio.sleep(HEARTBEAT_S)

    def _purge(self, worker: WorkerId, why: str) -> None:
        dropped = self.index.remove_worker(worker)
        self._handles.pop(worker, None)
        self._watch.pop(worker, None)
        self._forget(worker)
        self.index.counters["workers_purged"] += 1
        log.info("index shard %d: %s %s, dropped %d entries", self.index.shard, worker, why, dropped)

    async def remove_worker(self, worker: str) -> int:
        await self._ensure_ready()
        dropped = self.index.remove_worker(WorkerId(worker))
        self._handles.pop(WorkerId(worker), None)
        self._forget(WorkerId(worker))
        task = self._watch.pop(WorkerId(worker), None)
        if task is not None:
            task.cancel()
        return dropped

    def _forget(self, worker: WorkerId) -> None:
        """Drop a removed worker's position and zero its lag series."""
        self._positions.pop(worker, None)
        if self._metrics is not None:
            self._metrics.lag.set(0, tags={"shard": str(self.index.shard), "worker": str(worker)})

    async def apply_batch(self, batch: EventBatch) -> str:
        """Apply one sub-batch; pulls a snapshot from the worker when the stream has a gap."""
        await self._ensure_ready()
        result = self.index.apply_batch(batch)
        if result is ApplyResult.NEEDS_SNAPSHOT:
            await self._resync(batch.worker)
        return result.value

    async def _resync(self, worker: WorkerId) -> None:
        handle = self._handles.get(worker)
        if handle is None or worker in self._syncing:
            return
        self._syncing.add(worker)
        try:
            snap = await handle.snapshot.remote()
            self.index.apply_snapshot(worker, snap.incarnation, snap.last_event_id, snap.blocks)
        except ray.exceptions.RayActorError:
            pass
        finally:
            self._syncing.discard(worker)

    async def lookup(self, keys: Sequence[bytes]) -> tuple[list[Any], list[int]]:
        await self._ensure_ready()
        start = time.perf_counter()
        out = self.index.lookup(keys)
        self._observe(start)
        return out

    async def route(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]:
        await self._ensure_ready()
        start = time.perf_counter()
        out = self.index.route(keys)
        self._observe(start)
        return out

    def _observe(self, start: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_route(time.perf_counter() - start)

    async def route_batch(self, queries: Sequence[Sequence[bytes]]) -> list[dict[WorkerId, RouteMatch]]:
        """Route several queries in one call (amortizes the Ray round trip)."""
        await self._ensure_ready()
        return [self.index.route(keys) for keys in queries]

    async def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> list[tuple[list[Any], list[int]]]:
        """:meth:`lookup` of several key lists in one call."""
        await self._ensure_ready()
        start = time.perf_counter()
        out = [self.index.lookup(keys) for keys in queries]
        self._observe(start)
        return out

    async def load_batches(self, batches: Sequence[EventBatch]) -> int:
        """Apply many batches at once (benchmarks and bulk loading); returns how many applied."""
        await self._ensure_ready()
        return sum(self.index.apply_batch(b) is ApplyResult.APPLIED for b in batches)

    async def register_lanes(self, workers: Sequence[tuple[str, int, int]]) -> None:
        """Register workers without actors behind them (benchmarks only: no heartbeat)."""
        for name, lane, incarnation in workers:
            self.index.register_worker(WorkerId(name), lane, incarnation)

    async def predict(self, worker: str, keys: Sequence[bytes]) -> None:
        await self._ensure_ready()
        self.index.predict(WorkerId(worker), keys)

    async def worker_blocks(self, worker: str) -> dict[bytes, int]:
        await self._ensure_ready()
        return {k: int(t) for k, t in self.index.worker_blocks(WorkerId(worker)).items()}

    async def info(self) -> dict[str, Any]:
        await self._ensure_ready()
        return {
            "shard": self.index.shard,
            "entries": len(self.index),
            "restarted": self.restarted,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "workers": self.index.workers,
            "counters": dict(self.index.counters),
            "last_event_ids": {str(w): self.index.last_event_id(w) for w in self.index.workers},
            "lag": self.lag(),
        }

    async def ping(self) -> bool:
        await self._ensure_ready()
        return True


class IndexClient:
    """Fans route/predict calls out to the shards and merges the answers.

    ``lanes`` maps each worker's lane to its id (the same map the shards use). ``shards[i]`` may
    be None (a shard that could not be found: its keys are never answered). With ``liveness`` (a
    :class:`raykv.routing.liveness.Liveness` over the shards' ``names``) the blocking
    :meth:`route` skips shards that are not up and reports the ones that time out or fail.
    Blocking calls wait at most ``timeout_s`` (default :data:`actors.liveness.CALL_TIMEOUT_S`).
    """

    def __init__(
        self,
        shards: Sequence[Any],
        lanes: dict[int, WorkerId],
        names: Sequence[str] | None = None,
        liveness: Liveness | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.shards = list(shards)
        self.lanes = dict(lanes)
        self.names = list(names) if names is not None else [f"shard-{i}" for i in range(len(self.shards))]
        self.liveness = liveness
        self.timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
        self.missed = 0  # shard answers given up on (timed out or failed)

    def _split(self, keys: Sequence[bytes]) -> list[list[int]]:
        n = len(self.shards)
        parts: list[list[int]] = [[] for _ in range(n)]
        for i, key in enumerate(keys):
            parts[shard_of(key, n)].append(i)
        return parts

    def _merge(
        self, keys: Sequence[bytes], parts: list[list[int]], answers: list[tuple[list[Any], list[int]]]
    ) -> dict[WorkerId, RouteMatch]:
        entries: list[Any] = [None] * len(keys)
        predicted = [0] * len(keys)
        for positions, (ents, preds) in zip(parts, answers):
            for j, pos in enumerate(positions):
                entries[pos] = ents[j]
                if preds:
                    predicted[pos] = preds[j]
        return merge_route(entries, predicted, self.lanes)

    def live(self) -> list[int]:
        """Positions of the shards a blocking route asks now: found, and answering per
        ``liveness`` (a shard whose ping is merely slow is still asked, within ``timeout_s``;
        one whose own route call timed out, failed or died is skipped until it answers a ping)."""
        return [
            i
            for i, shard in enumerate(self.shards)
            if shard is not None and (self.liveness is None or self.liveness.answering(self.names[i]))
        ]

    def route(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]:
        """Blocking route (for plain Python callers); returns within ``timeout_s``.

        Degrades instead of failing: the keys of a shard that is down, missing, fails or does not
        answer within ``timeout_s`` count as held by nobody, so each worker's prefix ends at the
        first such key (a lower bound of what is cached). Such shards are reported to
        ``liveness`` (and skipped until their next good ping) and counted in ``missed``.
        """
        live = self.live()
        if len(self.shards) == 1:
            if not live:
                return {}
            answer = self._collect({0: self.shards[0].route.remote(list(keys))})
            return answer.get(0, {})  # type: ignore[no-any-return]
        parts = self._split(keys)
        refs = {i: self.shards[i].lookup.remote([keys[k] for k in parts[i]]) for i in live if parts[i]}
        got = self._collect(refs)
        answers = [got.get(i, ([None] * len(p), [])) for i, p in enumerate(parts)]
        return self._merge(keys, parts, answers)

    def route_many(self, queries: Sequence[Sequence[bytes]]) -> list[dict[WorkerId, RouteMatch]]:
        """:meth:`route` of several queries with one call per live shard (blocking, within
        ``timeout_s``; a shard that does not answer degrades every query as :meth:`route` does)."""
        if not queries:
            return []
        live = self.live()
        if len(self.shards) == 1:
            if not live:
                return [{} for _ in queries]
            got = self._collect({0: self.shards[0].route_batch.remote([list(q) for q in queries])})
            return got.get(0) or [{} for _ in queries]  # type: ignore[no-any-return]
        parts = [self._split(q) for q in queries]
        refs = {
            i: self.shards[i].lookup_batch.remote([[q[k] for k in p[i]] for q, p in zip(queries, parts)])
            for i in live
        }
        got = self._collect(refs)
        out = []
        for n, (q, p) in enumerate(zip(queries, parts)):
            answers = [got[i][n] if i in got else ([None] * len(p[i]), []) for i in range(len(self.shards))]
            out.append(self._merge(q, p, answers))
        return out

    def _collect(self, refs: dict[int, Any]) -> dict[int, Any]:
        """The answers of ``refs`` (shard position -> ref) that arrive within ``timeout_s``."""
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        done = set(ready)
        out: dict[int, Any] = {}
        for i, ref in refs.items():
            if ref not in done:
                self._missed(i, None)
                continue
            try:
                out[i] = ray.get(ref, timeout=self.timeout_s)
            except Exception as exc:
                self._missed(i, exc)
        return out

    def _missed(self, i: int, exc: BaseException | None) -> None:
        self.missed += 1
        log.warning("index shard %s: %s", self.names[i], "no answer in time" if exc is None else exc)
        if self.liveness is not None:
            now = time.monotonic()
            if exc is None:
                self.liveness.late(self.names[i], now)
            else:
                self.liveness.failed(self.names[i], now, dead=died(exc))

    async def route_async(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]:
        """Non-blocking route for event-loop callers (Serve routers bound it with their own
        time budget); raises Ray's error when a shard fails."""
        if len(self.shards) == 1:
            return await self.shards[0].route.remote(list(keys))  # type: ignore[no-any-return]
        parts = self._split(keys)
        answers = await asyncio.gather(
            *[s.lookup.remote([keys[i] for i in p]) for s, p in zip(self.shards, parts)]
        )
        return self._merge(keys, parts, list(answers))

    def predict(self, worker: WorkerId, keys: Sequence[bytes]) -> None:
        """Credit ``worker`` with ``keys`` on every owning shard that is live (fire and forget)."""
        live = set(self.live())
        for i, (shard, positions) in enumerate(zip(self.shards, self._split(keys))):
            if positions and i in live:
                shard.predict.remote(worker, [keys[k] for k in positions])


def shard_sink(shards: Sequence[Any]) -> Any:
    """An event sink for a CacheWorker actor: per-shard sub-batches, sent without waiting."""
    n = len(shards)

    def send(batch: EventBatch) -> list[Any]:
        return [shard.apply_batch.remote(batch.for_shard(i, n)) for i, shard in enumerate(shards)]

    return send

"""IndexShard actors (each wraps one raykv.index.prefix_index.PrefixIndex) and the client that fans out.

A shard owns the keys whose digest maps to it (``raykv.index.prefix_index.shard_of``). Workers push per-shard
event sub-batches; when a batch reveals a gap the shard pulls a snapshot from that worker. The
shard watches every registered worker with a heartbeat and purges a worker's entries once Ray
reports it dead. A shard restarted by Ray rebuilds from the snapshots of the workers named in its
constructor arguments (Ray replays them on restart). The heartbeat also reads each worker's last
event id, so the shard knows how many events it lags behind (``info()["lag"]``); every
``METRICS_INTERVAL_S`` it exports keys, workers, resyncs and that lag, and every route or lookup
its duration (:class:`actors.cache.metrics.IndexMetrics`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from actors.cache import liveness as bounds
from actors.cache.liveness import CALL_TIMEOUT_S, PING_INTERVAL_S, died
from actors.cache.metrics import METRICS_INTERVAL_S, IndexMetrics
from raykv.core.types import WorkerId
from raykv.index.prefix_index import ApplyResult, EventBatch, PrefixIndex, RouteMatch, merge_route, shard_of
from raykv.routing.liveness import Liveness

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
UPKEEP_IDLE_S = 0.05  # how often the upkeep task looks for a table move to advance


class IndexShard:
    """Async Ray actor around one PrefixIndex shard."""

    def __init__(
        self,
        shard: int,
        num_shards: int,
        namespace: str,
        workers: Sequence[tuple[str, int]] = (),
        predict_ttl_s: float = 2.0,
        capacity: int = 0,
    ) -> None:
        self.index = PrefixIndex(shard, num_shards, predict_ttl_s=predict_ttl_s, capacity=capacity)
        self.namespace = namespace
        self._expected = list(workers)
        self._handles: dict[WorkerId, Any] = {}
        self._watch: dict[WorkerId, asyncio.Task[None]] = {}
        self._syncing: set[WorkerId] = set()
        self._ready: asyncio.Task[None] | None = None
        self._positions: dict[WorkerId, tuple[int, int]] = {}  # worker -> (incarnation, last event id)
        self._metrics: IndexMetrics | None = None
        self._exporter: asyncio.Task[None] | None = None
        self._upkeep: asyncio.Task[None] | None = None
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    async def _ensure_ready(self) -> None:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_task(self._rebuild())
            self._exporter = asyncio.get_running_loop().create_task(self._export_loop())
            self._upkeep = asyncio.get_running_loop().create_task(self._upkeep_loop())
        await self._ready

    async def _upkeep_loop(self) -> None:
        """Advance a growing table between calls (a step moves ``MOVE_SLOTS`` slots, well under a
        millisecond), so a move ends without waiting for writes; routes are served between steps."""
        while True:
            try:
                moving = self.index.maintain()
            except Exception:
                log.exception("index shard %d: table upkeep failed", self.index.shard)
                moving = False
            await asyncio.sleep(0 if moving else UPKEEP_IDLE_S)

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
                    len(self.index),
                    len(self.index.workers),
                    counters["snapshots"],
                    self.lag(),
                    self.index.memory(),
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
        """Route several queries in one call (amortizes the Ray round trip; ``IndexClient.route_many``,
        the vLLM connector's lookups on one shard); counted in ``batched_queries``."""
        await self._ensure_ready()
        self.index.counters["batched_queries"] += len(queries)
        return [self.index.route(keys) for keys in queries]

    async def lookup_batch(self, queries: Sequence[Sequence[bytes]]) -> list[tuple[list[Any], list[int]]]:
        """:meth:`lookup` of several key lists in one call (``IndexClient.route_many`` over several
        shards); counted in ``batched_queries``."""
        await self._ensure_ready()
        self.index.counters["batched_queries"] += len(queries)
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
            "table": self.index.table_stats(),
            "last_event_ids": {str(w): self.index.last_event_id(w) for w in self.index.workers},
            "lag": self.lag(),
        }

    async def ping(self) -> bool:
        await self._ensure_ready()
        return True


class IndexClient:
    """Fans route/predict calls out to the shards and merges the answers, within a deadline.

    ``lanes`` maps each worker's lane to its id (the same map the shards use). ``shards[i]`` may
    be None (a shard that could not be found: its keys are never answered); ``names[i]`` names
    shard i in ``liveness``.

    Deadlines: each call a request waits on (:meth:`route`, :meth:`route_many`,
    :meth:`route_async`) waits for the shards at most ``route_budget_ms`` (default
    :data:`actors.cache.liveness.ROUTE_BUDGET_MS` as it is when the client is made; ``timeout_s``, when
    given, caps it; a call's own ``budget_ms`` replaces it). Past it the answers that arrived are
    merged and the keys of the other shards count as held by nobody, so each worker's prefix ends
    at the first such key (a lower bound of what is cached, never a wrong one). Shard trouble
    never raises; a budget that is not a number > 0 raises ValueError.

    Liveness: a shard that misses its deadline counts in ``late`` (and ``missed``, with those that
    failed), is reported to ``liveness`` and is then skipped (each skipped shard that owns keys of a
    call counts in ``skipped``) until it answers a ping sent after the miss. Given ``liveness``
    (e.g. a :class:`actors.cache.liveness.Pinger`'s ``shards``), its owner's pings take shards back;
    without one the client keeps its own and pings each skipped shard itself (at most one ping
    outstanding per shard and one sent per ``PING_INTERVAL_S``), looking at the answers, without
    waiting, at the start of each call. Safe to call from several threads.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        lanes: dict[int, WorkerId],
        names: Sequence[str] | None = None,
        liveness: Liveness | None = None,
        timeout_s: float | None = None,
        route_budget_ms: float | None = None,
    ) -> None:
        self.shards = list(shards)
        self.lanes = dict(lanes)
        self.names = list(names) if names is not None else [f"shard-{i}" for i in range(len(self.shards))]
        budget = bounds.ROUTE_BUDGET_MS if route_budget_ms is None else route_budget_ms
        self.route_budget_ms = _positive_ms("route_budget_ms", budget)
        if timeout_s is not None:  # a caller's general call timeout only caps the budget
            self.route_budget_ms = min(self.route_budget_ms, _positive_ms("timeout_s", timeout_s) * 1000.0)
        self.probing = liveness is None  # no owner pings the shards: the client does
        self.liveness = Liveness(self.names, CALL_TIMEOUT_S) if liveness is None else liveness
        self.missed = 0  # shard answers given up on (past the deadline or failed)
        self.late = 0  # of those, the ones past the deadline
        self.skipped = 0  # shards not asked because they were not answering
        self._lock = threading.Lock()
        self._probes: dict[int, concurrent.futures.Future[Any]] = {}
        self._probe_due: dict[int, float] = {}

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

    @staticmethod
    def _answers(parts: list[list[int]], got: dict[int, Any]) -> list[tuple[list[Any], list[int]]]:
        """Per shard, its lookup answer, or "held by nobody" for each of its keys when it gave none."""
        return [got.get(i, ([None] * len(p), [])) for i, p in enumerate(parts)]

    def live(self) -> list[int]:
        """Positions of the shards a route asks now: found, and answering per ``liveness`` (a
        shard whose ping is merely slow is still asked, within the deadline; one whose own call
        missed its deadline, failed or died is skipped until it answers a ping). Reads state only."""
        return [
            i
            for i, shard in enumerate(self.shards)
            if shard is not None and self.liveness.answering(self.names[i])
        ]

    def _budget_s(self, budget_ms: float | None) -> float:
        """A call's budget in seconds (``budget_ms``, else ``route_budget_ms``); ValueError if <= 0."""
        return _positive_ms("budget_ms", self.route_budget_ms if budget_ms is None else budget_ms) / 1000.0

    def _ask(self, wanted: Sequence[int]) -> list[int]:
        """Of the shards ``wanted`` (owning keys of a call), those to ask now; counts the others in
        ``skipped``. Without an owner's liveness, first looks at and sends the client's own pings."""
        if self.probing:
            self._probe(time.monotonic())
        live = set(self.live())
        asked = [i for i in wanted if i in live]
        if len(asked) < len(wanted):
            with self._lock:
                self.skipped += len(wanted) - len(asked)
        return asked

    def _probe(self, now: float) -> None:
        """Record the answers of the client's own pings that arrived (never waits), and ping each
        skipped shard that has none outstanding and was not pinged in the last ``PING_INTERVAL_S``."""
        with self._lock:
            for i, fut in list(self._probes.items()):
                if not fut.done():
                    continue
                del self._probes[i]
                exc = fut.exception()
                if exc is None:
                    self.liveness.answered(self.names[i], now)
                else:
                    self.liveness.failed(self.names[i], now, dead=died(exc))
            for i, shard in enumerate(self.shards):
                name = self.names[i]
                if shard is None or i in self._probes or self.liveness.answering(name):
                    continue
                if now >= self._probe_due.get(i, 0.0):
                    self._probe_due[i] = now + PING_INTERVAL_S
                    self.liveness.sent(name, now)
                    self._probes[i] = shard.ping.remote().future()

    def route(self, keys: Sequence[bytes], budget_ms: float | None = None) -> dict[WorkerId, RouteMatch]:
        """Blocking route (for plain Python callers): per worker, its cached prefix of ``keys``.

        Returns within ``budget_ms`` (default ``route_budget_ms``) plus the merge, with what the
        shards that answered by then know (see the class: the keys of a shard that is skipped,
        missing, fails or is late count as held by nobody). Changes only the counters and
        liveness. Raises ValueError for a budget <= 0, nothing for shard trouble.
        """
        deadline = time.monotonic() + self._budget_s(budget_ms)
        if len(self.shards) == 1:
            if not self._ask([0]):
                return {}
            answer = self._collect({0: self.shards[0].route.remote(list(keys))}, deadline)
            return answer.get(0, {})  # type: ignore[no-any-return]
        parts = self._split(keys)
        asked = self._ask([i for i, p in enumerate(parts) if p])
        got = self._collect(
            {i: self.shards[i].lookup.remote([keys[k] for k in parts[i]]) for i in asked}, deadline
        )
        return self._merge(keys, parts, self._answers(parts, got))

    def route_many(
        self, queries: Sequence[Sequence[bytes]], budget_ms: float | None = None
    ) -> list[dict[WorkerId, RouteMatch]]:
        """:meth:`route` of several queries with one call per shard, all within one ``budget_ms``
        (blocking; a shard that is skipped or does not answer in time degrades every query as
        :meth:`route` does). Raises ValueError for a budget <= 0."""
        if not queries:
            return []
        deadline = time.monotonic() + self._budget_s(budget_ms)
        if len(self.shards) == 1:
            if not self._ask([0]):
                return [{} for _ in queries]
            got = self._collect({0: self.shards[0].route_batch.remote([list(q) for q in queries])}, deadline)
            return got.get(0) or [{} for _ in queries]  # type: ignore[no-any-return]
        parts = [self._split(q) for q in queries]
        asked = self._ask([i for i in range(len(self.shards)) if any(p[i] for p in parts)])
        refs = {
            i: self.shards[i].lookup_batch.remote([[q[k] for k in p[i]] for q, p in zip(queries, parts)])
            for i in asked
        }
        got = self._collect(refs, deadline)
        out = []
        for n, (q, p) in enumerate(zip(queries, parts)):
            out.append(self._merge(q, p, self._answers(p, {i: a[n] for i, a in got.items()})))
        return out

    def _collect(self, refs: dict[int, Any], deadline: float) -> dict[int, Any]:
        """The answers of ``refs`` (shard position -> ref) that arrived by ``deadline`` (monotonic);
        the others are given up on (:meth:`_missed`). Never raises for a shard's trouble."""
        if not refs:
            return {}
        left = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=left)
        done = set(ready)
        out: dict[int, Any] = {}
        for i, ref in refs.items():
            if ref not in done:
                self._missed(i, None)
                continue
            try:
                out[i] = ray.get(ref, timeout=CALL_TIMEOUT_S)  # ready: returns at once
            except Exception as exc:
                self._missed(i, exc)
        return out

    def _missed(self, i: int, exc: BaseException | None) -> None:
        """Shard ``i`` gave no answer: late (``exc`` None: past its deadline) or failed. Counts it
        and reports it to ``liveness``, which skips it until it answers a ping again."""
        now = time.monotonic()
        with self._lock:
            self.missed += 1
            if exc is None:
                self.late += 1
        if exc is None:
            log.warning(
                "index shard %s: no answer within its deadline; skipped until it answers", self.names[i]
            )
            self.liveness.late(self.names[i], now)
        else:
            log.warning("index shard %s: %s", self.names[i], exc)
            self.liveness.failed(self.names[i], now, dead=died(exc))

    async def route_async(
        self, keys: Sequence[bytes], budget_ms: float | None = None
    ) -> dict[WorkerId, RouteMatch]:
        """:meth:`route` for event-loop callers (Serve routers): never blocks the loop, returns
        within ``budget_ms`` (default ``route_budget_ms``) with the answers of the shards that
        answered by then, and raises nothing for shard trouble (ValueError for a budget <= 0).
        Cancelling it abandons the shards' answers without counting them as missed."""
        budget_s = self._budget_s(budget_ms)
        if len(self.shards) == 1:
            if not self._ask([0]):
                return {}
            answer = await self._collect_async({0: self.shards[0].route.remote(list(keys))}, budget_s)
            return answer.get(0, {})  # type: ignore[no-any-return]
        parts = self._split(keys)
        asked = self._ask([i for i, p in enumerate(parts) if p])
        refs = {i: self.shards[i].lookup.remote([keys[k] for k in parts[i]]) for i in asked}
        got = await self._collect_async(refs, budget_s)
        return self._merge(keys, parts, self._answers(parts, got))

    async def _collect_async(self, refs: dict[int, Any], budget_s: float) -> dict[int, Any]:
        """:meth:`_collect` on the event loop: ``asyncio.wait`` over the shards' calls for at most
        ``budget_s``; the answers that arrived, the others given up on (:meth:`_missed`)."""
        if not refs:
            return {}
        futs = {i: asyncio.wrap_future(ref.future()) for i, ref in refs.items()}
        try:
            done, _ = await asyncio.wait(futs.values(), timeout=budget_s)
        finally:
            for fut in futs.values():  # abandoned: no "exception never retrieved" later
                if fut.done():
                    if not fut.cancelled():
                        fut.exception()
                else:
                    fut.cancel()
        out: dict[int, Any] = {}
        for i, fut in futs.items():
            exc = fut.exception() if fut in done else None
            if fut not in done or exc is not None:
                self._missed(i, exc)
            else:
                out[i] = fut.result()
        return out

    def predict(self, worker: WorkerId, keys: Sequence[bytes]) -> None:
        """Credit ``worker`` with ``keys`` on every owning shard that is live (fire and forget)."""
        live = set(self.live())
        for i, (shard, positions) in enumerate(zip(self.shards, self._split(keys))):
            if positions and i in live:
                shard.predict.remote(worker, [keys[k] for k in positions])


def _positive_ms(name: str, ms: float) -> float:
    """``ms`` as a float; ValueError naming ``name`` unless it is a number > 0."""
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0:
        raise ValueError(f"{name} must be a number of milliseconds > 0, got {ms!r}")
    return float(ms)


def shard_sink(shards: Sequence[Any]) -> Any:
    """An event sink for a CacheWorker actor: per-shard sub-batches, sent without waiting."""
    n = len(shards)

    def send(batch: EventBatch) -> list[Any]:
        return [shard.apply_batch.remote(part) for shard, part in zip(shards, batch.for_shards(n))]

    return send

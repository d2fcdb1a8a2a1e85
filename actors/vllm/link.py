"""The vLLM connector's line to a raykv deployment through Ray (see raykv.integrations.vllm.link).

Runs in vLLM's EngineCore process: joins the deployment's Ray cluster as a driver
(``ray_address``, else RAY_ADDRESS, else ``"auto"``: never starts a Ray instance of its own) and
talks to the paired CacheWorker and the index with actor calls that carry keys and counts only.
Pages never travel through Ray: the worker process moves them (raykv.transfer).

Lookups return a Future at once; a background thread answers them in batches, asking the paired
CacheWorker which leading blocks it holds (one call per batch) and the index which other worker
holds more (actors.vllm.lookups), unless the request carries the router's match. Fetches (the paired
worker pulling a longer prefix from another worker, after waiting for a producer's hinted blocks
to arrive there) run on a small thread pool, each bounded by ``timeout_s`` per wait; the
connector's scheduler side polls them without blocking. Stores (blocks the worker side wrote
into the inboxes the paired worker leased it at start) are committed by the paired worker in
the order they were written, all queued ones in one call, from a daemon thread (a block imports
only after its parent, so concurrent commits could refuse blocks).
Joining Ray keeps the process's SIGTERM/SIGINT handlers (Ray's driver would replace them with its
crash reporter, which kills vLLM's engine process without its orderly shutdown).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import secrets
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray

from actors.cache.cluster import RayKVCluster, connect
from actors.vllm.lookups import LookupThread, Query
from raykv.core.config import KVLayout
from raykv.core.errors import ConfigError, StateError
from raykv.core.keys import MultimodalItem, ReuseScope, block_keys, clip_mm_items
from raykv.core.types import WorkerId
from raykv.integrations.vllm.link import Match
from raykv.integrations.vllm.plan import EngineLink, rank_scope
from raykv.transfer.inbox import InboxCommit, InboxLease, InboxResult

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
"""Failed stores log one warning per this many seconds (a dead worker fails every batch)."""


def _worker_name(cluster: RayKVCluster, choice: Any) -> WorkerId:
    """The paired worker: an index into the deployment's workers or a worker's actor name."""
    names = cluster.worker_ids
    if isinstance(choice, int) and not isinstance(choice, bool):
        if not 0 <= choice < len(names):
            raise ConfigError("worker", f"index {choice} out of range (the deployment has {len(names)})")
        return names[choice]
    if isinstance(choice, str) and WorkerId(choice) in cluster.workers:
        return WorkerId(choice)
    raise ConfigError("worker", f"must be an index or one of {names}, got {choice!r}")


@dataclass(frozen=True)
class Fetch:
    """One fetch in flight: its future (resolving to the leading blocks the paired worker holds
    afterwards) and the blocks it held before (the result when the fetch fails)."""

    future: concurrent.futures.Future[int]
    held: int


class RayDeploymentLink:
    """A :class:`raykv.integrations.vllm.link.DeploymentLink` over Ray actor calls.

    ``extra``: ``namespace`` (default "raykv"), ``ray_address``, ``worker`` (default 0),
    ``use_index`` (default True), ``timeout_s`` (default 10), ``engine`` (the name this engine's
    timing totals and store inboxes go to the worker under; a Serve replica sets it; default
    host, pid and a random suffix, so two engines of one process are two engines),
    ``tensor_parallel_size`` (set by the connector: a fetch then pulls every rank's pages).
    Raises StateError (no deployment) or a Ray error when nothing is reachable, ConfigError for
    a bad ``worker``.
    """

    def __init__(self, extra: Mapping[str, Any]) -> None:
        address = extra.get("ray_address") or os.environ.get("RAY_ADDRESS") or "auto"
        self.cluster = _connect_keeping_signals(str(extra.get("namespace", "raykv")), str(address))
        self.worker = _worker_name(self.cluster, extra.get("worker", 0))
        self.handle = self.cluster.workers[self.worker]
        self.layout: KVLayout = self.cluster.config.layout  # until :meth:`bind`
        self.tpb = self.layout.tokens_per_block
        self.timeout_s = float(extra.get("timeout_s", 10.0))
        self.use_index = bool(extra.get("use_index", True))
        self.engine = str(
            extra.get("engine") or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        )
        self.ranks = int(extra.get("tensor_parallel_size", 1))
        self._bound = False
        self.address: Any = ray.get(self.handle.page_server_address.remote(), timeout=self.timeout_s)
        if self.address is None:
            raise StateError(f"{self.worker} runs no page server")
        self._queue: queue.Queue[list[InboxCommit] | None] = queue.Queue()
        self._done: collections.Counter[str] = collections.Counter()
        self._lock: Any = threading.Lock()
        self._thread: Any = threading.Thread(target=self._store_loop, daemon=True, name="raykv-vllm-stores")
        self._thread.start()
        self.counters: collections.Counter[str] = collections.Counter()
        self._fetches: concurrent.futures.ThreadPoolExecutor = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="raykv-fetch"
        )
        self._lookups = LookupThread(self._held_many, self._answer, self._count)
        self._timing_sent: concurrent.futures.Future[None] | None = None  # the last timing report
        self._quiet_until = 0.0  # no store warning before then (time.monotonic())

    def bind(self, layout: KVLayout, model: str, fingerprint: bytes) -> None:
        """Pair this engine with its worker (``CacheWorker.bind_engine``: a worker of a deployment
        started without a layout takes ``layout``); ConfigError when the worker cannot serve
        pages of ``layout``. The worker's page server may have moved: its address is read again."""
        call = self.handle.bind_engine.remote(self.engine, layout, model, fingerprint.hex())
        try:
            self.layout = ray.get(call, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ConfigError):  # the worker's own short message, not Ray's trace
                raise exc.cause.with_traceback(None) from None
            raise
        self.tpb = self.layout.tokens_per_block
        self._bound = True
        self.address = ray.get(self.handle.page_server_address.remote(), timeout=self.timeout_s)
        if self.address is None:
            raise StateError(f"{self.worker} runs no page server")

    def engine_link(self, inbox_bytes: int, listen_host: str) -> EngineLink:
        """The worker side's link, with ``tensor_parallel_size`` inboxes of ``inbox_bytes`` leased
        by the paired worker (:meth:`actors.cache.worker.CacheWorker.open_inboxes`) when the engine
        runs on the worker's node; on another node none (logged: such an engine stores nothing)."""
        assert self.address is not None
        mine = ray.get_runtime_context().get_node_id()
        same_node = self.address.node_id == mine
        node = self.address.node_id if same_node else f"vllm-engine-{mine}"
        token = self.cluster.spec.token
        inboxes: tuple[InboxLease, ...] = ()
        if same_node:
            call = self.handle.open_inboxes.remote(self.engine, self.ranks, int(inbox_bytes))
            inboxes = tuple(ray.get(call, timeout=self.timeout_s))
        else:
            log.warning("raykv: %s runs on another node than this engine: nothing is stored", self.worker)
        return EngineLink(str(self.worker), self.address, node, token, inboxes, listen_host)

    def lookup(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        hint: Mapping[str, Any],
        mm_items: tuple[MultimodalItem, ...] = (),
    ) -> Future[Match]:
        """A Future of the Match, answered on the lookup thread (actors.vllm.lookups), batched
        with the other lookups queued by then; the other ranks' keys of a tensor-parallel
        engine are computed there (the scheduler keys rank 0 only)."""
        others = None
        if self.ranks > 1:
            ids, count = list(tokens), len(keys)

            def others() -> list[list[bytes]]:
                scopes = [rank_scope(scope, r, self.ranks) for r in range(1, self.ranks)]
                return [[bytes(k) for k in block_keys(ids, self.tpb, s, mm_items)][:count] for s in scopes]

        return self._lookups.submit(Query(keys, dict(hint), others))

    def _held_many(self, chains: list[list[bytes]]) -> list[int]:
        """(On the lookup thread.) The paired worker's leading held blocks of each chain."""
        call = self.handle.held_many.remote(chains)
        return [int(n) for n in ray.get(call, timeout=self.timeout_s)]

    def _answer(self, queries: Sequence[Query], held: list[int]) -> list[Match]:
        """(On the lookup thread.) The Matches of ``queries`` whose every rank the paired worker
        holds ``held`` leading blocks of: a producer's hinted worker, else the best other worker
        of the router's match that came with the request (:meth:`_routed`, counted in
        ``lookups_routed``), else the index's best (one index call for those that need it,
        counted in ``lookups_indexed``)."""
        out: list[Match | None] = []
        asking = []
        for query, n in zip(queries, held):
            keys, hint = query.chain_all()[0], query.hint
            named = hint.get("worker")
            if n >= len(keys):
                out.append(Match(n))
            elif isinstance(named, str) and WorkerId(named) in self.cluster.workers:
                # The hinted worker itself is asked, by the fetch (the index may credit blocks a
                # routing decision only predicted, and the producer's may still be on their way;
                # when it is the paired worker, the fetch only waits for them).
                out.append(Match(n, named, min(len(keys), int(hint.get("blocks", len(keys)))), wait=True))
            elif not self.use_index:
                out.append(Match(n))
            else:
                out.append(self._routed(query, keys, n))
                if out[-1] is None:
                    asking.append(len(out) - 1)
        if asking:
            self._count("lookups_indexed", len(asking))
        routes = self.cluster.route_many([queries[i].chain_all()[0] for i in asking]) if asking else []
        for i, found in zip(asking, routes):
            best, most = None, held[i]
            for worker, match in found.items():
                if worker != self.worker and match.blocks > most:
                    best, most = worker, match.blocks
            out[i] = Match(held[i]) if best is None else Match(held[i], str(best), most)
        return [m if m is not None else Match(0) for m in out]

    def _routed(self, query: Query, keys: Sequence[bytes], held: int) -> Match | None:
        """(On the lookup thread.) The Match that the router's match in ``query``'s hint gives
        (:mod:`raykv.integrations.vllm.route`; the paired worker's own ``held`` is the worker's
        fresher answer): its best other worker holding more than ``held`` of ``keys``, as the
        index's answer would be used (``lookups_routed``). None, so that the index is asked,
        when no match came, or when it is malformed or names a worker this deployment does not
        have (``route_malformed``) or is about other keys than ``keys`` (``route_mismatched``:
        another block size, model, salt, adapter or prompt). Never raises."""
        try:
            route = query.route()
            if route is not None and not all(WorkerId(w) in self.cluster.workers for w in route.workers):
                raise ValueError(f"unknown workers in {sorted(route.workers)}")
        except ValueError as exc:
            self._count("route_malformed")
            log.debug("raykv: the router's match is ignored: %s", exc)
            return None
        if route is None:
            return None
        if not route.covers(keys):
            self._count("route_mismatched")
            return None
        self._count("lookups_routed")
        best = route.best_other(str(self.worker), held)
        return Match(held) if best is None else Match(held, best[0], best[1])

    def _held_by_all(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        mm_items: tuple[MultimodalItem, ...],
        handle: Any = None,
    ) -> int:
        """Leading blocks of ``tokens`` (with ``mm_items``) a worker (``handle``; default the
        paired one) holds for every tensor-parallel rank (one probe per rank, sent together)."""
        handle = self.handle if handle is None else handle
        ids = list(tokens)
        scopes = [rank_scope(scope, r, self.ranks) for r in range(self.ranks)]  # [scope] for one rank
        probes = [handle.probe.remote(ids, s.lora_id, s.salt, s.model, mm_items) for s in scopes]
        return min(int(p.num_blocks) for p in ray.get(probes, timeout=self.timeout_s))

    def start_fetch(
        self,
        match: Match,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        mm_items: tuple[MultimodalItem, ...] = (),
    ) -> Fetch:
        future: concurrent.futures.Future[int]
        try:
            future = self._fetches.submit(self._fetch, match, list(tokens), scope, list(keys), mm_items)
        except RuntimeError:  # closed
            future = concurrent.futures.Future()
            future.set_result(match.held)
        return Fetch(future, match.held)

    def _fetch(
        self,
        match: Match,
        tokens: list[int],
        scope: ReuseScope,
        keys: list[bytes],
        mm: tuple[MultimodalItem, ...],
    ) -> int:
        """(On a fetch thread.) Wait for the peer's blocks when asked to, have the paired worker
        pull them, and return how many leading blocks of ``keys`` it holds afterwards."""
        assert match.peer is not None
        peer = WorkerId(match.peer)
        others = [rank_scope(scope, r, self.ranks) for r in range(1, self.ranks)]
        try:
            have = self._await_peer(peer, tokens, scope, mm, match.blocks) if match.wait else match.blocks
            if have > match.held and peer != self.worker:
                self._pull_from(peer, keys[match.held : have])
                for other in others:  # a tensor-parallel engine's other ranks' pages
                    upto = tokens[: have * self.tpb]
                    chain = block_keys(upto, self.tpb, other, clip_mm_items(mm, len(upto)))
                    self._pull_from(peer, [bytes(k) for k in chain[match.held : have]])
        except Exception as exc:
            self._count("fetch_errors")
            log.warning("raykv fetch from %s into %s failed: %s", peer, self.worker, exc)
        return min(len(keys), self._held_by_all(tokens, scope, mm))

    def _await_peer(
        self, peer: WorkerId, tokens: list[int], scope: ReuseScope, mm: tuple[MultimodalItem, ...], want: int
    ) -> int:
        """How many of the leading ``want`` blocks ``peer`` holds (for every tensor-parallel
        rank), once it holds them all or ``timeout_s`` passed."""
        handle = self.cluster.workers[peer]
        deadline = time.monotonic() + self.timeout_s
        while True:
            have = min(want, self._held_by_all(tokens, scope, mm, handle))
            if have >= want or time.monotonic() >= deadline:
                if have < want:
                    self._count("fetch_wait_timeouts")
                return have
            time.sleep(0.02)

    def _pull_from(self, peer: WorkerId, keys: Sequence[bytes]) -> None:
        """Have the paired worker pull ``keys`` from ``peer``."""
        outcome: Any = ray.get(self.handle.pull.remote(str(peer), list(keys)), timeout=self.timeout_s)
        self._count("peer_pulls")
        self._count("peer_pulled_blocks", len(outcome.imported))

    def poll_fetch(self, fetch: Any, wait_s: float = 0.0) -> int | None:
        assert isinstance(fetch, Fetch)
        if wait_s > 0 and not fetch.future.done():
            concurrent.futures.wait([fetch.future], timeout=wait_s)
        if not fetch.future.done():
            return None
        try:
            return int(fetch.future.result())
        except Exception:  # cancelled, or the final probe failed
            return fetch.held

    def cancel_fetch(self, fetch: Any) -> None:
        assert isinstance(fetch, Fetch)
        fetch.future.cancel()

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._done[name] += amount

    def store(self, commits: Sequence[InboxCommit]) -> None:
        self._queue.put(list(commits))

    def _store_loop(self) -> None:
        """Send queued commits to the paired worker in order, all that are queued in one call."""
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            batch, stop = list(item), False
            taken = 1
            while not stop:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                taken += 1
                stop = more is None
                batch.extend(more or ())
            self._commit(batch)
            for _ in range(taken):
                self._queue.task_done()
            if stop:
                return

    def _commit(self, batch: list[InboxCommit]) -> None:
        """(On the store thread.) One ``commit_inbox`` call; its outcome goes to the counters."""
        try:
            result: InboxResult = ray.get(self.handle.commit_inbox.remote(batch), timeout=self.timeout_s)
            counts = {
                "stored_blocks": result.stored + result.present,
                "store_refused_blocks": result.refused,
                "commit_us": result.commit_us,
            }
            for reason in result.reasons[:3]:
                log.info("raykv: %s refused a store: %s", self.worker, reason)
        except Exception as exc:
            counts = {"store_errors": 1}
            if time.monotonic() >= self._quiet_until:  # one warning per WARN_EVERY_S, not per batch
                self._quiet_until = time.monotonic() + WARN_EVERY_S
                log.warning("raykv store into %s failed: %s", self.worker, exc)
        with self._lock:
            self._done.update(counts)

    def report_timing(self, totals: Sequence[int]) -> None:
        """Hand the totals to the paired worker from a fetch thread (an actor call costs the
        scheduler thread milliseconds now and then; a queued job, microseconds). While an
        earlier report is still on its way (a stalled worker) this one is dropped
        (``timing_skipped``): later totals include it, and fetch threads stay free."""
        if self._timing_sent is not None and not self._timing_sent.done():
            self._count("timing_skipped")
            return
        try:
            self._timing_sent = self._fetches.submit(self._send_timing, list(totals))
        except RuntimeError:  # closed
            pass

    def _send_timing(self, totals: list[int]) -> None:
        try:
            ray.get(self.handle.note_engine_timing.remote(self.engine, totals), timeout=self.timeout_s)
        except Exception as exc:
            self._count("timing_errors")
            log.warning("raykv timing report to %s failed: %s", self.worker, exc)

    def poll(self) -> dict[str, int]:
        with self._lock:
            done, self._done = dict(self._done), collections.Counter()
        return done

    def flush(self) -> None:
        """Wait until every store handed over so far was pulled (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self._lookups.close()
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self._queue.put(None)
        self._thread.join(self.timeout_s)
        if self._bound:
            try:
                self.handle.unbind_engine.remote(self.engine)
            except Exception as exc:  # the worker may be gone: nothing to unbind
                log.debug("raykv: unbinding %s failed: %s", self.engine, exc)


def _connect_keeping_signals(namespace: str, address: str) -> RayKVCluster:
    """``connect`` without letting Ray replace this process's SIGTERM/SIGINT handlers."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        return connect(namespace, address)
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)

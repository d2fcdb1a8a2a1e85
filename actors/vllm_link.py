"""The vLLM connector's line to a raykv deployment through Ray (see raykv.integrations.vllm.link).

Runs in vLLM's EngineCore process: joins the deployment's Ray cluster as a driver
(``ray_address``, else RAY_ADDRESS, else ``"auto"``: never starts a Ray instance of its own) and
talks to the paired CacheWorker and the index with actor calls that carry keys and counts only.
Pages never travel through Ray: the worker process moves them (raykv.transfer).

Stores are pulled by the paired CacheWorker one staged chain after another, in staging order, on a
daemon thread (a block imports only after its parent, so concurrent pulls could drop blocks).
Joining Ray keeps the process's SIGTERM/SIGINT handlers (Ray's driver would replace them with its
crash reporter, which kills vLLM's engine process without its orderly shutdown).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from actors.cluster import RayKVCluster, connect
from raykv.core.config import KVLayout
from raykv.core.errors import ConfigError, StateError
from raykv.core.keys import ReuseScope
from raykv.core.types import WorkerId
from raykv.integrations.vllm.plan import EngineLink
from raykv.transfer import PeerAddress

log = logging.getLogger(__name__)


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


class RayDeploymentLink:
    """A :class:`raykv.integrations.vllm.link.DeploymentLink` over Ray actor calls.

    ``extra``: ``namespace`` (default "raykv"), ``ray_address``, ``worker`` (default 0),
    ``use_index`` (default True), ``timeout_s`` (default 10). Raises StateError (no deployment)
    or a Ray error when nothing is reachable, ConfigError for a bad ``worker``.
    """

    def __init__(self, extra: Mapping[str, Any]) -> None:
        address = extra.get("ray_address") or os.environ.get("RAY_ADDRESS") or "auto"
        self.cluster = _connect_keeping_signals(str(extra.get("namespace", "raykv")), str(address))
        self.worker = _worker_name(self.cluster, extra.get("worker", 0))
        self.handle = self.cluster.workers[self.worker]
        self.layout: KVLayout = self.cluster.config.layout
        self.timeout_s = float(extra.get("timeout_s", 10.0))
        self.use_index = bool(extra.get("use_index", True))
        self.address: Any = ray.get(self.handle.page_server_address.remote(), timeout=self.timeout_s)
        if self.address is None:
            raise StateError(f"{self.worker} runs no page server")
        self._queue: queue.Queue[tuple[PeerAddress, list[bytes]] | None] = queue.Queue()
        self._done: collections.Counter[str] = collections.Counter()
        self._lock: Any = threading.Lock()
        self._thread: Any = threading.Thread(target=self._store_loop, daemon=True, name="raykv-vllm-stores")
        self._thread.start()
        self.counters: collections.Counter[str] = collections.Counter()
        self._waits: dict[bytes, float] = {}

    def engine_link(self, staging_bytes: int, listen_host: str) -> EngineLink:
        assert self.address is not None
        mine = ray.get_runtime_context().get_node_id()
        same_node = self.address.node_id == mine
        node = self.address.node_id if same_node else f"vllm-engine-{mine}"
        token = self.cluster.spec.token
        return EngineLink(str(self.worker), self.address, node, token, staging_bytes, listen_host)

    def lookup(
        self, tokens: Sequence[int], scope: ReuseScope, keys: Sequence[bytes], hint: Mapping[str, Any]
    ) -> int | None:
        try:
            held = self._held(self.handle, tokens, scope)
            if held >= len(keys):
                return held
            source = self._source(tokens, scope, keys, held, hint)
            if source is None:
                return held
            peer, most = source
            if most <= held:
                return None if most < 0 else held
            return self._pull_from(peer, tokens, scope, keys[held:most])
        except Exception as exc:
            self.counters["lookup_errors"] += 1
            log.warning("raykv lookup on %s failed: %s", self.worker, exc)
            return 0

    def _held(self, handle: Any, tokens: Sequence[int], scope: ReuseScope) -> int:
        probe = handle.probe.remote(list(tokens), scope.lora_id, scope.salt)
        return int(ray.get(probe, timeout=self.timeout_s).num_blocks)

    def _source(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        held: int,
        hint: Mapping[str, Any],
    ) -> tuple[WorkerId, int] | None:
        """The worker to pull from and how many leading blocks it holds (-1: the hinted worker
        does not hold the hinted blocks yet, wait); None when no other worker holds more. The
        hinted worker is asked directly (the index may credit blocks a routing decision only
        predicted)."""
        named = hint.get("worker")
        if isinstance(named, str) and named != self.worker and WorkerId(named) in self.cluster.workers:
            peer = WorkerId(named)
            want = min(len(keys), int(hint.get("blocks", len(keys))))
            have = self._held(self.cluster.workers[peer], tokens, scope)
            if have < want and not self._waited_enough(keys[0]):
                return peer, -1
            self._waits.pop(keys[0], None)
            return peer, have
        if not self.use_index:
            return None
        best, most = None, held
        for worker, match in self.cluster.route_keys(list(keys)).items():
            if worker != self.worker and match.blocks > most:
                best, most = worker, match.blocks
        return None if best is None else (best, most)

    def _waited_enough(self, first_key: bytes) -> bool:
        """Whether the wait for a hinted prefix (named by its first key) has run out."""
        since = self._waits.setdefault(first_key, time.monotonic())
        if len(self._waits) > 10_000:
            self._waits.pop(next(iter(self._waits)))
        return time.monotonic() - since > self.timeout_s

    def _pull_from(
        self, peer: WorkerId, tokens: Sequence[int], scope: ReuseScope, keys: Sequence[bytes]
    ) -> int:
        """Have the paired worker pull ``keys`` from ``peer``; its count afterwards."""
        outcome: Any = ray.get(self.handle.pull.remote(str(peer), list(keys)), timeout=self.timeout_s)
        self.counters["peer_pulls"] += 1
        self.counters["peer_pulled_blocks"] += len(outcome.imported)
        return self._held(self.handle, tokens, scope)

    def store(self, staging: PeerAddress, keys: Sequence[bytes]) -> None:
        self._queue.put((staging, list(keys)))

    def _store_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            staging, keys = item
            try:
                outcome: Any = ray.get(self.handle.pull.remote(staging, keys), timeout=self.timeout_s)
                counts = {"stored_blocks": len(outcome.imported) + len(outcome.already_present)}
            except Exception as exc:
                counts = {"store_errors": 1}
                log.warning("raykv store into %s failed: %s", self.worker, exc)
            finally:
                self._queue.task_done()
            with self._lock:
                self._done.update(counts)

    def poll(self) -> dict[str, int]:
        with self._lock:
            done, self._done = dict(self._done), collections.Counter()
        return done

    def flush(self) -> None:
        """Wait until every store handed over so far was pulled (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self.timeout_s)


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

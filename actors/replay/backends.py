"""Replay backends: in-process CacheWorkers, or a Ray deployment (``raykv replay``, ``raykv demo``).

Both run the same classes: :class:`actors.testing.TestingCacheWorker` (a CacheWorker whose content
oracle stands in for the engine) publishing event batches into
:class:`raykv.index.prefix_index.PrefixIndex` shards.

- :class:`InProcessBackend`: TestingCacheWorker objects in this process, their ``sink`` feeding one
  PrefixIndex directly; a pull is ``export_blocks`` -> ``import_blocks`` (the transfer's data
  path minus the transport) (events are flushed after every request, so the index is exact when the
  next request is routed). The index's clock is the replay's simulated clock, so a routing
  prediction lives ``predict_ttl_s`` simulated seconds. Used for the big Mooncake grids and tests.
- :class:`RayBackends`: a raykv deployment (``raykv.start`` with
  ``worker_class=TestingCacheWorker``) of W CPU workers and the index shards; requests go through
  the deployment's index client and ``run_request`` on the worker actors; pulls are real page
  transfers (``CacheWorker.pull``: the destination pulls from the holder's page server, shared
  memory on one node, UCX across nodes). Between routers the workers are cleared (``AllCleared``
  empties their index entries). A new capacity restarts the deployment. The pooled ideal is an
  in-process TestingCacheWorker (a bound, not a deployment).

Replay pages are tiny: one layer with K and V of shape (1,) int8, 512 tokens per block (1 KiB a
page), all on the top (host) tier; the timing model prices transfers in a real model's KV bytes.
``ray`` is imported only by RayBackends.
"""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import actors.replay.ray_tree  # noqa: F401 - registers Ray's PrefixTree for the ray_prefix router
from actors.testing import RequestOutcome, TestingCacheWorker
from raykv.core.config import BufferSpec, CacheConfig, KVLayout, LayerSpec, TierConfig
from raykv.core.types import TierKind, WorkerId
from raykv.index.prefix_index import PrefixIndex, RouteMatch
from raykv.replay.engine import Backend, Outcome
from raykv.replay.trace import BLOCK_TOKENS


def replay_layout() -> KVLayout:
    """One layer, K and V of shape (1,) int8, 512 tokens per block: 1 KiB pages."""
    kv = (BufferSpec("k", (1,), "int8"), BufferSpec("v", (1,), "int8"))
    return KVLayout(layers=(LayerSpec(0, kv),), tokens_per_block=BLOCK_TOKENS)


def replay_config(blocks: int, shared: bool = False) -> CacheConfig:
    """A worker holding ``blocks`` pages on its only (top, host) tier; ``shared``: in /dev/shm,
    so same-node peers pull from it through shared memory (one-sided once connected)."""
    layout = replay_layout()
    tier = TierConfig.host(blocks * layout.page_bytes, pin_memory=False, shared=shared)
    return CacheConfig(layout, (tier,))


def _levels(out: RequestOutcome, kinds: Sequence[TierKind]) -> Outcome:
    by_kind = dict(zip(TierKind, out.reused_by_tier))
    return Outcome(out.reused_tokens, tuple(by_kind.get(k, 0) for k in kinds))


def verify_sample(worker: TestingCacheWorker, sample: int, seed: int = 0) -> int:
    """Export up to ``sample`` random committed blocks of ``worker`` and check them against the
    oracle; returns how many were checked (AssertionError on a wrong byte)."""
    keys = [b.key for b in worker.manager.committed_blocks()]
    picked = random.Random(seed).sample(keys, min(sample, len(keys)))
    for block in worker.export_blocks(picked):
        if not worker.oracle.check(block.data, block.key, block.num_tokens):
            raise AssertionError(f"{worker.worker_id}: block {block.key.hex()[:16]} holds the wrong bytes")
    return len(picked)


class InProcessBackend:
    """``num_caches`` TestingCacheWorkers of ``blocks`` pages each, feeding one in-process PrefixIndex."""

    def __init__(self, num_caches: int, blocks: int, predict_ttl_s: float = 0.5) -> None:
        config = replay_config(blocks)
        self.kinds = [t.kind for t in config.tiers]
        self.capacity_blocks = blocks
        self.page_bytes = config.layout.page_bytes
        self._now = 0.0
        self.index = PrefixIndex(predict_ttl_s=predict_ttl_s, clock=lambda: self._now)
        self.route: Callable[[Sequence[bytes]], dict[WorkerId, RouteMatch]] = self.index.route  # no wrapper
        self.worker_ids = [WorkerId(f"w{i}") for i in range(num_caches)]
        self.workers: dict[WorkerId, TestingCacheWorker] = {}
        for lane, wid in enumerate(self.worker_ids):
            self.index.register_worker(wid, lane, 1)
            self.workers[wid] = TestingCacheWorker(
                wid, lane, config, sink=self.index.apply_batch, incarnation=1
            )

    @staticmethod
    def _get(refs: Any) -> Any:
        """``ray.get`` bounded by START_TIMEOUT_S (offline replays); UnavailableError past it."""
        from actors.cache.liveness import START_TIMEOUT_S, wait

        return wait(refs, "raykv workers", START_TIMEOUT_S)

    def set_clock(self, now: float) -> None:
        self._now = now

    def predict(self, worker: WorkerId, keys: Sequence[bytes]) -> None:
        self.index.predict(worker, keys)

    def run(self, worker: WorkerId, tokens: Any, salt: int | None) -> Outcome:
        w = self.workers[worker]
        out = w.run_request(tokens, salt=salt)
        w.flush_events()
        return _levels(out, self.kinds)

    def pull(self, src: WorkerId, dst: WorkerId, keys: Sequence[bytes]) -> int:
        """Export ``keys`` from ``src`` and import them into ``dst``; returns blocks imported.
        The source's copies then become its first victims (``cool_blocks``: one copy is enough)."""
        blocks = self.workers[src].export_blocks(keys)
        result = self.workers[dst].import_blocks(blocks)
        self.workers[src].cool_blocks(keys)
        self.workers[dst].flush_events()
        return len(result.imported)

    def verify(self, sample: int) -> int:
        """Oracle-check ``sample`` random cached pages per worker; returns how many."""
        return sum(verify_sample(w, sample, i) for i, w in enumerate(self.workers.values()))

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown()


@contextlib.contextmanager
def in_process(num_caches: int, blocks: int, pooled: bool = False) -> Iterator[Backend]:
    """A fresh :class:`InProcessBackend`, shut down on exit (the grid's backend factory)."""
    backend = InProcessBackend(num_caches, blocks)
    try:
        yield backend
    finally:
        backend.close()


class RayBackend:
    """A running raykv deployment seen as a replay Backend (see the module docstring)."""

    def __init__(self, cluster: Any, blocks: int) -> None:
        self.cluster = cluster
        self.worker_ids = list(cluster.worker_ids)
        self.capacity_blocks = blocks
        self.page_bytes = cluster.config.layout.page_bytes
        self.kinds = [t.kind for t in cluster.config.tiers]
        self.pull_paths: dict[str, int] = {}

    @staticmethod
    def _get(refs: Any) -> Any:
        """``ray.get`` bounded by START_TIMEOUT_S (offline replays); UnavailableError past it."""
        from actors.cache.liveness import START_TIMEOUT_S, wait

        return wait(refs, "raykv workers", START_TIMEOUT_S)

    def set_clock(self, now: float) -> None:
        """The deployment's index runs on real time (predictions expire in real seconds)."""

    def route(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]:
        return self.cluster.index.route(list(keys))  # type: ignore[no-any-return]

    def predict(self, worker: WorkerId, keys: Sequence[bytes]) -> None:
        self.cluster.index.predict(worker, list(keys))

    def run(self, worker: WorkerId, tokens: Any, salt: int | None) -> Outcome:
        handle = self.cluster.workers[worker]
        out = self._get(handle.run_request.remote(tokens, salt=salt))
        self._get(handle.flush_and_wait.remote())
        return _levels(out, self.kinds)

    def pull(self, src: WorkerId, dst: WorkerId, keys: Sequence[bytes]) -> int:
        """``dst`` pulls ``keys`` from ``src`` through its page server (``CacheWorker.pull``:
        shared memory on one node, UCX across nodes; counted per path in ``pull_paths``). Workers
        without page servers fall back to export -> import through the object store."""
        handle = self.cluster.workers[dst]
        if hasattr(handle, "pull"):
            outcome = self._get(handle.pull.remote(src, list(keys)))
            self.pull_paths[outcome.path] = self.pull_paths.get(outcome.path, 0) + len(outcome.imported)
            imported = len(outcome.imported)
        else:
            exported = self.cluster.workers[src].export_blocks.remote(list(keys))
            imported = len(self._get(handle.import_blocks.remote(exported)).imported)
            self.pull_paths["object store"] = self.pull_paths.get("object store", 0) + imported
        self._get([handle.flush_and_wait.remote(), self.cluster.workers[src].cool_blocks.remote(list(keys))])
        return imported

    def verify(self, sample: int) -> int:
        """Oracle-check every committed page of every worker actor (a superset of a sample)."""
        return sum(self._get([h.verify_all.remote() for h in self.cluster.workers.values()]))

    def reset(self) -> None:
        """Empty every worker's cache and wait until the index has forgotten it."""
        self._get([h.clear.remote() for h in self.cluster.workers.values()])
        self.cluster.flush()


class RayBackends:
    """Backend factory over one deployment per capacity (restarted when the capacity changes).

    ``start`` kwargs go to ``raykv.start`` (e.g. ``address``, ``index_shards``; the workers are
    always TestingCacheWorkers). The pooled ideal is served in-process. Call :meth:`close` (or use
    as a context manager) to shut down.
    """

    def __init__(self, num_workers: int, namespace: str | None = None, **start: Any) -> None:
        self.num_workers = num_workers
        self.namespace = namespace or f"raykv-replay-{uuid.uuid4().hex[:8]}"
        self.start_kwargs = start
        self.cluster: Any = None
        self.blocks = 0
        self.starts = 0

    @contextlib.contextmanager
    def __call__(self, num_caches: int, blocks: int, pooled: bool = False) -> Iterator[Backend]:
        if pooled:
            with in_process(num_caches, blocks) as backend:
                yield backend
            return
        if num_caches != self.num_workers:
            raise ValueError(f"this deployment has {self.num_workers} workers, not {num_caches}")
        if self.cluster is None or blocks != self.blocks:
            self._restart(blocks)
        backend = RayBackend(self.cluster, blocks)
        backend.reset()
        yield backend

    def _restart(self, blocks: int) -> None:
        import raykv

        self.close()
        self.cluster = raykv.start(
            num_workers=self.num_workers,
            config=replay_config(blocks, shared=True),
            namespace=f"{self.namespace}-{self.starts}",
            worker_class=TestingCacheWorker,
            **self.start_kwargs,
        )
        self.blocks = blocks
        self.starts += 1

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None

    def __enter__(self) -> RayBackends:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

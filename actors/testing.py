"""TestingCacheWorker: the production CacheWorker plus the hooks tests, the demo and the replay use.

The content oracle (:class:`raykv.testing.ContentOracle`) stands in for an inference engine: it
writes deterministic KV bytes per (key, layer, position) and checks them after any move. The
production :class:`actors.cache.worker.CacheWorker` has none of these methods; a deployment runs this
class when started with ``start(..., worker_class=TestingCacheWorker)`` (the tests' deployments,
``raykv demo`` and ``raykv replay`` through Ray), and in-process replays construct it directly.

:func:`disaggregated_request` is the prefill/decode flow with the oracle as engine: prefill on one
worker, pull exactly the committed prompt blocks into the decode worker, continue there.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from actors.cache.worker import CacheWorker
from actors.vllm.link import RayDeploymentLink
from raykv.core.errors import OutOfPagesError, TransferError, TransferFailure
from raykv.core.keys import MultimodalItem, ReuseScope
from raykv.core.tiers import DiskPool
from raykv.core.types import TierKind, WorkerId
from raykv.integrations.vllm.link import Match
from raykv.testing import ContentOracle
from raykv.transfer import PullOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutcome:
    """What one simulated request did on a worker (the oracle stands in for the engine)."""

    worker: WorkerId
    prompt_tokens: int
    reused_tokens: int
    reused_by_tier: tuple[int, int, int]  # blocks reused from GPU, host, disk
    committed_blocks: int


class TestingCacheWorker(CacheWorker):
    """A CacheWorker whose engine is the content oracle, with fault injection on its page server.

    Constructed with exactly the arguments of :class:`CacheWorker`; every production method
    behaves the same.
    """

    __test__ = False  # not a pytest test class, though its name starts with "Test"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._oracle = ContentOracle(self.manager.layout)

    @property
    def oracle(self) -> ContentOracle:
        """The content oracle of the layout in force (an engine may have re-laid the worker out)."""
        if self._oracle.layout != self.manager.layout:
            self._oracle = ContentOracle(self.manager.layout)
        return self._oracle

    def write_oracle(self, handle: int, first_block: int = 0) -> None:
        """Stand-in for the engine: write oracle KV into blocks ``first_block ..`` of the open
        request ``handle`` (InvalidArgumentError when no such request is open)."""
        self.oracle.fill_cache(self._cache(handle), first_block)

    def run_request(
        self,
        tokens: Sequence[int],
        lora_id: int | None = None,
        salt: int | None = None,
        decode_tokens: Sequence[int] = (),
        verify: bool = False,
    ) -> RequestOutcome:
        """A whole request with the oracle as engine: reuse, prefill the rest, decode, commit.

        The request is closed on return; its committed blocks stay cached and publish their events
        like any commit. Raises OutOfPagesError when the request cannot fit even after eviction.
        ``verify``: oracle-check the reused pages right after resume and every page before commit
        (AssertionError naming the first wrong block).
        """
        scope = ReuseScope(lora_id, salt)
        before = self.manager.probe(tokens, scope)
        with self.manager.create(tokens, scope) as cache:
            if not cache.resume():
                raise OutOfPagesError(f"{self.worker_id}: request does not fit on the top tier")
            reused = cache.num_reused_tokens  # after resume: a disk page failing its checksum cuts it
            if verify:
                self.oracle.verify_cache(cache)  # the reused blocks only, before anything is written
            cache.extend(tokens[reused:])
            self.oracle.fill_cache(cache, reused // cache.tokens_per_block)
            for tok in decode_tokens:
                cache.extend([tok])
                self.oracle.fill_cache(cache, cache.num_blocks - 1)
            if verify:
                self.oracle.verify_cache(cache)
            committed = cache.commit()
        tiers = before.tiers[: reused // self.manager.tokens_per_block]
        by_tier = tuple(sum(1 for t in tiers if t is k) for k in TierKind)
        return RequestOutcome(self.worker_id, len(tokens), reused, by_tier, committed)  # type: ignore[arg-type]

    def verify_all(self) -> int:
        """Oracle-verify every committed block; returns how many (AssertionError if bad)."""
        return self.oracle.verify_manager(self.manager)

    def check(self) -> None:
        """Check the manager's invariants (AssertionError naming the first broken one)."""
        self.manager.check_invariants()

    def corrupt_disk(self, n: int = 1, seed: int = 0) -> int:
        """Flip one byte in each of up to ``n`` committed pages on this worker's disk tier (picked
        with ``seed``), in its file, as a failing disk would. Returns how many pages were hit (0
        without a disk tier or disk pages); reads must notice them by their checksums."""
        manager = self.manager
        pool = manager.pools[-1]
        if not isinstance(pool, DiskPool):
            return 0
        level = len(manager.pools) - 1
        with manager.locked():
            pages = sorted(int(b.page.slot) for b in manager.tree.iter_blocks() if b.page.level == level)
            victims = random.Random(seed).sample(pages, min(n, len(pages)))
            with open(pool.path, "r+b") as f:
                for slot in victims:
                    f.seek(slot * pool.stride)
                    old = f.read(1)
                    f.seek(slot * pool.stride)
                    f.write(bytes([old[0] ^ 0xFF]))
        return len(victims)

    def set_transfer_faults(self, **faults: Any) -> None:
        """Set :class:`raykv.transfer.ServerFaults` fields on this worker's page server; they stay
        until set again. TransferError (reason "unavailable") without a page server, ValueError
        for an unknown field (nothing set then)."""
        server = self.transfer.server
        if server is None:
            raise TransferError("no page server", reason=TransferFailure.UNAVAILABLE)
        unknown = [name for name in faults if not hasattr(server.faults, name)]
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}")
        for name, value in faults.items():
            setattr(server.faults, name, value)


# ---- prefill / decode ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DisaggregatedOutcome:
    """One request split over a prefill and a decode worker."""

    prefill: RequestOutcome
    pull: PullOutcome | None  # None when the pull failed and the decode worker recomputed
    decode: RequestOutcome
    seconds: float


def disaggregated_request(
    prefill: Any,
    decode: Any,
    prefill_name: str,
    keys: Sequence[bytes],
    prompt: Sequence[int],
    decode_tokens: Sequence[int] = (),
    timeout_s: float = 120.0,
) -> DisaggregatedOutcome:
    """Prefill ``prompt`` on TestingCacheWorker actor ``prefill``, pull its blocks ``keys`` into
    actor ``decode``, then run the request there (its ``create`` reuses the pulled blocks).

    ``keys`` are the prompt's block keys (``RayKVCluster.keys(prompt)``). A failed pull is not
    fatal: the decode worker recomputes (``pull`` is None then).
    """
    import ray

    start = time.perf_counter()
    first = ray.get(prefill.run_request.remote(list(prompt)), timeout=timeout_s)
    try:
        pulled = ray.get(decode.pull.remote(prefill_name, list(keys)), timeout=timeout_s)
    except TransferError as exc:
        log.warning("pull from %s failed (%s); decode worker recomputes", prefill_name, exc)
        pulled = None
    second = ray.get(
        decode.run_request.remote(list(prompt), decode_tokens=list(decode_tokens)), timeout=timeout_s
    )
    return DisaggregatedOutcome(first, pulled, second, time.perf_counter() - start)


class FaultyDeploymentLink(RayDeploymentLink):
    """The vLLM connector's deployment link with two faults for tests, asked for by a request's
    ``kv_transfer_params["raykv"]["faults"]``, each right after a lookup that found blocks:

    - ``{"drop_after_lookup": True}``: every reusable block of the paired CacheWorker is dropped,
      so the load that follows finds its pages gone;
    - ``{"replace_after_lookup": tokens}``: the same, then the worker (a
      :class:`TestingCacheWorker`) runs a request of ``tokens``, whose new blocks may take the
      freed slots, so the load may find other blocks' pages where its own were.

    Either way the engine must recompute those blocks. Its lookups wait for their answer (the
    fault must follow the lookup it hooks).

    Named in the connector's extra config as ``link="actors.testing:FaultyDeploymentLink"``; the
    production link (:class:`actors.vllm.link.RayDeploymentLink`) has no such hook.
    ``counters["fault_dropped_blocks"]`` counts the blocks dropped.
    """

    def lookup(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        hint: Mapping[str, Any],
        mm_items: tuple[MultimodalItem, ...] = (),
    ) -> Match:
        held = super().lookup(tokens, scope, keys, hint, mm_items).result(timeout=self.timeout_s)
        faults = hint.get("faults") if isinstance(hint, Mapping) else None
        if not held.held or not isinstance(faults, Mapping):
            return held
        replacement = faults.get("replace_after_lookup")
        if faults.get("drop_after_lookup") or replacement:
            dropped = ray.get(self.handle.clear.remote(), timeout=self.timeout_s)
            self.counters["fault_dropped_blocks"] += int(dropped)
        if replacement:
            ray.get(self.handle.run_request.remote(list(replacement)), timeout=self.timeout_s)
        return held


class PairingProbe:
    """Stands in for a Serve replica's connector backend on one node (run it as an actor pinned to
    that node): pairs as :func:`actors.serve.deployments.pair_on_node` does for a replica."""

    def __init__(self, namespace: str) -> None:
        from actors.cache.cluster import connect

        self.cluster = connect(namespace)

    def pair(self, engine: str, model: str, rank: int) -> str:
        """The worker a replica of ``model`` with ``rank`` pairs with, or ``"none: <why>"``."""
        from actors.serve.deployments import NoWorkerOnNode, pair_on_node

        try:
            return pair_on_node(self.cluster, [str(w) for w in self.cluster.worker_ids], engine, model, rank)
        except NoWorkerOnNode as exc:
            return f"none: {exc}"

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

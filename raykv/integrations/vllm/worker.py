"""The connector's worker side (runs in vLLM's worker process): the data plane.

No Ray here. The scheduler side sends an :class:`~raykv.integrations.vllm.plan.EngineLink` in
every step's metadata; on first sight the worker side opens:

- a :class:`raykv.transfer.PageClient` to its CacheWorker's page server. Loads pull pages by key:
  one-sided reads of the worker's shared host tier after the first connection (no request at
  all), else the ``shm`` request path, else ``ucx`` (pages on the disk tier); never Ray's object
  store. A key the worker no longer has, or a page that changed while it was read (the one-sided
  reader re-checks the slot generations), fails that block's load; the block and every later one
  of the request are reported through ``get_block_ids_with_load_errors`` and vLLM recomputes them
  (``kv_load_failure_policy="recompute"``). An asynchronous load (its pages were fetched to the
  CacheWorker in the background while the request waited) is loaded the same way in the step that
  carries it, a step without a forward pass too, and its request is reported finished receiving
  through ``get_finished`` in that step, with its failed blocks in the same step's load errors.
- a staging :class:`raykv.CacheManager` (one shared host tier, ``EngineLink.staging_bytes``) and a
  :class:`raykv.transfer.PageServer` on it. Stores copy the engine's blocks into staging pages and
  commit them; the scheduler side then asks the CacheWorker to pull those keys from this server
  (same node: one-sided reads of the staging tier). Staged blocks stay until the staging tier
  needs the room (LRU); a store the CacheWorker could not pull is a future miss, nothing else.

Under tensor parallelism every rank runs one worker side for its own KV heads: it stages and loads
pages keyed in :func:`~raykv.integrations.vllm.plan.rank_scope` (the load ops carry the prompt
tokens ranks above 0 key theirs from), and only rank 0 reports per-request figures (every rank
reports its load errors, which vLLM unions). An MLA engine's ranks hold the same latents: there
every rank loads rank 0's pages and only rank 0 stages, so a block is stored once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from raykv import (
    CacheConfig,
    CacheManager,
    KVLayout,
    OutOfPagesError,
    ReuseScope,
    TierConfig,
    TransferError,
    block_keys,
)
from raykv.core.keys import clip_mm_items
from raykv.core.tiers.host import HostPool
from raykv.integrations.vllm.copier import BlockCopier, is_pinned
from raykv.integrations.vllm.groups import GroupedCopier
from raykv.integrations.vllm.plan import (
    NULL_BLOCK,
    EngineLink,
    LoadOp,
    RaykvMetadata,
    StoreOp,
    WorkerReport,
    rank_scope,
)
from raykv.transfer import PageClient, PageServer, PeerAddress, TransferConfig

log = logging.getLogger(__name__)


class WorkerSide:
    """Loads and stores for one vLLM worker. ``names``: its attention layers in layout order.
    ``rank`` of ``ranks``: its tensor-parallel rank; a rank above 0 keys its pages in
    :func:`~raykv.integrations.vllm.plan.rank_scope` (its own KV heads) and reports only load
    errors per request (a request's other figures are rank 0's). ``replicated``: every rank
    holds the same KV (an MLA engine's latents): all ranks load rank 0's pages and only rank 0
    stages (the other ranks open no staging tier). ``groups``: the KV cache group of each layer
    of ``names`` when the engine addresses blocks per group (vLLM's hybrid manager, a sliding
    window: :class:`~raykv.integrations.vllm.groups.GroupedCopier`); a failed load then fails
    its whole request (:meth:`take_failed_requests`: vLLM takes no block-level errors there), and
    a store whose pages lack a group's block (outside a sliding window) is skipped."""

    def __init__(
        self,
        layout: KVLayout,
        names: Sequence[str],
        rank: int = 0,
        ranks: int = 1,
        replicated: bool = False,
        groups: Sequence[int] | None = None,
    ) -> None:
        rank_scope(ReuseScope(), rank, ranks)  # InvalidArgumentError for a bad rank
        self.rank, self.ranks = rank, ranks
        self.replicated = replicated
        self.stages = rank == 0 or not replicated
        self.layout = layout
        self.names = tuple(names)
        self.tpb = layout.tokens_per_block
        self.groups = tuple(groups) if groups is not None else None
        self.copier: BlockCopier | GroupedCopier | None = None
        self.link: EngineLink | None = None
        self.client: PageClient | None = None
        self.staging: CacheManager | None = None
        self.server: PageServer | None = None
        self._rows = np.empty((0, layout.page_bytes), dtype=np.uint8)
        self._rows_tensor: Any = None  # owns self._rows when they are page-locked
        self._failed: set[int] = set()
        self._failed_requests: set[str] = set()
        self._received: set[str] = set()
        self._report = WorkerReport()
        self._staging_at: PeerAddress | None = None  # the staging server's address, once started

    def register(self, kv_caches: Mapping[str, Any], kv_cache_layout: str | None = None) -> None:
        """Take the engine's per-layer KV tensors, stored as ``kv_cache_layout`` says (see
        :class:`~raykv.integrations.vllm.copier.BlockCopier`; InvalidArgumentError when they do
        not fit the layout, ConfigError when their format is ambiguous or has no engine_native
        pages)."""
        if self.groups is not None:
            self.copier = GroupedCopier(self.layout, self.names, self.groups, kv_caches, kv_cache_layout)
        else:
            self.copier = BlockCopier(self.layout, self.names, kv_caches, kv_cache_layout)

    def _open(self, link: EngineLink) -> None:
        """Connect to the deployment described by ``link`` (once)."""
        if self.link is not None:
            return
        self.link = link
        if link.listen_host == "127.0.0.1":
            config = TransferConfig.loopback(node_id=link.node_id)
        else:
            config = TransferConfig(host=link.listen_host, node_id=link.node_id)
        self.client = PageClient(link.token, config)
        if self._on_cuda():
            self.client.pin_for_cuda()
        if not self.stages:
            return
        tier = TierConfig.host(link.staging_bytes, pin_memory=False, shared=True)
        self.staging = CacheManager(CacheConfig(self.layout, (tier,)))
        if self._on_cuda():  # loads and stores then DMA host pages directly
            pool = self.staging.pools[0]
            if isinstance(pool, HostPool):
                pool.pin_for_cuda()
        self.server = PageServer(self.staging, link.token, config)
        self._staging_at = self.server.start()

    def _on_cuda(self) -> bool:
        """Whether the engine's KV tensors are on a CUDA device."""
        return self.copier is not None and getattr(self.copier.device, "type", "cpu") == "cuda"

    def _buffer(self, n: int) -> np.ndarray:
        """``n`` rows of the reusable pull buffer: page-locked for a CUDA engine, so a load's
        host-to-device copy reads it directly."""
        if len(self._rows) < n:
            shape = (max(n, 2 * len(self._rows)), self.layout.page_bytes)
            if self._on_cuda():
                import torch

                self._rows_tensor = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
                self._rows = self._rows_tensor.numpy()
            else:
                self._rows = np.empty(shape, dtype=np.uint8)
        return self._rows[:n]

    # ---- loads -----------------------------------------------------------------------------------
    def start_load(self, meta: RaykvMetadata) -> None:
        """Copy every planned load into the engine's blocks; failed and lost blocks are
        remembered for :meth:`take_failed`, the requests of asynchronous loads for
        :meth:`take_received` (the same step, after their load)."""
        if meta.link is not None:
            self._open(meta.link)
        for op in meta.loads:
            loaded = 0
            if op.keys:
                start = time.perf_counter()
                loaded = self._load(op) if self.copier is not None and self.client is not None else 0
                self._count(op.req_id, "load_us", int((time.perf_counter() - start) * 1e6))
                self._count(op.req_id, "loaded_blocks_ok", loaded)
            failed = op.block_ids[loaded:] + op.lost_block_ids
            if failed:
                if self.groups is not None:  # block ids are per group: vLLM takes the request
                    self._failed_requests.add(op.req_id)
                else:
                    self._failed.update(failed)
                self._report.count(op.req_id, "load_errors", len(failed))
            if op.is_async:
                self._received.add(op.req_id)

    def _count(self, req_id: str, name: str, amount: int = 1) -> None:
        """Count ``name`` overall, and for ``req_id`` on rank 0 (its results are rank 0's)."""
        if self.rank == 0:
            self._report.count(req_id, name, amount)
        else:
            self._report.counters[name] += amount

    def _keys(self, op: LoadOp) -> list[bytes]:
        """The keys of this rank's pages for ``op``'s blocks: ``op.keys`` on rank 0 (and on
        every rank of a ``replicated`` engine), else the
        same blocks keyed from ``op.tokens`` in this rank's scope (none when the op has no
        tokens: its blocks then fail and are recomputed)."""
        if self.rank == 0 or self.replicated:
            return list(op.keys)
        end = op.first_block + len(op.keys)
        if op.scope is None or len(op.tokens) < end * self.tpb:
            return []
        scope = rank_scope(op.scope, self.rank, self.ranks)
        tokens = op.tokens[: end * self.tpb]
        items = clip_mm_items(op.mm_items, len(tokens))
        return [bytes(k) for k in block_keys(tokens, self.tpb, scope, items)[op.first_block :]]

    def _load(self, op: LoadOp) -> int:
        """Load the leading pages of ``op`` that the CacheWorker still has; how many. A CUDA
        engine takes those on the CacheWorker's GPU tier first (device to device), then the rest
        from its host tiers."""
        keys, ids = self._keys(op), op.blocks()
        if not keys:
            return 0
        done = self._load_gpu(op.req_id, keys, ids) if self._on_cuda() else 0
        if done == len(keys):
            return done
        return done + self._load_host(op.req_id, keys[done:], ids[done:])

    def _load_gpu(self, req_id: str, keys: list[bytes], ids: list[Any]) -> int:
        """Copy the leading pages of ``keys`` that are on the CacheWorker's GPU tier straight
        from it (mapped into this process, :meth:`raykv.transfer.PageClient.land_gpu`) into
        engine blocks ``ids``; how many (0 when that path is not available or failed: the host
        paths then overwrite whatever it wrote)."""
        assert self.client is not None and self.link is not None and self.copier is not None
        copier, device = self.copier, self.copier.device.index or 0

        def land(pages: Any, slots: list[int], start: int, confirm: Callable[[], None]) -> None:
            copier.load_device(pages, slots, ids[start : start + len(slots)])
            confirm()

        try:
            landing = self.client.land_gpu(self.link.address, keys, device, land)
        except TransferError as exc:
            log.info("raykv: GPU-tier load of %d blocks failed (%s); trying the host paths", len(keys), exc)
            return 0
        if landing.path is not None:
            self._count(req_id, f"path_{landing.path}", 1)
        return landing.landed

    def _load_host(self, req_id: str, keys: list[bytes], ids: list[Any]) -> int:
        """Load the leading pages of ``keys`` from the CacheWorker's host tiers into engine
        blocks ``ids`` (one-sided when its shared tier lists them all, else a pull); how many."""
        assert self.client is not None and self.link is not None
        direct = self.client.land_local(
            self.link.address, keys, lambda pulled, confirm: self._land(req_id, ids, pulled, confirm)
        )
        if direct is not None:
            return int(direct)
        try:
            pulled = self.client.pull_sync(self.link.address, keys, out=self._buffer(len(keys)))
        except TransferError as exc:
            log.warning("raykv: load of %d blocks failed (%s); vLLM recomputes them", len(keys), exc)
            return 0
        row_of = {bytes(k): i for i, k in enumerate(pulled.keys)}
        rows = []
        for key in keys:
            if key not in row_of:
                break
            rows.append(row_of[key])
        if rows:
            data = pulled.data
            picked = data[: len(rows)] if rows == list(range(len(rows))) else data[rows]
            assert self.copier is not None
            self.copier.load(np.ascontiguousarray(picked), ids[: len(rows)])
            self._count(req_id, f"path_{pulled.path}", 1)
        return len(rows)

    def _land(self, req_id: str, ids: list[Any], pulled: Any, confirm: Any) -> int:
        """Copy one-sided rows (views of the CacheWorker's shared tier) straight into the
        engine's blocks ``ids``, then ``confirm`` they did not change meanwhile (else it raises
        and :meth:`_load_host` pulls again, overwriting the blocks)."""
        assert self.copier is not None
        self.copier.load(pulled.data, ids)
        confirm()
        self._count(req_id, "path_shm_read", 1)
        if self._on_cuda() and is_pinned(pulled.data):  # the mapping is page-locked: no staging
            self._count(req_id, "dma_direct_blocks", len(ids))
        return len(ids)

    def take_failed(self) -> set[int]:
        """Engine block ids whose load failed since the last call."""
        failed, self._failed = self._failed, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call, on an engine with block
        ids per group (vLLM's ``failed_recving``; each is also in :meth:`take_received`)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_received(self) -> set[str]:
        """Request ids whose asynchronous load ran since the last call (vLLM's finished
        receiving; their failed blocks are in :meth:`take_failed` of the same step)."""
        received, self._received = self._received, set()
        return received

    # ---- stores ----------------------------------------------------------------------------------
    def save(self, meta: RaykvMetadata) -> None:
        """Stage every planned store (after the step's forward pass wrote the KV)."""
        if meta.link is not None:
            self._open(meta.link)
        if self.staging is None or self.copier is None:
            return
        for op in meta.stores:
            keys = self._stage(op)
            if keys and self._staging_at is not None:
                self._report.staged.append((self._staging_at, keys))
                self._count(op.req_id, "staged_blocks", len(keys))

    def _stage(self, op: StoreOp) -> tuple[bytes, ...]:
        """Write blocks ``0 .. op.end_block - 1`` into staging pages and commit them; the keys of
        blocks ``op.first_block ..`` (empty when staging has no room)."""
        assert self.staging is not None and self.copier is not None
        scope = rank_scope(op.scope, self.rank, self.ranks)
        kv = self.staging.create(list(op.tokens), scope, mm_items=op.mm_items)
        try:
            if not kv.resume():
                self._report.counters["store_skipped"] += 1
                return ()
            have = kv.num_reused_tokens // self.tpb
            blocks: list[Any] = list(op.blocks()[have:])
            if self.groups is not None and NULL_BLOCK in np.asarray(blocks):
                self._report.counters["store_skipped"] += 1  # a page's window block is gone
                return ()
            kv.extend(list(op.tokens[have * self.tpb :]))
            rows = self._buffer(op.end_block - have)
            self.copier.save(blocks, rows)
            for j in range(len(rows)):
                kv.page(have + j)[:] = rows[j]
            kv.commit()
            keys = kv.committed_keys()  # every block of op.tokens (reused ones included)
        except OutOfPagesError:
            self._report.counters["store_skipped"] += 1
            return ()
        finally:
            kv.close()
        return tuple(bytes(k) for k in keys[op.first_block :])

    # ---- results ---------------------------------------------------------------------------------
    def take_report(self) -> WorkerReport | None:
        """This step's report (None when there is nothing to say)."""
        report = self._report
        self._report = WorkerReport()
        return report if report else None

    def close(self) -> None:
        """Stop the staging server, drop connections and release the staging tier."""
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()
        if self.staging is not None:
            self.staging.shutdown()
        self.server = self.client = self.staging = None

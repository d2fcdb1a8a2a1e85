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
- stores. On a CPU engine whose pages are its blocks verbatim (``engine_native``; MLA latents),
  the worker side shares its KV memory read-only with its CacheWorker
  (:mod:`raykv.transfer.kv_share`): a step's stores are one request naming the blocks, their
  tokens, scope and parent key; the CacheWorker keys the blocks itself, copies them straight out
  of the engine's memory into its pages (the one copy), commits them and answers, all within the
  step (vLLM may reuse a block once the step ends). A store not answered within
  :data:`STORE_WAIT_S` is abandoned (the CacheWorker discards it; its blocks are reported
  unstored and offered again) and stores take the inbox for :data:`LATE_COOLDOWN_S`. Otherwise,
  and on CUDA engines, stores go through the inbox its CacheWorker leased it
  (:mod:`raykv.transfer.inbox`; one per rank, in host shared memory): the worker side copies the
  engine's blocks from its KV tensors into free inbox slots (page-locked for CUDA so the device
  copy is a DMA) and reports the slots with the blocks' tokens, scope and parent key; the
  scheduler side hands them to the CacheWorker, which keys the blocks itself, commits them into
  its own pages (a second copy) and frees the slots. A store that finds too few free slots
  writes the leading blocks that fit: the others are counted (``store_backpressure_blocks``) and
  offered again in a later step while the request lives.

Under tensor parallelism every rank runs one worker side for its own KV heads: it stages and loads
pages keyed in :func:`~raykv.integrations.vllm.plan.rank_scope` (the load ops carry the prompt
tokens ranks above 0 key theirs from), and only rank 0 reports per-request figures (every rank
reports its load errors, which vLLM unions). An MLA engine's ranks hold the same latents: there
every rank loads rank 0's pages and only rank 0 stores, so a block is stored once.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from raykv import KVLayout, MultimodalItem, ReuseScope, StateError, TransferError, block_keys
from raykv.core.errors import CudaError, TransferFailure
from raykv.core.keys import chain_keys, clip_mm_items, tokens_to_array
from raykv.core.tiers.base import is_run
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
from raykv.transfer import PageClient, TransferConfig
from raykv.transfer.inbox import InboxCommit, InboxLease, InboxWriter
from raykv.transfer.kv_share.engine import SharedKV
from raykv.transfer.kv_share.memory import supported as sharing_supported
from raykv.transfer.kv_share.protocol import commit_wire
from raykv.transfer.planner import GPU_PEER, GPU_READ, SHM_READ, Endpoints, plan_paths

log = logging.getLogger(__name__)

LATE_COOLDOWN_S = 5.0
"""After a pull from the paired worker timed out (or could not connect), loads take only the
one-sided reads, which need nothing from the worker, for this long; pages those cannot read are
recomputed at once instead of each load waiting ``load_budget_ms`` for a stalled worker."""
STORE_WAIT_S = 0.25
"""The most a shared-memory store waits for the CacheWorker's copy and commit (a 64 MiB store takes
about 10 ms on a 2-core VM): past it the store is abandoned, as a stalled worker must not stall
its engine's steps."""
MAX_CHAINS = 4096
"""Requests whose last stored block key the worker side remembers (their next store's parent)."""


class WorkerSide:
    """Loads and stores for one vLLM worker. ``names``: its attention layers in layout order.
    ``rank`` of ``ranks``: its tensor-parallel rank; a rank above 0 keys its pages in
    :func:`~raykv.integrations.vllm.plan.rank_scope` (its own KV heads) and reports only load
    errors per request (a request's other figures are rank 0's). ``replicated``: every rank
    holds the same KV (an MLA engine's latents): all ranks load rank 0's pages and only rank 0
    stores (the other ranks map no inbox). ``groups``: the KV cache group of each layer
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
        self.inbox: InboxWriter | None = None
        self.shared: SharedKV | None = None
        """The KV memory shared with the CacheWorker (CPU engines): stores of one copy."""
        self._shared_after = 0.0  # shared stores wait for the worker again from then
        self._rows = np.empty((0, layout.page_bytes), dtype=np.uint8)
        self._rows_tensor: Any = None  # owns self._rows when they are page-locked
        self._failed: set[int] = set()
        self._failed_requests: set[str] = set()
        self._received: set[str] = set()
        self._report = WorkerReport()
        self._pulls_after = 0.0  # pulls wait for the worker again from then (time.monotonic())
        self._inbox_pinned = 0  # the inbox rows' address while page-locked for CUDA
        self._chains: collections.OrderedDict[str, tuple[int, bytes]] = collections.OrderedDict()
        """Per request, the last block stored and its key (the next store's parent)."""

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
        budget = link.load_budget_ms / 1e3  # a request waits on a load: never the pull defaults
        limits = {"node_id": link.node_id, "timeout_s": budget, "connect_timeout_s": budget}
        if link.listen_host == "127.0.0.1":
            config = TransferConfig.loopback(**limits)
        else:
            config = TransferConfig(host=link.listen_host, **limits)  # type: ignore[arg-type]
        self.client = PageClient(link.token, config)
        if self._on_cuda():
            self.client.pin_for_cuda()
        if self.stages and self.rank < len(link.inboxes):
            self._map_inbox(link)

    def _map_inbox(self, link: EngineLink) -> None:
        """Map this rank's inbox (page-locked for a CUDA engine, so stores DMA into it); without
        one (the lease's file is gone, or the engine is on another node) nothing is stored."""
        lease = link.inboxes[self.rank]
        try:
            self.inbox = InboxWriter(lease)
        except StateError as exc:
            log.warning("raykv: cannot map the inbox of %s (%s); nothing is stored", link.worker, exc)
            return
        if not self._on_cuda():
            self._share(lease, min(STORE_WAIT_S, link.load_budget_ms / 1e3))
        if self._on_cuda():
            from raykv.core.tiers.cuda_util import try_host_register

            rows = self.inbox.rows
            refused = try_host_register(int(rows.ctypes.data), rows.nbytes)
            if refused is not None:
                log.info("raykv: the inbox is not page-locked (%s); stores stage", refused)
            else:
                self._inbox_pinned = int(rows.ctypes.data)

    def _share(self, lease: InboxLease, timeout_s: float) -> None:
        """Share the engine's KV memory with the CacheWorker for one-copy stores
        (:mod:`raykv.transfer.kv_share`) where the pages are the blocks verbatim; else (or when
        the worker runs no store socket or refuses) stores go through the inbox."""
        if not lease.socket or self.groups is not None or not isinstance(self.copier, BlockCopier):
            return
        described = self.copier.shared_segments()
        if described is None or not sharing_supported():
            return
        memories, segments = described
        try:
            self.shared = SharedKV(
                lease.socket,
                lease.lease_id,
                memories,
                segments,
                self.copier.num_blocks,
                self.layout.page_bytes,
                timeout_s,
            )
        except StateError as exc:
            log.info("raykv: stores go through the inbox (%s)", exc)

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
        """Load the leading pages of ``op`` that the CacheWorker still has; how many. The paths
        are tried in the planner's order (:func:`raykv.transfer.planner.plan_paths`: on a CUDA
        engine its GPU tier one-sided, its shared host tier one-sided, its GPU tier by request,
        then a host request), each step taking the pages the ones before did not land."""
        keys, ids = self._keys(op), op.blocks()
        assert self.client is not None
        done = 0
        for step in plan_paths(Endpoints(on_gpu=self._on_cuda()), self.client.config):
            if done == len(keys):
                break
            done += self._load_step(step, op.req_id, keys[done:], ids[done:])
        return done

    def _load_step(self, step: str, req_id: str, keys: list[bytes], ids: list[Any]) -> int:
        """One step of a load's plan: how many leading pages of ``keys`` it landed in ``ids``."""
        if step in (GPU_READ, GPU_PEER):
            return self._load_gpu(req_id, keys, ids, step)
        if step == SHM_READ:
            assert self.client is not None and self.link is not None
            landed = self.client.land_local(
                self.link.address, keys, lambda pulled, confirm: self._land(req_id, ids, pulled, confirm)
            )
            return 0 if landed is None else int(landed)
        return self._pull(req_id, keys, ids)

    def _load_gpu(self, req_id: str, keys: list[bytes], ids: list[Any], step: str) -> int:
        """Copy the leading pages of ``keys`` that are on the CacheWorker's GPU tier straight
        from it (mapped into this process, :meth:`raykv.transfer.PageClient.land_gpu`; one-sided
        for ``gpu_read``, by request for ``gpu_peer``) into engine blocks ``ids``; how many (0
        when that path is not available or failed: later steps then overwrite what it wrote)."""
        assert self.client is not None and self.link is not None and self.copier is not None
        copier, device = self.copier, self.copier.device.index or 0

        def land(pages: Any, slots: list[int], start: int, confirm: Callable[[], None]) -> None:
            copier.load_device(pages, slots, ids[start : start + len(slots)])
            confirm()

        try:
            landing = self.client.land_gpu(
                self.link.address, keys, device, land, one_sided=step == GPU_READ, request=step == GPU_PEER
            )
        except TransferError as exc:
            log.info("raykv: GPU-tier load of %d blocks failed (%s); trying the host paths", len(keys), exc)
            return 0
        if landing.path is not None:
            self._count(req_id, f"path_{landing.path}", 1)
        return landing.landed

    def _pull(self, req_id: str, keys: list[bytes], ids: list[Any]) -> int:
        """The last step of a load: ask the CacheWorker for the leading pages of ``keys`` (its
        page server answers ``shm`` or ``ucx``) and copy them into engine blocks ``ids``; how
        many. Skipped (0) for :data:`LATE_COOLDOWN_S` after the worker failed to answer."""
        assert self.client is not None and self.link is not None
        if time.monotonic() < self._pulls_after:  # the worker did not answer lately: no waiting
            self._count(req_id, "loads_skipped_late", 1)
            return 0
        try:
            pulled = self.client.pull_sync(
                self.link.address, keys, out=self._buffer(len(keys)), one_sided=False
            )
        except TransferError as exc:
            if exc.reason in (TransferFailure.TIMEOUT, TransferFailure.CONNECT):
                self._pulls_after = time.monotonic() + LATE_COOLDOWN_S
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
        and the plan's next step pulls them, overwriting the blocks)."""
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
        """Write every planned store into inbox slots (after the step's forward pass wrote the
        KV) and report them for commit."""
        if meta.link is not None:
            self._open(meta.link)
        if self.inbox is None or self.copier is None:
            return
        shared: list[StoreOp] = []
        for op in meta.stores:
            if op.end_block <= op.first_block:
                continue
            if self._shares(op):
                shared.append(op)
            else:
                self._store(op)
        if shared:
            self._store_shared(shared)

    def _shares(self, op: StoreOp) -> bool:
        """Whether ``op`` goes through the shared memory: it is shared, the worker answered
        lately, and every block of the store lies in it."""
        if self.shared is None or time.monotonic() < self._shared_after:
            return False
        return self.shared.covers(op.blocks()[op.first_block : op.end_block])

    def _store_shared(self, ops: list[StoreOp]) -> None:
        """One request for every store of ``ops``: the CacheWorker copies their blocks out of
        the shared memory into its pages and commits them before it answers. A store it did
        not answer in time is abandoned and its blocks reported unstored (offered again while
        the request lives), as are all of them when the connection broke (later stores then go
        through the inbox); blocks it refused are counted, as the inbox's commits count them."""
        assert self.shared is not None
        start = time.perf_counter()
        commits = []
        for op in ops:
            scope, tokens, parent = self._keyed(op, op.end_block)
            blocks = op.blocks()[op.first_block : op.end_block]
            commits.append(commit_wire(blocks, op.first_block, parent, tokens, scope, op.mm_items, op.req_id))
        try:
            answer = self.shared.store(commits)
        except StateError as exc:
            log.warning("raykv: shared stores stop (%s); stores go through the inbox", exc)
            self.shared.close()
            self.shared, answer = None, None
        took = time.perf_counter() - start
        if answer is None and self.shared is not None:
            self._shared_after = time.monotonic() + LATE_COOLDOWN_S
        total = sum(op.end_block - op.first_block for op in ops)
        for i, op in enumerate(ops):
            n = op.end_block - op.first_block
            stored, present, refused, abandoned = answer["per"][i] if answer is not None else (0, 0, 0, n)
            if n > abandoned:
                self._count(op.req_id, "staged_blocks", n - abandoned)
                self._count(op.req_id, "shared_store_blocks", n - abandoned)
            self._count(op.req_id, "store_us", int(took * 1e6 * n / total))
            self._count(op.req_id, "stored_blocks", stored + present)
            for name, value in (("store_refused_blocks", refused), ("store_abandoned_blocks", abandoned)):
                if value:
                    self._count(op.req_id, name, value)
            if abandoned:
                unstored = self._report.unstored
                unstored[op.req_id] = min(op.first_block, unstored.get(op.req_id, op.first_block))

    def _store(self, op: StoreOp) -> None:
        """Copy blocks ``op.first_block ..`` into free slots and add their commit to the report.
        With too few free slots, as many leading blocks as fit are written and the rest are
        reported unstored (counted as ``store_backpressure_blocks``); a window block gone on a
        grouped engine skips the store."""
        assert self.inbox is not None and self.copier is not None
        first, n = op.first_block, op.end_block - op.first_block
        blocks: list[Any] = list(op.blocks()[first:])
        if self.groups is not None and NULL_BLOCK in np.asarray(blocks):
            self._report.counters["store_skipped"] += 1  # a page's window block is gone
            return
        fit = min(n, self.inbox.free_slots())
        if fit < n:
            self._count(op.req_id, "store_backpressure_blocks", n - fit)
            unstored = self._report.unstored
            unstored[op.req_id] = min(first + fit, unstored.get(op.req_id, first + fit))
        slots = self.inbox.reserve(fit) if fit else None
        if slots is None:
            return
        start = time.perf_counter()
        end = first + fit
        try:
            self._write(slots, blocks[:fit])
            scope, tokens, parent = self._keyed(op, end)
        except BaseException:
            self.inbox.cancel(slots)
            raise
        lease = self.inbox.lease.lease_id
        commit = InboxCommit(lease, tuple(slots), tokens, scope, first, parent, op.mm_items, op.req_id)
        self._report.commits.append(commit)
        self._count(op.req_id, "staged_blocks", fit)
        self._count(op.req_id, "store_us", int((time.perf_counter() - start) * 1e6))

    def _write(self, slots: list[int], blocks: list[Any]) -> None:
        """Copy engine ``blocks`` into inbox ``slots``: straight into their rows when the slots
        are one run, else through the row buffer."""
        assert self.inbox is not None and self.copier is not None
        rows = self.inbox.rows
        if is_run(slots):
            self.copier.save(blocks, rows[slots[0] : slots[0] + len(slots)])
            return
        buffer = self._buffer(len(slots))
        self.copier.save(blocks, buffer)
        rows[np.asarray(slots, dtype=np.intp)] = buffer

    def _keyed(self, op: StoreOp, end: int) -> tuple[ReuseScope, tuple[int, ...], bytes | None]:
        """What a commit of ``op``'s blocks up to ``end`` names: this rank's scope, the tokens
        through block ``end - 1`` and the key of the block before ``op.first_block``."""
        scope = rank_scope(op.scope, self.rank, self.ranks)
        tokens = op.tokens[: end * self.tpb]
        return scope, tokens, self._parent(op.req_id, tokens, op.first_block, op.mm_items, scope)

    def _parent(
        self,
        req_id: str,
        tokens: tuple[int, ...],
        first: int,
        mm_items: tuple[MultimodalItem, ...],
        scope: ReuseScope,
    ) -> bytes | None:
        """The key in ``scope`` of block ``first - 1`` of ``tokens`` (None for block 0), from the
        request's last store when it ended there, else hashed from the tokens; remembers the key
        of the last full block of ``tokens`` for the request's next store."""
        end = len(tokens) // self.tpb
        known = self._chains.pop(req_id, None)
        array = tokens_to_array(tokens[: end * self.tpb])
        parent: bytes | None
        base: bytes
        if first == 0:
            parent, base, start = None, scope.root_key(), 0
        elif known is not None and known[0] == first:
            parent = base = known[1]
            start = first
        else:
            base, start = scope.root_key(), 0
            parent = None
        keys = chain_keys(base, array, self.tpb, start, clip_mm_items(mm_items, end * self.tpb))
        if first > 0 and parent is None:
            parent = bytes(keys[first - 1])
        self._chains[req_id] = (end, bytes(keys[-1]))
        while len(self._chains) > MAX_CHAINS:
            self._chains.popitem(last=False)
        return parent

    # ---- results ---------------------------------------------------------------------------------
    def take_report(self) -> WorkerReport | None:
        """This step's report (None when there is nothing to say)."""
        report = self._report
        self._report = WorkerReport()
        return report if report else None

    def close(self) -> None:
        """Drop the page client, the store socket and unmap the inbox."""
        if self.client is not None:
            self.client.close()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self._inbox_pinned:
            from raykv.core.tiers.cuda_util import host_unregister

            try:
                host_unregister(self._inbox_pinned)
            except CudaError as exc:
                log.warning("raykv: unpinning the inbox failed (%s)", exc)
            self._inbox_pinned = 0
        if self.inbox is not None:
            self.inbox.close()
        self.client = self.inbox = None

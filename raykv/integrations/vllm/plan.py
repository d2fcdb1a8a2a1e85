"""What the scheduler side tells the worker side each step, and what comes back (pure records).

These cross vLLM's process boundary (EngineCore -> worker process in the connector metadata,
worker -> EngineCore in the worker metadata), so they are plain picklable dataclasses.

- :class:`EngineLink`: how the worker side reaches its CacheWorker's pages (page-server address,
  node id, deployment token) and the inboxes it writes stores into (one lease per rank). Sent in
  every step's metadata.
- :class:`LoadOp`: copy the pages of ``keys`` into engine blocks ``block_ids`` (failures become
  vLLM load errors). Synchronous ones run before the forward pass of the step that computes on
  them; asynchronous ones (``is_async``) belong to a request waiting in vLLM's
  WAITING_FOR_REMOTE_KVS, are loaded in whatever step carries them (a step without a forward
  pass too) and report the request as finished receiving in that step.
- :class:`StoreOp`: after the forward pass, write the KV of the request's blocks
  ``first_block .. end_block - 1`` (tokens ``tokens``) into leased inbox slots and report them as
  :class:`~raykv.transfer.inbox.InboxCommit` records for the CacheWorker to commit.
- :class:`WorkerReport`: the worker side's inbox commits, the stores it could not take (no free
  slots: offered again later) and its counters, folded over workers with
  :meth:`WorkerReport.aggregate`.

Under tensor parallelism each rank holds some KV heads of every block, so each rank has its own
pages: rank ``r`` of ``n`` keys its blocks in :func:`rank_scope` (rank 0 in the request's own
scope, so the index and routers see rank 0's keys as those of any engine), stores them from its
own inbox and loads its own; the deployment's layout is one rank's.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Any

from raykv import InvalidArgumentError, MultimodalItem, ReuseScope
from raykv.transfer import PeerAddress
from raykv.transfer.inbox import InboxCommit, InboxLease


@dataclass(frozen=True)
class EngineLink:
    """The worker side's view of the deployment: its CacheWorker's page server, the node id to
    use (equal to the CacheWorker's when both run on one Ray node, which enables the
    shared-memory paths), the deployment token, the inbox leases (``inboxes[r]``: rank ``r``'s;
    none when the engine runs on another node than its CacheWorker: it stores nothing), the
    host its page client binds and ``load_budget_ms``, the most a load's pull from the
    CacheWorker (connect included) may take before its blocks are recomputed."""

    worker: str
    address: PeerAddress
    node_id: str
    token: bytes = field(repr=False)
    inboxes: tuple[InboxLease, ...] = ()
    listen_host: str = "127.0.0.1"
    load_budget_ms: float = 2000.0


def rank_scope(scope: ReuseScope, rank: int, ranks: int) -> ReuseScope:
    """The scope rank ``rank`` of a ``ranks``-way tensor-parallel engine keys its pages in:
    ``scope`` itself for rank 0 (and for an engine of one rank), else ``scope``'s LoRA and model
    with a salt derived from ``scope``'s salt, ``rank`` and ``ranks`` (SHA-256; deterministic in every
    process). InvalidArgumentError unless ``0 <= rank < ranks``."""
    if not (isinstance(rank, int) and isinstance(ranks, int) and 0 <= rank < ranks):
        raise InvalidArgumentError("rank", f"need 0 <= rank < ranks, got rank {rank!r} of {ranks!r}")
    if rank == 0:
        return scope
    text = f"raykv-tensor-parallel/{ranks}/{rank}/{scope.salt}".encode()
    return ReuseScope(scope.lora_id, int.from_bytes(hashlib.sha256(text).digest()[:8], "little"), scope.model)


NULL_BLOCK = 0
"""vLLM's null block id: a KV cache group's placeholder for a block it does not keep (the
positions before a sliding window); never a block of data."""


def grouped_ids(
    block_ids: tuple[int, ...], group_ids: tuple[tuple[int, ...], ...]
) -> list[tuple[int, ...]] | list[int]:
    """``block_ids`` as a list when there are no other groups, else per position the tuple of its
    block in every group (group 0 first). InvalidArgumentError when a group's ids are not aligned
    with ``block_ids``."""
    if not group_ids:
        return list(block_ids)
    if any(len(g) != len(block_ids) for g in group_ids):
        raise InvalidArgumentError("group_ids", "every group needs one block per page")
    return list(zip(block_ids, *group_ids))


@dataclass(frozen=True)
class LoadOp:
    """Load the pages of ``keys`` (a prompt's blocks ``first_block ..``) into ``block_ids``.

    ``lost_block_ids``: engine blocks of the same load whose pages are known to be unavailable
    (an asynchronous fetch did not bring them): reported as load errors without a try, so vLLM
    recomputes them. ``is_async``: the request waits in WAITING_FOR_REMOTE_KVS; the worker side
    reports ``req_id`` as finished receiving (``get_finished``) in the step that carries the op,
    after loading, with the failed blocks in the same step's load errors. An async op with no
    keys and no lost blocks only releases a request that finished while its load was pending.
    ``tokens``, ``scope`` and ``mm_items`` (sent to tensor-parallel engines only): the prompt
    through the last block of the load, its scope and its multimodal items, from which ranks
    above 0 key their own pages (:func:`rank_scope`); ``keys`` are rank 0's. ``group_ids``: for
    an engine whose layers sit in several KV cache groups, the blocks of groups 1.. for the same
    pages, each aligned with ``block_ids`` (group 0's); ``NULL_BLOCK`` where a group keeps no
    block (outside a sliding window): that group's layers of that page are not loaded.
    """

    req_id: str
    first_block: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    is_async: bool = False
    lost_block_ids: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    scope: ReuseScope | None = None
    group_ids: tuple[tuple[int, ...], ...] = ()
    mm_items: tuple[MultimodalItem, ...] = ()

    def blocks(self) -> list[tuple[int, ...]] | list[int]:
        """Per page its engine block, or with ``group_ids`` its block in every group (group 0
        first): what the worker side's copier takes."""
        return grouped_ids(self.block_ids, self.group_ids)


@dataclass(frozen=True)
class StoreOp:
    """Store blocks ``first_block .. end_block - 1`` of a request: ``tokens`` are the tokens of
    blocks ``0 .. end_block - 1``, ``scope`` and ``mm_items`` what else their keys name,
    ``block_ids`` the engine blocks holding blocks ``0 .. end_block - 1`` (``group_ids`` those of
    groups 1.. as in :class:`LoadOp`)."""

    req_id: str
    tokens: tuple[int, ...]
    scope: ReuseScope
    block_ids: tuple[int, ...]
    first_block: int
    group_ids: tuple[tuple[int, ...], ...] = ()
    mm_items: tuple[MultimodalItem, ...] = ()

    def blocks(self) -> list[tuple[int, ...]] | list[int]:
        """As :meth:`LoadOp.blocks`."""
        return grouped_ids(self.block_ids, self.group_ids)

    @property
    def end_block(self) -> int:
        return len(self.block_ids)


@dataclass
class RaykvMetadata:
    """One step's instructions for the worker side (vLLM's KVConnectorMetadata)."""

    link: EngineLink | None = None
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)


@dataclass
class WorkerReport:
    """One step's results from the worker side (vLLM's KVConnectorWorkerMetadata).

    ``commits``: blocks written into inbox slots this step, for the CacheWorker to commit (each
    rank's into its own inbox). ``unstored``: per request, the first block a store could not
    write (no free inbox slots: backpressure); the scheduler side offers it again.
    ``counters``: loads, load errors, bytes...; ``per_request``: the same per request id (they
    end up in the request's output; summed over ranks).
    """

    commits: list[InboxCommit] = field(default_factory=list)
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    per_request: dict[str, collections.Counter[str]] = field(default_factory=dict)
    unstored: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: Any) -> WorkerReport:
        """Both reports in one (vLLM folds the reports of all workers of a step)."""
        if not isinstance(other, WorkerReport):
            return self
        commits = self.commits + other.commits
        counters = self.counters + other.counters
        per_request = {k: collections.Counter(v) for k, v in self.per_request.items()}
        for req_id, counts in other.per_request.items():
            per_request.setdefault(req_id, collections.Counter()).update(counts)
        unstored = dict(self.unstored)
        for req_id, first in other.unstored.items():
            unstored[req_id] = min(first, unstored.get(req_id, first))
        return WorkerReport(commits, counters, per_request, unstored)

    def count(self, req_id: str, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name``, overall and for request ``req_id``."""
        self.counters[name] += amount
        self.per_request.setdefault(req_id, collections.Counter())[name] += amount

    def __bool__(self) -> bool:
        return bool(self.commits or self.counters or self.unstored)

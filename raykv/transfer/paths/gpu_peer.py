"""The ``gpu_peer`` pull path: same-node GPU to GPU, one device copy from the owner's GPU tier.

UCX moves device pages between two processes at a fraction of what the GPUs can do: a staging copy
and digests on the sender, a digest on the receiver, then the import copies the pages again
(:mod:`raykv.transfer.paths.direct`). On one node the receiver can instead map the owner's GPU tier and
copy the leased pages straight into its own newly allocated slots, the way the ``shm`` path reads
a peer's shared host tier:

- owner (:class:`GpuPeerExport`, one per page server): on the first ``gpu_peer`` pull it exports
  its CUDA virtual-memory pool (:class:`raykv.ipc.PoolExporter`: a Unix socket of mode 0600 in a
  private directory, POSIX fds of the pool's chunks handed only to processes of the same user).
  Per pull it leases the blocks, answers with the leading run of them that is on its GPU tier
  (their slots; the other keys are left out of the header, so the client reports them missing),
  waits for the client's ``done`` and acknowledges it before the lease ends.
- client (:func:`pull_gpu_peer_into`): maps the owner's pool once per owner, with access for its
  own top tier's device (NVLink or PCIe peer access; the driver refuses otherwise), then imports
  with :func:`raykv.core.export_import.import_written`: room is made and slots allocated, the pages
  are copied device to device by the tier's copy engine (one DMA copy per consecutive run), the
  copy is waited for, ``done``/``ack`` confirms that the lease lasted, and only then are the
  blocks inserted. Nothing is imported on any failure.

No checksums: no byte leaves GPU memory or crosses a network, and the pages are read in place
under the owner's lease (a checksum guards transit, not memory; the token guards who may ask).
The path needs both processes on one node (equal node ids), a VMM pool on the owner, a GPU top
tier on the client, and ``TransferConfig.use_gpu_peer`` on both sides; otherwise
:func:`pull_gpu_peer_into` raises TransferError with reason "unavailable" and
:func:`raykv.transfer.planner.pull_pages` goes on to the host paths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import raykv.transfer.net.wire as wire
from raykv.core.errors import CudaError, TransferError, TransferFailure
from raykv.core.events import BlockStored, BlockTierChanged, CacheEvent
from raykv.core.export_import import import_written
from raykv.core.manager import CacheManager
from raykv.core.radix import Block
from raykv.core.records import BlockRecords
from raykv.core.tiers import shm_directory
from raykv.core.tiers.host import SHM_DIR, SHM_PREFIX
from raykv.core.types import DEFAULT_PRIORITY, BlockKey, PageId, Priority, TierKind, check_priority
from raykv.transfer.net.config import Peer, pull_request
from raykv.transfer.net.connection import ClientConn
from raykv.transfer.pages.landing import LeaseCheck, run_checked
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.gpu_land import PATH, ask_gpu_pool
from raykv.transfer.paths.gpu_read import LOCAL_PATH, copy_from, pull_local
from raykv.transfer.paths.importer import PullOutcome, importable_prefix, merge_outcomes
from raykv.transfer.paths.pull_client import PullClient
from raykv.transfer.paths.serving import PullRequest, ServerConn

if TYPE_CHECKING:
    from raykv.ipc import PoolExporter

log = logging.getLogger(__name__)


# ---- owner ------------------------------------------------------------------------------------
class GpuPeerExport:
    """The owner side: whether the path is on offer, the pool export, and serving one pull."""

    def __init__(self, manager: CacheManager, enabled: bool) -> None:
        self.manager = manager
        pool: Any = manager.top_pool
        arena = getattr(pool, "arena", None)
        self.available = bool(
            enabled and pool.kind is TierKind.GPU and arena is not None and arena.exportable
        )
        self._exporter: PoolExporter | None = None
        self._uuid = ""
        self._lock = threading.Lock()
        self.directory: GpuDirectory | None = None

    def exporter(self) -> PoolExporter:
        """The pool's exporter, started on first use (the pool is ``shared`` from then on)."""
        with self._lock:
            if self._exporter is None:
                from raykv.core.tiers.cuda_util import device_uuid
                from raykv.ipc import PoolExporter

                pool: Any = self.manager.top_pool
                self._exporter = PoolExporter(pool)
                self._uuid = device_uuid(pool.device.index)
                log.info("gpu_peer: exporting the GPU tier of %s at %s", pool.device, self._exporter.path)
                if shm_directory.supported():
                    self.directory = GpuDirectory.acquire(self.manager)
            return self._exporter

    async def serve(self, conn: ServerConn, pull: PullRequest) -> None:
        """Answer one ``gpu_peer`` pull (the server holds and ends its lease)."""
        rid, lease = pull.request_id, pull.lease
        if not self.available or conn.node != conn.site.node_id:
            raise TransferError(
                "the gpu_peer path needs a GPU tier and a peer on this node",
                reason=TransferFailure.UNAVAILABLE,
            )
        run = []
        for block in lease.blocks:
            if block.level != 0:
                break
            run.append(block)
        loop = asyncio.get_running_loop()
        exporter = self._exporter
        if exporter is None:
            exporter = await loop.run_in_executor(None, self.exporter)
        pool: Any = self.manager.top_pool
        slots = [b.slot for b in run]
        if len(pool.events) and pool.events.pending(slots):  # a copy into or out of them is in flight
            await loop.run_in_executor(None, pool.events.wait_host, slots)
        directory = self.directory
        if directory is not None:
            directory.sweep()  # bind what has landed since, so the next pulls need no request
        info = {
            "t": "gpu_pool",
            "id": rid,
            "path": exporter.path,
            "uuid": self._uuid,
            "slots": pool.num_slots,
            "dir": directory.path if directory is not None else None,
            "dir_slots": directory.num_slots if directory is not None else 0,
        }
        await conn.send(info)
        await conn.send_header(pull, PATH, slots, blocks=run)
        await conn.after_header()
        await conn.await_done(rid, None)
        await conn.send({"t": "ack", "id": rid})

    def close(self) -> None:
        """Stop exporting (peers keep the mappings they have; their one-sided reads stop
        finding anything). Idempotent."""
        with self._lock:
            if self.directory is not None:
                self.directory.release()
                self.directory = None
            if self._exporter is not None:
                self._exporter.close()
                self._exporter = None


class GpuDirectory:
    """The slot directory of an exported GPU tier (:mod:`raykv.core.tiers.shm_directory`), kept by
    the owner: a committed block on the tier is bound once its bytes are in place (its commit's
    event or its copy completed; until then it waits in a deferred list that every later event
    and every served request sweep), and unbound by the tier when its slot is released. One per
    tier, shared by every page server exporting it (a second directory would miss unbinds)."""

    @classmethod
    def acquire(cls, manager: CacheManager) -> GpuDirectory:
        """The tier's directory, created on first use; :meth:`release` once per acquire."""
        with manager.locked():
            pool: Any = manager.top_pool
            have = _DIRECTORIES.get(pool)
            if have is None:
                have = _DIRECTORIES[pool] = cls(manager)
            have.refs += 1
            return have

    def release(self) -> None:
        """Drop one reference; the last one removes the directory (readers then find nothing)."""
        with self.manager.locked():
            self.refs -= 1
            if self.refs == 0:
                _DIRECTORIES.pop(self.pool, None)
                self.close()

    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager
        pool: Any = manager.top_pool
        self.pool = pool
        directory = _fresh_directory(pool.num_slots, pool.page_bytes)
        self.path, self.num_slots = directory.path, pool.num_slots
        self._directory = directory
        self._deferred: dict[int, bytes] = {}  # slot -> key, bytes maybe still arriving
        self.refs = 0
        with manager.locked():
            pool.slot_directory = directory
            for block in list(manager.tree.blocks.values()):
                self._bind(block)
            manager.events.listeners.append(self._on_event)

    def _on_event(self, event: CacheEvent) -> None:  # the emitting thread, under the manager lock
        if isinstance(event, (BlockStored, BlockTierChanged)):
            block = self.manager.tree.get(event.key)
            if block is not None:
                self._bind(block)
        if self._deferred:
            self._sweep_locked()

    def _bind(self, block: Block) -> None:
        page = block.page
        if page.level != 0 or page.slot >= self.num_slots:
            return
        events = self.pool.events
        if len(events) and events.pending([page.slot]):
            self._deferred[int(page.slot)] = block.key
            return
        self._directory.bind_block(block)

    def sweep(self) -> None:
        """Bind the deferred blocks whose bytes have landed."""
        if self._deferred:
            with self.manager.locked():
                self._sweep_locked()

    def _sweep_locked(self) -> None:
        deferred, self._deferred = self._deferred, {}
        tree = self.manager.tree
        for slot, key in deferred.items():
            block = tree.get(BlockKey(key))
            if block is not None and block.page.level == 0 and block.page.slot == slot:
                self._bind(block)  # defers again if still pending

    def close(self) -> None:
        with self.manager.locked():
            if self._on_event in self.manager.events.listeners:
                self.manager.events.listeners.remove(self._on_event)
            self.pool.slot_directory = None
            self._directory.close()


_DIRECTORIES: weakref.WeakKeyDictionary[Any, GpuDirectory] = weakref.WeakKeyDictionary()
"""Each GPU tier's directory while one is acquired (see :meth:`GpuDirectory.acquire`)."""


def _fresh_directory(num_slots: int, page_bytes: int) -> shm_directory.ShmDirectory:
    base = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
    name = f"{SHM_PREFIX}gpu-{os.getpid()}-{secrets.token_hex(6)}"
    return shm_directory.ShmDirectory(os.path.join(base, name), num_slots, page_bytes)


# ---- client -----------------------------------------------------------------------------------
def usable(client: PullClient, conn: ClientConn, manager: CacheManager) -> bool:
    """Whether a pull over ``conn`` into ``manager`` can take the gpu_peer path."""
    return bool(
        client.config.use_gpu_peer
        and conn.gpu
        and conn.node == client.node_id
        and manager.top_pool.kind is TierKind.GPU
        and conn.peer not in client.gpu_pools.refused
    )


async def pull_gpu_peer_into(
    client: PullClient,
    peer: Peer,
    manager: CacheManager,
    keys: Sequence[bytes],
    timeout_s: float | None = None,
    priority: int = DEFAULT_PRIORITY,
) -> PullOutcome:
    """Pull ``keys`` from ``peer`` over ``gpu_peer`` and import them into ``manager`` (on the
    runtime loop). Keys the peer lacks or holds on another tier than its GPU tier (and every key
    after the first such one) come back in ``missing``/``dropped``; nothing else is left out.

    Raises ValueError for malformed or duplicate keys; TransferError with reason "unavailable"
    when the path cannot be used (see the module docstring; nothing was asked of the peer), any
    other TransferError for a failed pull (nothing imported; the caller recomputes or falls
    back); OutOfPagesError when this manager cannot make room (nothing imported).
    """
    checked, endpoint = pull_request(peer, keys)
    prio = check_priority(priority)
    start = time.perf_counter()
    if not checked:
        return PullOutcome((), (), (), (), PATH, 0, 0.0)
    local = await pull_local(client, endpoint, checked, manager, prio, start)
    if local is not None and not local[1]:
        return local[0]
    rest = checked if local is None else local[1]
    outcome = await client.guard(endpoint, timeout_s, _pull_all(client, endpoint, rest, manager, prio))
    if local is not None:
        outcome = merge_outcomes([local[0], outcome], f"{LOCAL_PATH}+{PATH}")
    return dataclasses.replace(outcome, seconds=time.perf_counter() - start)


async def _pull_all(
    client: PullClient, peer: tuple[str, int], keys: list[BlockKey], manager: CacheManager, priority: Priority
) -> PullOutcome:
    conn = await client.checkout(peer)
    if not usable(client, conn, manager):
        client.checkin(peer, conn)
        raise TransferError(
            "the gpu_peer path is not available to this peer", reason=TransferFailure.UNAVAILABLE
        )
    outcomes: list[PullOutcome] = []
    try:
        per_batch = max(1, min(conn.max_keys, conn.max_payload // max(1, conn.page_bytes)))
        for first in range(0, len(keys), per_batch):
            outcomes.append(
                await _pull_batch(client, conn, keys[first : first + per_batch], manager, priority)
            )
    except BaseException:
        conn.close()
        raise
    client.checkin(peer, conn)
    return merge_outcomes(outcomes, PATH)


async def _pull_batch(
    client: PullClient, conn: ClientConn, keys: list[BlockKey], manager: CacheManager, priority: Priority
) -> PullOutcome:
    info, header = await ask_gpu_pool(client, conn, keys)
    if header.page_bytes != manager.layout.page_bytes:
        raise TransferError(
            "import refused: page size differs from this manager's", reason=TransferFailure.REJECTED
        )
    pool: Any = manager.top_pool
    loop = asyncio.get_running_loop()
    source = client.gpu_pools.cached(info, pool.device.index)
    if source is None:  # first pull from this owner, or its pool grew: map it (blocking)
        try:
            source = await loop.run_in_executor(None, client.gpu_pools.get, info, pool.device.index)
        except (CudaError, TransferError) as exc:
            # e.g. no peer access between the two GPUs: never ask this peer again (the caller
            # falls back; closing the connection ends the owner's lease)
            client.gpu_pools.refused.add(conn.peer)
            log.warning("gpu_peer: cannot map the GPU tier of %s (%s); using other paths", conn.peer, exc)
            raise TransferError(
                f"cannot map the peer's GPU tier: {exc}", reason=TransferFailure.UNAVAILABLE
            ) from None
    slots = [int(s) for s in header.layout]
    if slots and max(slots) >= source.num_slots:
        raise wire.protocol_error("the peer named a slot outside its GPU tier")
    records = BlockRecords(header.keys, header.parents, header.roots, header.tokens)
    n = importable_prefix(manager, records)
    check = LeaseCheck(loop, lambda: conn.finish(header.request_id), client.config.timeout_s)

    def write(dst: list[PageId], new: list[int]) -> None:
        copy_from(source, [slots[i] for i in new], pool, dst)

    result = await run_checked(
        lambda confirm: import_written(manager, records.head(n), write, priority, confirm), check
    )
    if not check.done:  # nothing new to import: the lease still ends with done/ack
        await conn.finish(header.request_id)
    have = set(header.keys)
    client.count(PATH, conn.peer, len(result.imported), len(result.imported) * header.page_bytes)
    return PullOutcome(
        imported=result.imported,
        already_present=result.already_present,
        missing=tuple(k for k in keys if k not in have),
        dropped=tuple(BlockKey(k) for k in header.keys[n:]),
        path=PATH,
        nbytes=len(result.imported) * header.page_bytes,
        seconds=0.0,
        refused=result.refused,
    )


class GpuPeerPath(TransferPath):
    """The ``gpu_peer`` path (see the module docstring): served by ``export`` (the owner's
    :class:`GpuPeerExport`; None on a client, which only pulls)."""

    name: ClassVar[str] = PATH

    def __init__(self, export: GpuPeerExport | None = None) -> None:
        self.export = export

    async def serve(self, conn: ServerConn, pull: PullRequest) -> None:
        """:meth:`GpuPeerExport.serve` (TransferError "unavailable" without an export)."""
        if self.export is None:
            raise TransferError("this server exports no GPU tier", reason=TransferFailure.UNAVAILABLE)
        await self.export.serve(conn, pull)

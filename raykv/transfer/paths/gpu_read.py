"""The ``gpu_read`` path: a one-sided import from a same-node owner's GPU tier, no request at all.

After a first ``gpu_peer`` pull from an owner (:mod:`raykv.transfer.paths.gpu_peer`), the client has the
owner's GPU tier mapped and its slot directory (:class:`raykv.transfer.paths.gpu_peer.GpuDirectory`)
mapped read-only. When the directory lists every key, the pages are copied device to device
straight into newly allocated slots of this manager's GPU tier, in overlapping chunks
(:func:`chunk_starts`), and each chunk's slots are re-checked after its copy
(:func:`raykv.transfer.paths.shm_read.unchanged`): a chunk whose page changed meanwhile, and every
later one, is not imported and is asked of the owner instead (:class:`GpuReadPath`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import raykv.transfer.paths.shm_read as shm_read
from raykv.core.errors import TransferError, TransferFailure
from raykv.core.manager import CacheManager
from raykv.core.pipelined_import import import_pipelined
from raykv.core.records import BlockRecords
from raykv.core.tiers import shm_directory
from raykv.core.types import DEFAULT_PRIORITY, BlockKey, PageId, Priority, TierKind, check_priority
from raykv.transfer.net.config import Peer, pull_request
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.importer import PullOutcome, importable_prefix
from raykv.transfer.paths.pull_client import PullClient

if TYPE_CHECKING:
    from raykv.ipc import AttachedPool

LOCAL_PATH = "gpu_read"
PIPELINE_SHARES = (8, 8, 8, 7, 1)
"""Chunk sizes of a pipelined import. The copies of every chunk that fits in free slots start
before validation, in one batch (:func:`raykv.core.pipelined_import.import_pipelined`), so the GPU
copies back to back while the chunks are staged and inserted; the small last one (8 of 256) keeps
the insert that nothing overlaps short. On 2x H200, 256 x 2 MiB, medians of 60 pulls in one run:
(8, 8, 8, 7, 1) 1.70 ms, (8, 8, 8, 5, 2, 1) 1.73 ms, (8, 8, 6, 4, 3, 2, 1) 1.67 ms: within the
noise, so the fewer chunks stay."""
PIPELINE_MIN_CHUNK = 8


async def pull_local(
    client: PullClient,
    peer: tuple[str, int],
    keys: list[BlockKey],
    manager: CacheManager,
    priority: Priority,
    start: float,
) -> tuple[PullOutcome, list[BlockKey]] | None:
    """Import ``keys`` straight from a same-node owner's mapped GPU tier when its slot directory
    lists every one (after a first ``gpu_peer`` request to it): the outcome and the keys still to
    ask the owner for (see :func:`_land_local`); None when it cannot (nothing imported then: the
    caller asks the owner for every key)."""
    plan = _local_plan(client, peer, keys, manager)
    if plan is None:
        return None
    loop = asyncio.get_running_loop()
    landed = await loop.run_in_executor(None, _land_local, manager, keys, *plan, priority, start)
    if landed is not None:
        client.count(LOCAL_PATH, peer, len(landed[0].imported), landed[0].nbytes)
    return landed


def pull_gpu_local(
    client: PullClient,
    peer: Peer,
    manager: CacheManager,
    keys: Sequence[bytes],
    priority: int = DEFAULT_PRIORITY,
) -> tuple[PullOutcome, list[BlockKey]] | None:
    """The one-sided ``gpu_read`` import in the calling thread (no event loop, no request): the
    outcome and the keys the owner must still serve (a chunk changed while it was copied; the
    earlier chunks are imported), or None, with nothing imported, when the path cannot serve the
    keys (not connected yet, a key not in the owner's directory, the first chunk changed). The
    caller then takes the next step of its plan (:func:`raykv.transfer.planner.pull_pages`) for
    the keys left. ValueError for malformed or duplicate keys; import errors raise as for
    :func:`raykv.transfer.paths.gpu_peer.pull_gpu_peer_into`."""
    checked, endpoint = pull_request(peer, keys)
    prio = check_priority(priority)
    start = time.perf_counter()
    plan = _local_plan(client, endpoint, checked, manager) if checked else None
    if plan is None:
        return None
    landed = _land_local(manager, checked, *plan, prio, start)
    if landed is not None:
        client.count(LOCAL_PATH, endpoint, len(landed[0].imported), landed[0].nbytes)
    return landed


def _local_plan(
    client: PullClient, peer: tuple[str, int], keys: list[BlockKey], manager: CacheManager
) -> tuple[shm_directory.Located, shm_read.DirectoryLookup, AttachedPool] | None:
    """Where the owner's directory has every key, with the mapped pool to copy from; None when
    the one-sided path cannot be used for these keys."""
    info = client.gpu_pools.known.get(peer)
    pool: Any = manager.top_pool
    if (
        info is None
        or info.directory is None
        or pool.kind is not TierKind.GPU
        or not (client.config.use_gpu_peer and client.config.use_shm_read)
    ):
        return None
    source = client.gpu_pools.cached(info, pool.device.index)
    reader = client.gpu_pools.reader(info, manager.layout.page_bytes)
    if source is None or reader is None:
        return None
    located = shm_read.locate(reader, keys)
    if located is None or max(located.slots) >= source.num_slots:
        return None
    return located, reader, source


def _land_local(
    manager: CacheManager,
    keys: list[BlockKey],
    located: shm_directory.Located,
    reader: shm_read.DirectoryLookup,
    source: AttachedPool,
    priority: Priority,
    start: float,
) -> tuple[PullOutcome, list[BlockKey]] | None:
    """Copy and import the located pages in overlapping chunks (:func:`chunk_starts`); the
    outcome (``seconds`` since ``start``) and the keys left for the owner to serve (a chunk's
    slot changed while it was copied: that chunk and the later ones were not imported). None
    when nothing was imported because the first chunk changed."""
    records = BlockRecords(keys, located.parents, located.roots, located.tokens)  # parents: keys' bytes
    n = importable_prefix(manager, records)
    pool: Any = manager.top_pool

    def write(batches: list[tuple[list[PageId], list[int]]]) -> list[Any]:
        return start_copies(source, [(pick_slots(located.slots, new), dst) for dst, new in batches], pool)

    def confirm(event: Any, first: int, end: int) -> None:
        if event is not None:
            event.synchronize()
            pool.events.completed(event)
        if not shm_read.unchanged(reader, located.part(first, end), keys[first:end]):
            raise TransferError(
                "a page changed while it was copied; not imported", reason=TransferFailure.STALE
            )

    done = import_pipelined(manager, records.head(n), chunk_starts(n), write, confirm, priority)
    if done.stopped is not None and not (
        isinstance(done.stopped, TransferError) and done.stopped.reason is TransferFailure.STALE
    ):
        raise done.stopped
    if done.settled == 0 and done.stopped is not None:
        return None
    outcome = PullOutcome(
        imported=done.result.imported,
        already_present=done.result.already_present,
        missing=(),
        dropped=tuple(keys[n:]) if done.stopped is None else (),
        path=LOCAL_PATH,
        nbytes=len(done.result.imported) * manager.layout.page_bytes,
        seconds=time.perf_counter() - start,
        refused=done.result.refused,
    )
    return outcome, keys[done.settled :] if done.stopped is not None else []


def pick_slots(slots: list[int], new: list[int]) -> list[int]:
    """``[slots[i] for i in new]`` for ascending distinct ``new``: one slice when it is a run."""
    if new and new[-1] - new[0] == len(new) - 1:
        return slots[new[0] : new[-1] + 1]
    return [slots[i] for i in new]


def chunk_starts(count: int) -> list[int]:
    """Where the chunks of a pipelined local import of ``count`` blocks start: sized by
    :data:`PIPELINE_SHARES` (inserting a chunk overlaps copying the next; the last one's insert,
    which nothing overlaps, should be short), none under :data:`PIPELINE_MIN_CHUNK` blocks (the
    last one takes what is left); one chunk under 4 times that (each chunk costs a copy launch
    and an event wait, more than a short copy it could hide)."""
    total = sum(PIPELINE_SHARES)
    starts, at = [0], 0
    if count < 4 * PIPELINE_MIN_CHUNK:
        return starts
    for share in PIPELINE_SHARES[:-1]:
        at += max(PIPELINE_MIN_CHUNK, count * share // total)
        if at > count - PIPELINE_MIN_CHUNK:
            break
        starts.append(at)
    return starts


def start_copies(source: AttachedPool, batches: list[tuple[list[int], list[PageId]]], pool: Any) -> list[Any]:
    """Start copying, for each ``(src, dst)`` batch, pages ``src`` of a mapped peer pool onto
    pages ``dst`` of ``pool`` (a GpuPool), queued in order on the pool's copy stream after one
    wait (:meth:`raykv.core.tiers.cuda_copy.CudaCopier.copy_many`): one event per batch (None for an
    empty one), which becomes the pending event of that batch's ``dst``, so those slots are not
    reused or read before their copy ends.

    Each ``dst`` must come from ``pool.allocate`` (directly or through the manager), which ordered
    the current stream after the slots' earlier copies; the copies wait for the current stream, so
    they need no wait of their own for them."""
    events = pool.copier.copy_many("d2d", source.base_address, pool.base_address, pool.page_bytes, batches)
    for (_, dst), event in zip(batches, events):
        if event is not None:
            pool.events.set(dst, event)
    return events


def copy_from(source: AttachedPool, src: list[int], pool: Any, dst: list[PageId]) -> None:
    """:func:`start_copies` of one batch that returns once the copy completed (the caller's lease
    may end then)."""
    (event,) = start_copies(source, [(src, dst)], pool)
    if event is not None:
        event.synchronize()


class GpuReadPath(TransferPath):
    """The ``gpu_read`` path (see the module docstring): one-sided, never asked of a server."""

    name: ClassVar[str] = LOCAL_PATH
    one_sided: ClassVar[bool] = True

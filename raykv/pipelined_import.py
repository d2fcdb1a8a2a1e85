"""Pipelined imports: the pages of a batch copied in chunks whose copies overlap the inserts.

:func:`import_pipelined` is :func:`raykv.transfer_blocks.import_written` in chunks, for writers that
copy asynchronously (the GPU ``gpu_read`` path, :mod:`raykv.transfer.gpu_peer`): the first chunk's
copy starts before the records are validated, each later chunk is staged while earlier ones copy,
and each chunk is confirmed and inserted (as one chain when it is one) while later ones still copy.
The validation, staging and insert rules are :mod:`raykv.transfer_blocks`'s.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from raykv.page import Page
from raykv.records import BlockRecords, ImportResult
from raykv.transfer_blocks import _abort, _commit, _extend_hold, _hold, _release_hold, _Staged, validate
from raykv.types import BlockKey, PageId, Priority, TierLevel

if TYPE_CHECKING:
    from raykv.manager import CacheManager


ChunkWriter = Callable[[list[PageId], list[int]], object]
"""``write(slots, new)``: start copying the pages of records ``new`` into top-tier ``slots`` (same
order); returns a handle, which the chunk's ``confirm`` waits on (the copy may still be running).
Slots of chunks that are not inserted are given back without waiting: the writer must make their
next user wait for its copy (a GPU tier's slot events do; a synchronous copy needs nothing)."""


@dataclass(frozen=True)
class Pipelined:
    """What :func:`import_pipelined` did: ``result`` for the records it settled (the first
    ``settled``; the rest were not imported because ``stopped`` was raised by a confirm)."""

    result: ImportResult
    settled: int
    stopped: BaseException | None


def import_pipelined(
    mgr: CacheManager,
    records: BlockRecords,
    starts: Sequence[int],
    write: ChunkWriter,
    confirm: Callable[[object, int, int], object],
    priority: Priority,
) -> Pipelined:
    """:func:`import_written` in chunks (records ``starts[k]`` up to ``starts[k + 1]``; ``starts``
    ascending from 0, the last chunk ending with the records) whose copies overlap the
    inserts: under the lock, the first chunk's copy is started into free slots (when enough are
    free), all records are validated meanwhile (a problem raises and changes nothing: those
    slots are given back), each later chunk's pages are allocated and its ``write`` started in
    turn (while the earlier chunks copy); then each chunk in order is confirmed
    (``confirm(handle, first, end)`` without the lock: waits for its copy, raises if the source
    changed meanwhile) and inserted while later chunks still copy. The
    new pages and the cached parents stay leased until the last chunk settles, so no chunk loses
    its parent.

    A chunk whose confirm raises is not inserted, nor is any later one (their pages are given
    back); earlier chunks stay imported, each block complete and confirmed (a prefix of the
    records: parents always come first). The exception is returned in ``stopped``, not raised.
    """
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"chunk starts must ascend from 0, got {list(starts)}")
    if starts[-1] >= max(1, len(records)):
        raise ValueError(f"chunk start {starts[-1]} is past the {len(records)} records")
    with mgr.locked():
        mgr._check_open()
        head = _start_head(mgr, records, starts[1] if len(starts) > 1 else len(records), write)
        try:
            new = validate(mgr, records, None)
        except BaseException:
            _drop_head(mgr, head)
            raise
        if not new:
            _drop_head(mgr, head)
            present = tuple(BlockKey(k) for k in records.keys)
            return Pipelined(ImportResult((), present), len(records), None)
        cached = _cached_parents(mgr, records, new)
        outer = _hold(mgr, list(cached.values()))
        try:
            staged = _stage_chunks(mgr, records, new, starts, priority, write, outer, head)
        except BaseException:
            _release_hold(mgr, outer)
            raise
    try:
        return _settle(mgr, records, staged, confirm, outer)
    finally:
        with mgr.locked():
            _release_hold(mgr, outer)


def _cached_parents(mgr: CacheManager, records: BlockRecords, new: list[int]) -> dict[int, Page]:
    """The pages of the cached blocks that new records hang from (to hold while importing). In a
    chain only a new record whose predecessor is not new can have one (C-level check first)."""
    keys, parents, get = records.keys, records.parent_keys, mgr.tree.get
    if len(keys) > 1 and records.is_chain():
        if len(new) == len(keys):  # every record new: only the head hangs from a cached block
            new = [0]
        else:
            fresh = set(new)
            new = [i for i in new if i == 0 or i - 1 not in fresh]
    return {id(b.page): b.page for i in new if (b := get(cast(BlockKey, parents[i]))) is not None}


def _stage_chunks(
    mgr: CacheManager,
    records: BlockRecords,
    new: list[int],
    firsts: Sequence[int],
    priority: Priority,
    write: ChunkWriter,
    outer: int,
    head: _Head | None,
) -> list[_Chunk]:
    """Chunk by chunk: allocate the new blocks' pages (held by lease ``outer``) and start their
    copy, so the first chunk copies while the later ones are being allocated (the first chunk
    takes ``head``'s pages when its records are all new; else they are given back). On an error
    every chunk staged so far is given back (copies still running are the writer's to fence)."""
    held = {p.uid for p in mgr._leases[outer]}
    ends = [*firsts[1:], len(records)]
    staged: list[_Chunk] = []
    try:
        for first, end in zip(firsts, ends):
            mine = new[bisect.bisect_left(new, first) : bisect.bisect_left(new, end)]
            if head is not None:
                adopted, head = _adopt_head(mgr, head, mine, priority), None
                if adopted is not None:
                    _extend_hold(mgr, outer, adopted[0])
                    staged.append((_Staged(mine, adopted[0], None), adopted[1], first, end))
                    continue
            pages = mgr.allocate_pages(len(mine), priority, held)
            _extend_hold(mgr, outer, pages)
            part = _Staged(mine, pages, None)
            staged.append((part, None, first, end))
            staged[-1] = (part, write([p.slot for p in pages], mine), first, end)
    except BaseException:
        _drop_head(mgr, head)
        _abort_from(mgr, staged, 0, outer)
        raise
    return staged


@dataclass
class _Head:
    """Free top-tier slots taken before validation, the first chunk's copy already started."""

    slots: list[PageId]
    handle: object


def _start_head(mgr: CacheManager, records: BlockRecords, count: int, write: ChunkWriter) -> _Head | None:
    """Start copying records ``0 .. count - 1`` (the first chunk) into ``count`` free top-tier
    slots before the records are validated, so the copy runs meanwhile; None when fewer slots are
    free (no eviction before validation: then the chunk is staged as the others are) or one of
    those blocks is cached already. Nothing else changes: the slots are given back if the chunk
    is not imported after all."""
    pool = mgr.pools[0]
    if count <= 0 or pool.num_free < count:
        return None
    try:
        if not mgr.tree.blocks.keys().isdisjoint(records.keys[:count]):
            return None
    except TypeError:  # an unhashable key: validation rejects it
        return None
    slots = pool.allocate(count)
    try:
        handle = write(slots, list(range(count)))
    except BaseException:
        pool.release(slots)
        raise
    return _Head(slots, handle)


def _adopt_head(
    mgr: CacheManager, head: _Head, mine: list[int], priority: Priority
) -> tuple[list[Page], object] | None:
    """Pages on ``head``'s slots for the first chunk's new records ``mine`` and the copy's handle,
    when they are exactly the records it copied; else None, its slots given back."""
    if mine != list(range(len(head.slots))):
        _drop_head(mgr, head)
        return None
    return [Page(TierLevel(0), slot, priority) for slot in head.slots], head.handle


def _drop_head(mgr: CacheManager, head: _Head | None) -> None:
    """Give ``head``'s slots back (a copy still running is fenced by the slots' events)."""
    if head is not None:
        mgr.pools[0].release(head.slots)


_Chunk = tuple[_Staged, object, int, int]  # stage, copy handle, first record, end record


def _abort_from(mgr: CacheManager, staged: list[_Chunk], k: int, outer: int) -> None:
    """Give back the pages of chunks ``k..`` (under the lock)."""
    for part, *_ in staged[k:]:
        _release_hold(mgr, outer, part.pages)
        _abort(mgr, part)


def _settle(
    mgr: CacheManager,
    records: BlockRecords,
    staged: list[tuple[_Staged, object, int, int]],
    confirm: Callable[[object, int, int], object],
    outer: int,
) -> Pipelined:
    imported: list[BlockKey] = []
    present: list[BlockKey] = []
    settled, stopped = 0, None
    for k, (part, handle, first, end) in enumerate(staged):
        try:
            confirm(handle, first, end)
        except BaseException as exc:
            stopped = exc
            with mgr.locked():
                _abort_from(mgr, staged, k, outer)
            break
        with mgr.locked():
            done = _commit(mgr, records.slice(first, end), _shifted(part, first))
        imported += done.imported
        present += done.already_present
        settled = end
    return Pipelined(ImportResult(tuple(imported), tuple(present)), settled, stopped)


def _shifted(part: _Staged, first: int) -> _Staged:
    """``part`` with record indices relative to ``first`` (for a chunk's records slice)."""
    return _Staged([i - first for i in part.new], part.pages, part.lease_id)

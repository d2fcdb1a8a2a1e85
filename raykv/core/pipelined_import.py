"""Pipelined imports: the pages of a batch copied in chunks whose copies overlap the inserts.

:func:`import_pipelined` is :func:`raykv.core.export_import.import_written` in chunks, for writers that
copy asynchronously (the GPU ``gpu_read`` path, :mod:`raykv.transfer.paths.gpu_peer`): the copies of the
chunks that fit in free slots all start before the records are validated (the rest are staged
while earlier ones copy), and each chunk is confirmed and inserted (as one chain when it is one)
while later ones still copy.
The validation, staging and insert rules are :mod:`raykv.core.export_import`'s.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from raykv.core.export_import import Staged, abort, insert_staged, unhold, validate
from raykv.core.gc_pause import collect_if_due, paused
from raykv.core.page import Page, new_pages
from raykv.core.records import BlockRecords, ImportResult
from raykv.core.store import PageStore, StoreOwner
from raykv.core.types import BlockKey, PageId, Priority, TierLevel

ChunkWriter = Callable[[list[tuple[list[PageId], list[int]]]], list[object]]
"""``write(batches)``: for each ``(slots, new)`` in ``batches``, start copying the pages of records
``new`` into top-tier ``slots`` (same order); returns one handle per batch, which that chunk's
``confirm`` waits on (the copy may still be running). Several batches come in one call when their
copies can start together (one stream wait, one launch sequence). Slots of chunks that are not
inserted are given back without waiting: the writer must make their next user wait for its copy
(a GPU tier's slot events do; a synchronous copy needs nothing)."""


GC_HEADROOM = 400
"""Before confirming a chunk other than the last, a young collection runs when it would come due
within this many allocations (:func:`raykv.core.gc_pause.collect_if_due`): the last chunk, confirmed
right after its short copy, and the bookkeeping after it allocate fewer, so no pass falls there."""


@dataclass(frozen=True)
class Pipelined:
    """What :func:`import_pipelined` did: ``result`` for the records it settled (the first
    ``settled``; the rest were not imported because ``stopped`` was raised by a confirm)."""

    result: ImportResult
    settled: int
    stopped: BaseException | None


@paused()  # no collector passes between the copies (raykv.core.gc_pause)
def import_pipelined(
    owner: StoreOwner,
    records: BlockRecords,
    starts: Sequence[int],
    write: ChunkWriter,
    confirm: Callable[[object, int, int], object],
    priority: Priority,
) -> Pipelined:
    """:func:`import_written` in chunks (records ``starts[k]`` up to ``starts[k + 1]``; ``starts``
    ascending from 0, the last chunk ending with the records) whose copies overlap the
    inserts: under the lock, the copies of the leading chunks that fit in free top-tier slots
    (all of them, usually) start first, in one ``write``; all records are validated meanwhile (a
    problem raises and changes nothing: those slots are given back), then the pages of those
    chunks are adopted and each other chunk's pages are allocated (evicting as needed) and its
    ``write`` started in turn (while the earlier chunks copy); then each chunk in order is confirmed
    (``confirm(handle, first, end)`` without the lock: waits for its copy, raises if the source
    changed meanwhile) and inserted while later chunks still copy. The cached parents stay leased
    until the last chunk settles, and each chunk's pages until the next chunk is inserted, so no
    chunk loses its parent.

    A chunk whose confirm raises is not inserted, nor is any later one (their pages are given
    back); earlier chunks stay imported, each block complete and confirmed (a prefix of the
    records: parents always come first). The exception is returned in ``stopped``, not raised.
    The garbage collector is paused meanwhile (:func:`raykv.core.gc_pause.paused`).
    """
    mgr = owner.store
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"chunk starts must ascend from 0, got {list(starts)}")
    if starts[-1] >= max(1, len(records)):
        raise ValueError(f"chunk start {starts[-1]} is past the {len(records)} records")
    with mgr.locked():
        mgr.check_open()
        ahead = _start_ahead(mgr, records, starts, write)
        try:
            new = validate(mgr, records, None)
        except BaseException:
            _drop_ahead(mgr, ahead)
            raise
        if not new:
            _drop_ahead(mgr, ahead)
            present = tuple(BlockKey(k) for k in records.keys)
            return Pipelined(ImportResult((), present), len(records), None)
        cached = _cached_parents(mgr, records, new)
        outer = mgr.hold_pages(list(cached.values()))
        try:
            staged = _stage_chunks(mgr, records, new, starts, priority, write, outer, ahead)
        except BaseException:
            mgr.release_lease(outer)
            raise
    try:
        return _settle(mgr, records, staged, confirm)
    finally:
        mgr.release_lease(outer)


def _cached_parents(mgr: PageStore, records: BlockRecords, new: list[int]) -> dict[int, Page]:
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
    mgr: PageStore,
    records: BlockRecords,
    new: list[int],
    firsts: Sequence[int],
    priority: Priority,
    write: ChunkWriter,
    outer: int,
    ahead: list[_Ahead],
) -> list[_Chunk]:
    """Chunk by chunk: allocate the new blocks' pages (held by a lease of the chunk's own, in its
    stage's ``lease_id``) and start their copy, so the first chunk copies while the later ones are
    being allocated (none evicts what lease ``outer`` holds). A chunk started
    ``ahead`` takes those pages when its records are all new (else they are given back and it is
    staged like the others). On an error every chunk staged so far, and every chunk started ahead
    and not adopted, is given back (copies still running are the writer's to fence)."""
    held = {p.uid for p in mgr.leases[outer]}
    ends = [*firsts[1:], len(records)]
    staged: list[_Chunk] = []
    top = TierLevel(0)
    try:
        for k, (first, end) in enumerate(zip(firsts, ends)):
            mine = new[bisect.bisect_left(new, first) : bisect.bisect_left(new, end)]
            if k < len(ahead):
                early = ahead[k]
                ahead[k] = _Ahead([], None)  # adopted or given back: not the caller's to drop
                if mine == list(range(first, end)):
                    pages = new_pages(top, early.slots, priority)
                    staged.append((Staged(mine, pages, mgr.hold_pages(pages)), early.handle, first, end))
                    continue
                mgr.pools[0].release(early.slots)
            pages = mgr.allocate_pages(len(mine), priority, held)
            part = Staged(mine, pages, mgr.hold_pages(pages))
            staged.append((part, None, first, end))
            staged[-1] = (part, write([([p.slot for p in pages], mine)])[0], first, end)
    except BaseException:
        _drop_ahead(mgr, ahead)
        _abort_from(mgr, staged, 0)
        raise
    return staged


@dataclass
class _Ahead:
    """A chunk's free top-tier slots, taken before validation, its copy already started."""

    slots: list[PageId]
    handle: object


def _start_ahead(
    mgr: PageStore, records: BlockRecords, firsts: Sequence[int], write: ChunkWriter
) -> list[_Ahead]:
    """Start copying the leading chunks that fit in the free top-tier slots (records ``firsts[k]``
    up to the next start) before the records are validated, so the copies run meanwhile: one
    ``write`` for all of them. None are started (``[]``) when not even the first fits (no
    eviction before validation: then every chunk is staged after it) or one of their blocks is
    cached already. Nothing else changes: the slots are given back if a chunk is not imported
    after all."""
    pool = mgr.pools[0]
    ends = [*firsts[1:], len(records)]
    fit = bisect.bisect_right(ends, pool.num_free)
    if fit == 0 or len(records) == 0:
        return []
    try:
        if not mgr.tree.blocks.keys().isdisjoint(records.keys[: ends[fit - 1]]):
            return []
    except TypeError:  # an unhashable key: validation rejects it
        return []
    slots = pool.allocate(ends[fit - 1])
    batches = [(slots[a:b], list(range(a, b))) for a, b in zip(firsts[:fit], ends[:fit])]
    try:
        handles = write(batches)
    except BaseException:
        pool.release(slots)
        raise
    return [_Ahead(part, handle) for (part, _), handle in zip(batches, handles)]


def _drop_ahead(mgr: PageStore, ahead: list[_Ahead]) -> None:
    """Give back the slots of the chunks started ``ahead`` (a copy still running is fenced by the
    slots' events)."""
    slots = [slot for early in ahead for slot in early.slots]
    if slots:
        mgr.pools[0].release(slots)


_Chunk = tuple[Staged, object, int, int]  # stage, copy handle, first record, end record


def _abort_from(mgr: PageStore, staged: list[_Chunk], k: int) -> None:
    """Give back the pages of chunks ``k..`` and end their leases (under the lock)."""
    for part, *_ in staged[k:]:
        abort(mgr, part)


def _settle(
    mgr: PageStore,
    records: BlockRecords,
    staged: list[tuple[Staged, object, int, int]],
    confirm: Callable[[object, int, int], object],
) -> Pipelined:
    """Confirm and insert each chunk in order. A chunk's lease ends once the next chunk is
    inserted (its last block has a child then, so it is no leaf to drop) or, for the last one
    inserted, once the loop ends; a chunk that is not inserted is given back."""
    imported: list[BlockKey] = []
    present: list[BlockKey] = []
    refused: list[BlockKey] = []
    settled, stopped, previous = 0, None, None
    for k, (part, handle, first, end) in enumerate(staged):
        if k < len(staged) - 1:  # while the chunk's copy may still run, not amid the inserts, and
            collect_if_due(GC_HEADROOM)  # early enough that none comes due in the last one's
        try:
            confirm(handle, first, end)
        except BaseException as exc:
            stopped = exc
            with mgr.locked():
                _abort_from(mgr, staged, k)
                if previous is not None:
                    unhold(mgr, previous)
            break
        with mgr.locked():
            done = insert_staged(mgr, records.slice(first, end), _shifted(part, first))
            if previous is not None:
                unhold(mgr, previous)
            if k == len(staged) - 1:
                unhold(mgr, part)
        previous = part
        imported += done.imported
        present += done.already_present
        refused += done.refused
        settled = end
    return Pipelined(ImportResult(tuple(imported), tuple(present), tuple(refused)), settled, stopped)


def _shifted(part: Staged, first: int) -> Staged:
    """``part`` with record indices relative to ``first`` (for a chunk's records slice), without
    its lease (which :func:`_settle` ends itself)."""
    return Staged([i - first for i in part.new], part.pages, None)

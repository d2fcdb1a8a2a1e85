"""Export committed blocks (bytes + key + parent key + checksum) and import them from a peer.

Kept apart from the manager so the all-or-nothing import rules read in one place.

:func:`import_pages` is the import: the blocks' tree positions as columns
(:class:`~raykv.core.records.BlockRecords`) and their pages as the rows of one uint8 array, written into
the top tier with one batched copy. :func:`import_blocks` (one ``bytes`` object per record)
delegates to it. Every rule is checked in record order before anything changes, and the first bad
record decides the error: a malformed key, a duplicate key, a partial block or a page of the wrong
size (ImportRejectedError), a checksum mismatch when verifying (IntegrityError), a parent that is
neither a scope root, nor cached, nor earlier in the batch (ImportRejectedError). Then room is made
on the top tier (OutOfPagesError, nothing changed, when impossible), the rows are written, and the
new blocks are inserted, parents first. Blocks already cached are skipped (and not copied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from raykv.core.errors import ImportRejectedError, IntegrityError
from raykv.core.page import Page
from raykv.core.radix import Root
from raykv.core.records import BlockRecords, ExportedBlock, ImportResult, crc32, page_checksum
from raykv.core.store import PageStore, StoreOwner
from raykv.core.types import BlockKey, PageId, Priority, check_block_key


def export_blocks(mgr: PageStore, keys: list[BlockKey]) -> list[ExportedBlock]:
    """Read the pages of the committed blocks among ``keys`` (batched per tier). Under the lock.

    A page that fails its checksum (disk tier) is dropped with its descendants
    (``PageStore.drop_corrupt``), and neither it nor they are exported: they are missing keys now.
    """
    found = [b for b in (mgr.tree.get(k) for k in keys) if b is not None]
    data: dict[int, bytes] = {}
    dropped = False
    for level in sorted({b.page.level for b in found}):
        group = [b for b in found if b.page.level == level]
        rows, bad = mgr.copy.read_checked(level, [b.page.slot for b in group])
        if bad:
            mgr.drop_corrupt([group[i].page for i in bad], mgr.tier_kinds[level])
            dropped = True
        for block, row in zip(group, rows):
            data[id(block)] = row.tobytes()
    if dropped:
        found = [b for b in found if mgr.tree.get(b.key) is b]
    out = []
    for block in found:
        raw = data[id(block)]
        out.append(
            ExportedBlock(
                key=block.key,
                parent_key=block.parent_key,
                parent_is_root=isinstance(block.parent, Root),
                num_tokens=block.num_tokens,
                checksum=page_checksum(raw),
                data=raw,
            )
        )
    mgr.counters.exported_blocks += len(out)
    return out


# ---- validation ---------------------------------------------------------------------------------
def first_mismatch(data: npt.NDArray[np.uint8], checksums: Sequence[int]) -> int | None:
    """Index of the first row of ``data`` whose CRC-32 differs from ``checksums`` (None: all match).

    Reads only ``data`` (no manager state): callers run it before taking the manager's lock.
    """
    for i in range(len(data)):
        row = data[i]
        if crc32(row if row.flags.c_contiguous else row.copy()) & 0xFFFFFFFF != checksums[i]:
            return i
    return None


def check_arrays(
    mgr: PageStore,
    records: BlockRecords,
    data: npt.NDArray[np.uint8],
    checksums: Sequence[int] | None,
    verify: bool,
) -> None:
    """ImportRejectedError (``index`` None) unless ``data`` holds one page per record and, when
    ``verify``, ``checksums`` one CRC-32 per record."""
    n = len(records.keys)
    columns = (records.parent_keys, records.parent_is_root, records.num_tokens)
    if any(len(c) != n for c in columns):
        raise ImportRejectedError("the record columns differ in length", index=None)
    page = mgr.layout.page_bytes
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (n, page):
        shape = getattr(data, "shape", type(data).__name__)
        raise ImportRejectedError(
            f"data must be a uint8 array of shape ({n}, {page}), got {shape}", index=None
        )
    if verify and (checksums is None or len(checksums) != n):
        raise ImportRejectedError("verifying needs one checksum per record", index=None)


@dataclass(frozen=True)
class Problem:
    """The first bad record: its index, the error, and whether its checksum is checked first."""

    index: int
    error: ImportRejectedError
    checksum_first: bool


def scan(mgr: PageStore, records: BlockRecords) -> tuple[list[int], Problem | None]:
    """The indices of the blocks to add (not cached yet), and the first problem in record order
    (changes nothing; under the lock)."""
    quick = scan_chain(mgr, records)
    if quick is not None:
        return quick, None
    seen: set[bytes] = set()
    new: list[int] = []
    tree, tpb = mgr.tree, mgr.tokens_per_block
    well_formed = all(type(k) is bytes and len(k) == 32 for k in (*records.keys, *records.parent_keys))
    for i, (key, parent, root, tokens) in enumerate(
        zip(records.keys, records.parent_keys, records.parent_is_root, records.num_tokens)
    ):
        try:
            if not well_formed:
                check_block_key(key)
                check_block_key(parent, "parent_key")
        except ValueError as exc:
            return new, Problem(i, ImportRejectedError(f"record {i}: {exc}", index=i), False)
        if key in seen:
            return new, Problem(i, ImportRejectedError(f"record {i}: duplicate key in batch", index=i), False)
        if tokens != tpb:
            text = f"record {i}: {tokens} tokens; only full blocks of {tpb} are shared"
            return new, Problem(i, ImportRejectedError(text, index=i), False)
        if not (root or parent in tree or parent in seen):
            text = f"record {i}: parent block is neither cached nor earlier in the batch"
            return new, Problem(i, ImportRejectedError(text, index=i), True)
        seen.add(key)
        if key not in tree:
            new.append(i)
    return new, None


def scan_chain(mgr: PageStore, records: BlockRecords) -> list[int] | None:
    """:func:`scan` for the common batch, a problem-free chain (each block the parent of the next;
    C-level passes instead of a loop per record): the blocks to add, or None when the batch is not
    such a chain or has a problem (the full scan then finds and orders it)."""
    keys, parents = records.keys, records.parent_keys
    n = len(keys)
    if n == 0 or set(map(type, keys)) != {bytes} or set(map(len, keys)) != {32}:
        return None
    if not (type(parents[0]) is bytes and len(parents[0]) == 32):
        return None
    if not records.is_chain() or any(records.parent_is_root[1:]):
        return None
    if list(records.num_tokens).count(mgr.tokens_per_block) != n or len(set(keys)) != n:
        return None
    blocks = mgr.tree.blocks
    if not (records.parent_is_root[0] or parents[0] in blocks):
        return None
    if blocks.keys().isdisjoint(keys):
        return list(range(n))
    return [i for i, key in enumerate(keys) if key not in blocks]


def validate(mgr: PageStore, records: BlockRecords, bad_checksum: int | None) -> list[int]:
    """The indices of the blocks to add; raises the first problem in record order (a checksum
    mismatch at ``bad_checksum`` included) without changing anything. Under the manager's lock."""
    new, problem = scan(mgr, records)
    if bad_checksum is not None and (
        problem is None
        or bad_checksum < problem.index
        or (bad_checksum == problem.index and problem.checksum_first)
    ):
        raise IntegrityError(
            f"record {bad_checksum}: checksum mismatch; nothing imported", index=bad_checksum
        )
    if problem is not None:
        raise problem.error
    return new


# ---- import -------------------------------------------------------------------------------------
@dataclass
class Staged:
    """Pages allocated and written for the new blocks, not inserted yet (held by ``lease_id``)."""

    new: list[int]
    pages: list[Page]
    lease_id: int | None


def rows_of(data: npt.NDArray[np.uint8], new: list[int]) -> npt.NDArray[np.uint8]:
    """The rows ``new`` of ``data``: a view when they are one run (no copy), else a gather."""
    if len(new) == len(data):
        return data
    if new[-1] - new[0] + 1 == len(new):
        return data[new[0] : new[-1] + 1]
    return data[np.asarray(new, dtype=np.intp)]


PageWriter = Callable[[list[PageId], list[int]], None]
"""``write(slots, new)``: put the pages of records ``new`` into top-tier ``slots`` (same order)."""


def stage(
    mgr: PageStore,
    records: BlockRecords,
    new: list[int],
    priority: Priority,
    hold: bool,
    write: PageWriter,
) -> Staged:
    """Make room, allocate and ``write`` the new blocks' pages (one batched copy). With ``hold``
    the pages and the cached parents are leased until :func:`insert_staged` or :func:`abort`, so
    nothing moves or goes (and ``clear_reusable``/``shutdown`` refuse) while the manager is
    unlocked."""
    parents = [mgr.tree.get(BlockKey(records.parent_keys[i])) for i in new]
    held = [b.page for b in parents if b is not None]
    pages = mgr.allocate_pages(len(new), priority, {p.uid for p in held})
    try:
        write([p.slot for p in pages], new)
    except BaseException:
        mgr.pools[0].release([p.slot for p in pages])
        raise
    lease_id = mgr.hold_pages([*held, *pages]) if hold else None
    return Staged(new, pages, lease_id)


def unhold(mgr: PageStore, staged: Staged) -> None:
    """End the stage's lease, if it has one (idempotent)."""
    if staged.lease_id is not None:
        mgr.release_lease(staged.lease_id)


def abort(mgr: PageStore, staged: Staged) -> None:
    """Give the staged pages back; nothing was inserted. Under the lock."""
    unhold(mgr, staged)
    mgr.pools[0].release([p.slot for p in staged.pages])


def insert_staged(mgr: PageStore, records: BlockRecords, staged: Staged) -> ImportResult:
    """Cache the staged blocks, parents first (:meth:`PageStore.cache_blocks`; one chain when the
    stage is a chain of records all new and none in the tree yet, the usual stage). A block
    that another import added meanwhile (only possible while a held stage waited unlocked)
    keeps its page; the staged copy is released and the key reported ``already_present``; one
    a salt's quota refuses is released too and reported ``refused``. Under the lock."""
    unhold(mgr, staged)
    keys, n = records.keys, len(records.keys)
    keys_ = cast(Sequence[BlockKey], keys)
    parents = cast(Sequence[BlockKey], records.parent_keys)
    if len(staged.new) == n and n >= 2 and records.is_chain() and mgr.tree.blocks.keys().isdisjoint(keys):
        refused = mgr.cache_blocks(
            keys_,
            parents,
            records.parent_is_root,
            staged.pages,
            records.num_tokens,
            imported=True,
            chain=True,
        )  # a tail the salt's quota refused (only with ``max_blocks_per_salt``)
        if refused:
            mgr.pools[0].release([staged.pages[j].slot for j in refused])
        fit = len(keys_) - len(refused)
        return ImportResult(tuple(keys_[:fit]), (), tuple(keys_[fit:]))
    new = staged.new
    skipped = mgr.cache_blocks(
        [keys_[i] for i in new],
        [parents[i] for i in new],
        [bool(records.parent_is_root[i]) for i in new],
        staged.pages,
        [records.num_tokens[i] for i in new],
        imported=True,
    )
    if skipped:
        mgr.pools[0].release([staged.pages[j].slot for j in skipped])
    missed = {keys_[new[j]] for j in skipped}  # cached meanwhile, or refused by a salt's quota
    over_quota = {k for k in missed if mgr.tree.get(k) is None}
    done = [keys_[i] for i in new if keys_[i] not in missed]
    stored = set(done) | over_quota
    present = tuple(k for k in keys_ if k not in stored)
    return ImportResult(tuple(done), present, tuple(k for k in keys_ if k in over_quota))


def import_pages(
    owner: StoreOwner,
    records: BlockRecords,
    data: npt.NDArray[np.uint8],
    checksums: Sequence[int] | None,
    verify: bool,
    priority: Priority,
    confirm: Callable[[], object] | None = None,
) -> ImportResult:
    """All-or-nothing import of pages given as rows; see :meth:`CacheManager.import_pages`.

    Takes the manager's lock itself: checksums are computed before it (they read only ``data``),
    and ``confirm`` runs without it, between writing the rows and inserting the blocks.
    """
    mgr = owner.store
    check_arrays(mgr, records, data, checksums, verify)
    bad = first_mismatch(data, checksums) if verify and checksums is not None else None

    def write(slots: list[PageId], new: list[int]) -> None:
        mgr.copy.write(0, slots, rows_of(data, new))

    return _import(mgr, records, bad, write, priority, confirm)


def import_written(
    owner: StoreOwner,
    records: BlockRecords,
    write: PageWriter,
    priority: Priority,
    confirm: Callable[[], object] | None = None,
) -> ImportResult:
    """:func:`import_pages` for pages that ``write(slots, new)`` copies into the newly allocated
    top-tier ``slots`` itself (e.g. device to device from a peer's mapped GPU pool); it must have
    completed the copy when it returns. Same rules: the records are validated first (nothing
    changes on a problem), ``write`` runs under the manager's lock, ``confirm`` after it without
    the lock; if either raises, the pages are given back and nothing is inserted."""
    return _import(owner.store, records, None, write, priority, confirm)


def _import(
    mgr: PageStore,
    records: BlockRecords,
    bad: int | None,
    write: PageWriter,
    priority: Priority,
    confirm: Callable[[], object] | None,
) -> ImportResult:
    with mgr.locked():
        mgr.check_open()
        new = validate(mgr, records, bad)
        if not new:
            return ImportResult((), tuple(BlockKey(k) for k in records.keys))
        staged = stage(mgr, records, new, priority, confirm is not None, write)
        if confirm is None:
            return insert_staged(mgr, records, staged)
    try:
        confirm()
    except BaseException:
        with mgr.locked():
            abort(mgr, staged)
        raise
    with mgr.locked():
        return insert_staged(mgr, records, staged)


def import_blocks(owner: StoreOwner, blocks: list[ExportedBlock], priority: Priority) -> ImportResult:
    """All-or-nothing import of ExportedBlock records; see :meth:`CacheManager.import_blocks`.

    Checks each record's type and page size, then hands the well-formed prefix to
    :func:`import_pages` (one array of rows). A malformed record is reported unless an earlier
    record has a problem of its own (record order decides, as everywhere).
    """
    mgr = owner.store
    page = mgr.layout.page_bytes
    bad = next(
        (
            i
            for i, rec in enumerate(blocks)
            if not isinstance(rec, ExportedBlock)
            or not isinstance(rec.data, (bytes, bytearray))
            or len(rec.data) != page
        ),
        None,
    )
    good = blocks if bad is None else blocks[:bad]
    records = BlockRecords.of(good)
    data = np.frombuffer(b"".join(r.data for r in good), dtype=np.uint8).reshape(len(good), page)
    sums = [r.checksum for r in good]
    if bad is None:
        return import_pages(mgr, records, data, sums, True, priority)
    with mgr.locked():
        validate(mgr, records, first_mismatch(data, sums))  # an earlier record's problem wins
    rec = blocks[bad]
    if not isinstance(rec, ExportedBlock):
        raise ImportRejectedError(f"record {bad} is not an ExportedBlock", index=bad)
    size = len(rec.data) if hasattr(rec.data, "__len__") else "?"
    raise ImportRejectedError(f"record {bad}: page of {size} bytes, expected {page}", index=bad)

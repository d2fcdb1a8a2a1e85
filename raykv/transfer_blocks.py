"""Export committed blocks (bytes + key + parent key + checksum) and import them from a peer.

Kept apart from the manager so the all-or-nothing import rules read in one place. Both functions
run under the manager's lock (the manager calls them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from raykv.errors import ImportRejectedError, IntegrityError
from raykv.radix import Block, Root
from raykv.records import ExportedBlock, ImportResult, page_checksum
from raykv.types import BlockKey, Priority, check_block_key

if TYPE_CHECKING:
    from raykv.manager import CacheManager


def export_blocks(mgr: CacheManager, keys: list[BlockKey]) -> list[ExportedBlock]:
    """Read the pages of the committed blocks among ``keys`` (batched per tier)."""
    found = [b for b in (mgr.tree.get(k) for k in keys) if b is not None]
    data: dict[int, bytes] = {}
    for level in sorted({b.page.level for b in found}):
        group = [b for b in found if b.page.level == level]
        rows = mgr.copy.read(level, [b.page.slot for b in group])
        for block, row in zip(group, rows):
            data[id(block)] = row.tobytes()
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


def _validate(mgr: CacheManager, blocks: list[ExportedBlock]) -> list[ExportedBlock]:
    """Return the blocks to add (not yet present), or raise without changing anything."""
    seen: set[bytes] = set()
    new: list[ExportedBlock] = []
    for i, rec in enumerate(blocks):
        if not isinstance(rec, ExportedBlock):
            raise ImportRejectedError(f"record {i} is not an ExportedBlock", index=i)
        try:
            check_block_key(rec.key)
            check_block_key(rec.parent_key, "parent_key")
        except ValueError as exc:
            raise ImportRejectedError(f"record {i}: {exc}", index=i) from None
        if rec.key in seen:
            raise ImportRejectedError(f"record {i}: duplicate key in batch", index=i)
        if rec.num_tokens != mgr.tokens_per_block:
            raise ImportRejectedError(
                f"record {i}: {rec.num_tokens} tokens; only full blocks of {mgr.tokens_per_block} are shared",
                index=i,
            )
        if not isinstance(rec.data, (bytes, bytearray)) or len(rec.data) != mgr.layout.page_bytes:
            raise ImportRejectedError(
                f"record {i}: page of {len(rec.data)} bytes, expected {mgr.layout.page_bytes}", index=i
            )
        if page_checksum(rec.data) != rec.checksum:
            raise IntegrityError(f"record {i}: checksum mismatch; nothing imported", index=i)
        parent_ok = rec.parent_is_root or rec.parent_key in mgr.tree or rec.parent_key in seen
        if not parent_ok:
            raise ImportRejectedError(
                f"record {i}: parent block is neither cached nor earlier in the batch", index=i
            )
        seen.add(rec.key)
        if rec.key not in mgr.tree:
            new.append(rec)
    return new


def import_blocks(mgr: CacheManager, blocks: list[ExportedBlock], priority: Priority) -> ImportResult:
    """All-or-nothing import; see :meth:`CacheManager.import_blocks`."""
    new = _validate(mgr, blocks)
    present = tuple(BlockKey(r.key) for r in blocks if r.key in mgr.tree)
    if not new:
        return ImportResult((), present)
    parents = [mgr.tree.get(BlockKey(r.parent_key)) for r in new]
    exclude = {b.page.uid for b in parents if b is not None}
    pages = mgr.allocate_pages(len(new), priority, exclude)
    data = np.frombuffer(b"".join(r.data for r in new), dtype=np.uint8)
    data = data.reshape(len(new), mgr.layout.page_bytes)
    try:
        mgr.copy.write(0, [p.slot for p in pages], data)
    except BaseException:
        mgr.pools[0].release([p.slot for p in pages])
        raise
    for rec, page in zip(new, pages):
        parent: Root | Block | None = mgr.tree.parent_node(
            BlockKey(rec.parent_key), create_root=rec.parent_is_root
        )
        assert parent is not None
        mgr.tree.insert(parent, BlockKey(rec.key), page, rec.num_tokens)
        mgr.policy.add(page)
        mgr.events.stored(
            BlockKey(rec.key), BlockKey(rec.parent_key), mgr.tier_kinds[0], rec.num_tokens, None
        )
    mgr.counters.imported_blocks += len(new)
    return ImportResult(tuple(BlockKey(r.key) for r in new), present)

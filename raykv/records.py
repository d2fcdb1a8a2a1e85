"""Plain records that cross process boundaries: exported blocks, probe and import results."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from raykv.types import BlockKey, TierKind


def page_checksum(data: bytes | memoryview) -> int:
    """CRC-32 of a page's bytes (detects corruption in transit; the token guards authenticity)."""
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class ExportedBlock:
    """One committed block with its page bytes, ready to send to a peer.

    ``parent_is_root`` is True for block 0 of a scope (``parent_key`` is then the scope's root
    key). ``checksum`` is :func:`page_checksum` of ``data``.
    """

    key: BlockKey
    parent_key: BlockKey
    parent_is_root: bool
    num_tokens: int
    checksum: int
    data: bytes


@dataclass(frozen=True)
class LeasedBlock:
    """A committed block held in place for a sender: where its page is and how to re-key it."""

    key: BlockKey
    parent_key: BlockKey
    parent_is_root: bool
    num_tokens: int
    tier: TierKind
    level: int
    slot: int


@dataclass(frozen=True)
class BlockLease:
    """Blocks that stay exactly where they are (not moved, not dropped) until released."""

    lease_id: int
    blocks: tuple[LeasedBlock, ...]


@dataclass(frozen=True)
class ProbeResult:
    """How many leading blocks are cached, and the tier of each (side-effect free lookup)."""

    num_blocks: int
    num_tokens: int
    tiers: tuple[TierKind, ...]

    def blocks_on(self, kind: TierKind) -> int:
        return sum(1 for t in self.tiers if t is kind)


@dataclass(frozen=True)
class ImportResult:
    """Keys imported as new committed blocks, and keys that were already present (skipped)."""

    imported: tuple[BlockKey, ...]
    already_present: tuple[BlockKey, ...]


@dataclass(frozen=True)
class CommittedBlockInfo:
    """One entry of a manager snapshot (parents always listed before children)."""

    key: BlockKey
    parent_key: BlockKey
    tier: TierKind
    num_tokens: int

"""Plain records that cross process boundaries: exported blocks, probe and import results."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from raykv.core.types import BlockKey, TierKind


def _crc32_function() -> Callable[[Any], int]:
    """ISA-L's CRC-32 when the optional ``isal`` package is installed (the same values as zlib's,
    about ten times faster: it uses the CPU's carry-less multiply), else zlib's."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return zlib.crc32
    return crc32  # type: ignore[no-any-return]


crc32 = _crc32_function()
"""``crc32(buffer) -> int``: zlib-compatible CRC-32 of any contiguous buffer (releases the GIL)."""


def page_checksum(data: bytes | memoryview) -> int:
    """CRC-32 of a page's bytes (detects corruption in transit; the token guards authenticity)."""
    return crc32(data) & 0xFFFFFFFF


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


class _HasPosition(Protocol):
    @property
    def key(self) -> bytes: ...
    @property
    def parent_key(self) -> bytes: ...
    @property
    def parent_is_root(self) -> bool: ...
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class BlockRecords:
    """Where each block of a batch goes in the tree, as columns: entry ``i`` of every column
    describes block ``i`` (its key, its parent's key, whether that parent is a scope root, its
    token count). With one array of page bytes it is what ``CacheManager.import_pages`` imports;
    there are no per-block objects. Columns are checked on import, not here.
    """

    keys: Sequence[bytes]
    parent_keys: Sequence[bytes]
    parent_is_root: Sequence[bool]
    num_tokens: Sequence[int]

    def __len__(self) -> int:
        return len(self.keys)

    def head(self, count: int) -> BlockRecords:
        """The first ``count`` blocks (these records themselves when that is all of them)."""
        return self if count == len(self.keys) else self.slice(0, count)

    def is_chain(self) -> bool:
        """Whether each block's parent is the block before it (the usual batch: one request's
        prefix), so only the first block's parent can be outside the batch."""
        n = len(self.keys)
        return n > 0 and list(self.parent_keys[1:]) == list(self.keys[: n - 1])

    def slice(self, first: int, end: int) -> BlockRecords:
        """Blocks ``first`` up to (not including) ``end``."""
        return BlockRecords(
            self.keys[first:end],
            self.parent_keys[first:end],
            self.parent_is_root[first:end],
            self.num_tokens[first:end],
        )

    @classmethod
    def of(cls, blocks: Iterable[_HasPosition]) -> BlockRecords:
        """The columns of ``blocks`` (ExportedBlock or LeasedBlock records, or alike)."""
        items = list(blocks)
        return cls(
            tuple(b.key for b in items),
            tuple(b.parent_key for b in items),
            tuple(b.parent_is_root for b in items),
            tuple(b.num_tokens for b in items),
        )


class LeasedBlock(NamedTuple):
    """A committed block held in place for a sender: where its page is and how to re-key it, and
    its page's checksum when a sender computed it before (None: compute it; see
    ``CacheManager.remember_checksums``). A named tuple: a lease of 256 blocks makes 256 of them
    under the manager's lock (a frozen dataclass takes ~1 us each to build, this ~0.2 us)."""

    key: BlockKey
    parent_key: BlockKey
    parent_is_root: bool
    num_tokens: int
    tier: TierKind
    level: int
    slot: int
    checksum: int | None = None


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
    """What an import did with each key: ``imported`` as a new committed block,
    ``already_present`` (cached already, skipped), or ``refused`` (not cached: its salt is over
    ``max_blocks_per_salt`` with nothing of its own to drop; see :mod:`raykv.core.quota`)."""

    imported: tuple[BlockKey, ...]
    already_present: tuple[BlockKey, ...]
    refused: tuple[BlockKey, ...] = ()


@dataclass(frozen=True)
class CommittedBlockInfo:
    """One entry of a manager snapshot (parents always listed before children)."""

    key: BlockKey
    parent_key: BlockKey
    tier: TierKind
    num_tokens: int

"""Counters of one CacheManager, and deltas between two snapshots.

Per-tier tuples are indexed by tier level (0 = top). A snapshot is a frozen :class:`CacheStats`;
``later - earlier`` gives a :class:`StatsDelta` of the counters. Both compare by value and pickle.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, fields
from typing import Any

from raykv.core.types import TierKind


def _sub(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class StatsDelta:
    """Counter differences between two snapshots (same fields as CacheStats' counters).

    ``integrity_drops``: pages that failed their checksum when read back from the disk tier (each
    dropped, never served; see ``PageStore.drop_corrupt``). ``quota_evictions``: blocks a salt
    over ``max_blocks_per_salt`` dropped of its own to make room (each also counted in
    ``evictions`` on its tier); ``quota_refused``: blocks not cached because their salt was at the
    quota with none of its own blocks droppable (see :mod:`raykv.core.quota`).
    """

    hit_blocks: tuple[int, ...]
    hit_tokens: tuple[int, ...]
    miss_blocks: int
    miss_tokens: int
    evictions: tuple[int, ...]
    demotions: tuple[int, ...]
    promotions: tuple[int, ...]
    imported_blocks: int
    exported_blocks: int
    committed_blocks: int
    integrity_drops: int = 0
    quota_evictions: int = 0
    quota_refused: int = 0

    @property
    def hit_ratio(self) -> float:
        """Block hit ratio: hits / (hits + misses); 0.0 when nothing was looked up."""
        hits = sum(self.hit_blocks)
        total = hits + self.miss_blocks
        return hits / total if total else 0.0

    def __add__(self, other: StatsDelta) -> StatsDelta:
        out: dict[str, Any] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = tuple(x + y for x, y in zip(a, b, strict=True)) if isinstance(a, tuple) else a + b
        return StatsDelta(**out)

    @classmethod
    def zero(cls, num_tiers: int) -> StatsDelta:
        z = (0,) * num_tiers
        return cls(z, z, 0, 0, z, z, z, 0, 0, 0)


@dataclass(frozen=True)
class CacheStats(StatsDelta):
    """A snapshot: cumulative counters plus gauges (bytes in use per tier, pinned pages)."""

    tiers: tuple[TierKind, ...] = field(default=())
    bytes_in_use: tuple[int, ...] = field(default=())
    capacity_bytes: tuple[int, ...] = field(default=())
    pinned_pages: int = 0
    open_requests: int = 0

    def __sub__(self, other: CacheStats) -> StatsDelta:
        out: dict[str, Any] = {}
        for f in fields(StatsDelta):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = _sub(a, b) if isinstance(a, tuple) else a - b
        return StatsDelta(**out)

    def table(self) -> str:
        """A small text table of the per-tier counters."""
        head = (
            f"{'tier':<6}{'hit blk':>9}{'hit tok':>10}{'evict':>8}{'demote':>8}{'promote':>9}{'MiB used':>10}"
        )
        rows = [head]
        for i, kind in enumerate(self.tiers):
            rows.append(
                f"{kind.name:<6}{self.hit_blocks[i]:>9}{self.hit_tokens[i]:>10}{self.evictions[i]:>8}"
                f"{self.demotions[i]:>8}{self.promotions[i]:>9}{self.bytes_in_use[i] / 2**20:>10.2f}"
            )
        rows.append(
            f"misses: {self.miss_blocks} blocks / {self.miss_tokens} tokens; "
            f"hit ratio {self.hit_ratio:.3f}; pinned pages {self.pinned_pages}"
            + (f"; integrity drops {self.integrity_drops}" if self.integrity_drops else "")
        )
        return "\n".join(rows)


@dataclass(frozen=True)
class RequestStats:
    """One finished request's lookup accounting, tagged with its request id (None if untagged)."""

    request_id: int | None
    stats: StatsDelta


class Counters:
    """Mutable counters owned by a manager; ``snapshot`` freezes them into CacheStats.

    ``recent`` keeps the last ``keep_requests`` per-request records folded into the totals.
    """

    def __init__(self, num_tiers: int, keep_requests: int = 1024) -> None:
        self.recent: collections.deque[RequestStats] = collections.deque(maxlen=keep_requests)
        self.hit_blocks = [0] * num_tiers
        self.hit_tokens = [0] * num_tiers
        self.miss_blocks = 0
        self.miss_tokens = 0
        self.evictions = [0] * num_tiers
        self.demotions = [0] * num_tiers
        self.promotions = [0] * num_tiers
        self.imported_blocks = 0
        self.exported_blocks = 0
        self.committed_blocks = 0
        self.integrity_drops = 0
        self.quota_evictions = 0
        self.quota_refused = 0

    def fold(self, delta: StatsDelta, request_id: int | None = None) -> None:
        """Add a per-request delta into the totals and remember it in ``recent``."""
        self.recent.append(RequestStats(request_id, delta))
        for i in range(len(self.hit_blocks)):
            self.hit_blocks[i] += delta.hit_blocks[i]
            self.hit_tokens[i] += delta.hit_tokens[i]
        self.miss_blocks += delta.miss_blocks
        self.miss_tokens += delta.miss_tokens
        self.committed_blocks += delta.committed_blocks

    def counters(self) -> dict[str, object]:
        return {
            "hit_blocks": tuple(self.hit_blocks),
            "hit_tokens": tuple(self.hit_tokens),
            "miss_blocks": self.miss_blocks,
            "miss_tokens": self.miss_tokens,
            "evictions": tuple(self.evictions),
            "demotions": tuple(self.demotions),
            "promotions": tuple(self.promotions),
            "imported_blocks": self.imported_blocks,
            "exported_blocks": self.exported_blocks,
            "committed_blocks": self.committed_blocks,
            "integrity_drops": self.integrity_drops,
            "quota_evictions": self.quota_evictions,
            "quota_refused": self.quota_refused,
        }

"""Shared pieces of the stateful manager tests: the layout, prompt strategy, state snapshots,
the achievable-room bound, and the expected-stats model (test_stateful.py and
test_planner_properties.py use them)."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st

from raykv.core.config import CacheConfig, KVLayout, TierConfig
from raykv.core.keys import ReuseScope, block_keys
from raykv.core.manager import CacheManager
from raykv.core.stats import CacheStats, StatsDelta
from raykv.testing import ContentOracle

LAYOUT = KVLayout.uniform(2, 2, 8, tokens_per_block=4)
TPB = LAYOUT.tokens_per_block
PAGE = LAYOUT.page_bytes
ORACLE = ContentOracle(LAYOUT)

SCOPES = (ReuseScope(), ReuseScope(salt=1), ReuseScope(lora_id=7))
ROOT_KEYS = {s.root_key(): s for s in SCOPES}

# A few base prompts sharing prefixes with each other; requests take a prefix of one of them and
# append tokens from a tiny alphabet, so blocks are reused (and committed twice) all the time.
BASES = (
    tuple(range(1, 17)),
    (1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25),
    (30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41),
)
SMALL_TOKEN = st.integers(0, 3)


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, ...]:
    base = draw(st.sampled_from(BASES))
    cut = draw(st.integers(0, len(base)))
    suffix = draw(st.lists(SMALL_TOKEN, max_size=6))
    return tuple(base[:cut]) + tuple(suffix)


def make_config(host_pages: int, disk_pages: int | None, util: float, shared: bool = False) -> CacheConfig:
    """``shared``: the host tier lives in /dev/shm with a slot directory (checked by the
    invariants after every step)."""
    tiers = [TierConfig.host(host_pages * PAGE, shared=shared)]
    if disk_pages is not None:
        tiers.append(TierConfig.disk(disk_pages * PAGE))
    return CacheConfig(layout=LAYOUT, tiers=tuple(tiers), max_util_for_resume=util)


def live_pages(mgr: CacheManager) -> dict[int, Any]:
    pages = {b.page.uid: b.page for b in mgr.tree.iter_blocks()}
    for cache in mgr.open_caches():
        for page in cache.pages():
            pages[page.uid] = page
    return pages


def snapshot(mgr: CacheManager) -> tuple[Any, ...]:
    """Everything a rejected call must leave untouched."""
    pages = {
        uid: (
            p.level,
            int(p.slot),
            p.pins,
            p.holders,
            p.queued,
            None if p.block is None else p.block.key,
        )
        for uid, p in live_pages(mgr).items()
    }
    caches = {
        c.cache_id: (c.status, c.num_tokens, c.num_committed_blocks, tuple(p.uid for p in c.pages()))
        for c in mgr.open_caches()
    }
    return (
        mgr.committed_blocks(),
        mgr.stats(),
        tuple(p.num_used for p in mgr.pools),
        mgr.events.last_event_id,
        pages,
        caches,
        [[p.uid for p in mgr.policy.candidates(level)] for level in range(len(mgr.pools))],
    )


def achievable_room(mgr: CacheManager, exclude: set[int]) -> int:
    """A lower bound on the top-tier slots that evictions could free, touching no ``exclude`` page.

    Drop every committed block whose whole subtree is unpinned, unheld, unleased and not excluded
    (a drop needs no room), then demote other unpinned, not excluded top-tier pages into the slots
    the next tier has free or just freed. A refusal (OutOfPagesError, resume() -> False) for fewer
    pages than this means room could have been made.
    """
    blocks = sorted(mgr.tree.iter_blocks(), key=lambda b: -b.ordinal)  # children first
    droppable: dict[int, bool] = {}
    for b in blocks:
        page = b.page
        droppable[id(b)] = (
            page.holders == 0
            and page.pins == 0
            and page.leases == 0
            and page.uid not in exclude
            and all(droppable[id(c)] for c in b.children.values())
        )
    dropped = [b.page for b in blocks if droppable[id(b)]]
    room = mgr.pools[0].num_free + sum(1 for p in dropped if p.level == 0)
    if len(mgr.pools) > 1:
        gone = {p.uid for p in dropped}
        movable = sum(
            1
            for p in live_pages(mgr).values()
            if p.level == 0 and p.pins == 0 and p.leases == 0 and p.uid not in exclude and p.uid not in gone
        )
        below = mgr.pools[1].num_free + sum(1 for p in dropped if p.level == 1)
        room += min(movable, below)
    return room


def chain_depths(mgr: CacheManager) -> dict[bytes, int]:
    """key -> number of blocks from its scope root (1 for block 0); asserts there are no orphans."""
    depth: dict[bytes, int] = {}
    for info in mgr.committed_blocks():  # parents are listed before children
        if info.parent_key in ROOT_KEYS:
            depth[info.key] = 1
        else:
            assert info.parent_key in depth, f"orphan block {info.key.hex()[:16]}: parent not committed"
            depth[info.key] = depth[info.parent_key] + 1
    return depth


def check_matchable(mgr: CacheManager, model: dict[bytes, tuple[ReuseScope, tuple[int, ...]]]) -> None:
    """Every committed block is known to the model and matchable from its root to its depth."""
    depths = chain_depths(mgr)
    for key, depth in depths.items():
        assert key in model, f"committed block {key.hex()[:16]} was never committed nor imported"
        scope, tokens = model[key]
        assert len(tokens) == depth * TPB
        by_tokens = mgr.probe(tokens, scope)
        assert by_tokens.num_blocks >= depth, f"block at depth {depth} not matchable: {by_tokens}"
        keys = block_keys(tokens, TPB, scope)
        assert keys[-1] == key
        assert mgr.probe(keys=keys).num_blocks == depth


def record_keys(
    model: dict[bytes, tuple[ReuseScope, tuple[int, ...]]], scope: ReuseScope, tokens: tuple[int, ...]
) -> None:
    """Remember the tokens behind every full block of ``tokens``."""
    for i, key in enumerate(block_keys(tokens, TPB, scope)):
        model[key] = (scope, tokens[: (i + 1) * TPB])


class ExpectedStats:
    """What one manager's cumulative counters must read, from what the test did and saw."""

    def __init__(self, num_tiers: int) -> None:
        self.hit_blocks = [0] * num_tiers
        self.hit_tokens = [0] * num_tiers
        self.miss_blocks = 0
        self.miss_tokens = 0
        self.imported = 0
        self.exported = 0
        self.committed = 0
        self.removed_events = 0

    def fold(self, delta: StatsDelta) -> None:
        for i, (b, t) in enumerate(zip(delta.hit_blocks, delta.hit_tokens)):
            self.hit_blocks[i] += b
            self.hit_tokens[i] += t
        self.miss_blocks += delta.miss_blocks
        self.miss_tokens += delta.miss_tokens

    def check(self, stats: CacheStats) -> None:
        assert stats.hit_blocks == tuple(self.hit_blocks), (stats.hit_blocks, self.hit_blocks)
        assert stats.hit_tokens == tuple(self.hit_tokens), (stats.hit_tokens, self.hit_tokens)
        assert stats.miss_blocks == self.miss_blocks, (stats.miss_blocks, self.miss_blocks)
        assert stats.miss_tokens == self.miss_tokens, (stats.miss_tokens, self.miss_tokens)
        assert stats.imported_blocks == self.imported, (stats.imported_blocks, self.imported)
        assert stats.exported_blocks == self.exported, (stats.exported_blocks, self.exported)
        assert stats.committed_blocks == self.committed, (stats.committed_blocks, self.committed)
        # Every drop of a committed block is one eviction and one BlockRemoved event.
        assert sum(stats.evictions) == self.removed_events, (stats.evictions, self.removed_events)

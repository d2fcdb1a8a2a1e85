"""Shared fixtures for the raykv test suite.

Fixtures
--------
``layout``
    A small KVLayout: 2 layers x ("k", "v") x 2 KV heads x head_dim 8, float16, 4 tokens per
    block. One page is 512 bytes, so tiers of a handful of pages force demotion and eviction.
``oracle``
    A :class:`raykv.testing.ContentOracle` for ``layout``: fills pages the way an engine would and
    verifies them byte for byte after any tier move, export or import.
``make_manager``
    Factory ``make_manager(host_pages, disk_pages=0, **kw) -> CacheManager`` with a host top tier
    and, when ``disk_pages`` > 0, a disk tier below it. Sizes are in pages of the manager's layout
    (fractions allowed: ``2.5`` gives a capacity that is not a whole number of pages). Every
    manager it built is torn down at the end of the test: its open caches are closed first, then
    the manager is shut down (so disk-tier files are removed even when a test fails midway).
    Tests should still close the caches they open: a KvCache dropped while open (e.g. a local
    going out of scope when the test returns) warns ResourceWarning before teardown runs.

``run_request``
    ``run_request(mgr, tokens, *, close=True, **create_kw) -> KvCache``: one request the way an
    engine runs it: create (reusing the cached prefix), resume, verify the reused KV, extend with
    the rest of ``tokens``, write KV for the new blocks with the oracle, commit, and (by default)
    close. Calls ``mgr.check_invariants()`` after every step.
``state_of``
    ``state_of(mgr) -> dict``: checks invariants, then returns a comparable snapshot of everything
    a rejected call must leave untouched (committed blocks, stats, slots used per tier, last event
    id, every page's place/pins/holders, open caches, and the eviction order of every tier).

Typical use::

    def test_something(make_manager, oracle):
        mgr = make_manager(4, 8)
        cache = mgr.create(prompt)
        ...
        mgr.check_invariants()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from raykv import CacheConfig, CacheManager, ContentOracle, KvCache, KVLayout, TierConfig
from raykv.core.eviction import EvictionPolicy
from raykv.core.page import Page


@pytest.fixture
def layout() -> KVLayout:
    """2 layers, K and V of (2 heads x 8) float16, 4 tokens per block: 512-byte pages."""
    return KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4)


@pytest.fixture
def oracle(layout: KVLayout) -> ContentOracle:
    """Content oracle for the ``layout`` fixture."""
    return ContentOracle(layout)


MakeManager = Callable[..., CacheManager]


@pytest.fixture
def make_manager(layout: KVLayout) -> Iterator[MakeManager]:
    """Factory for CacheManagers with a host top tier and an optional disk tier.

    ``make_manager(host_pages, disk_pages=0, *, disk_path=None, layout=None, policy=None,
    pin_memory=False, **config_kw)``:

    - ``host_pages`` / ``disk_pages``: tier capacities in pages (``capacity = int(pages *
      page_bytes)``); ``disk_pages=0`` means no disk tier.
    - ``disk_path``: directory for the disk tier's file (default: a fresh temporary directory
      that the tier removes on shutdown).
    - ``layout``: overrides the ``layout`` fixture.
    - ``policy``: an EvictionPolicy instance (default: the manager's PriorityLRU).
    - ``config_kw``: passed to CacheConfig (``max_util_for_resume``, ``max_events``).

    Every manager is shut down at teardown after closing its open caches.
    """
    managers: list[CacheManager] = []

    def factory(
        host_pages: float,
        disk_pages: float = 0,
        *,
        disk_path: str | None = None,
        layout: KVLayout = layout,
        policy: EvictionPolicy | None = None,
        pin_memory: bool = False,
        **config_kw: Any,
    ) -> CacheManager:
        page = layout.page_bytes
        tiers = [TierConfig.host(int(host_pages * page), pin_memory=pin_memory)]
        if disk_pages:
            tiers.append(TierConfig.disk(int(disk_pages * page), path=disk_path))
        config = CacheConfig(layout=layout, tiers=tuple(tiers), **config_kw)
        mgr = CacheManager(config, policy=policy)
        managers.append(mgr)
        return mgr

    yield factory

    for mgr in reversed(managers):
        if mgr.closed:
            continue
        for cache in mgr.open_caches():
            cache.close()
        mgr.shutdown()


@pytest.fixture
def run_request(oracle: ContentOracle) -> Callable[..., KvCache]:
    """Run one request through a manager (see the module docstring); returns the KvCache."""

    def run(mgr: CacheManager, tokens: Sequence[int], *, close: bool = True, **create_kw: Any) -> KvCache:
        cache = mgr.create(tokens, **create_kw)
        mgr.check_invariants()
        assert cache.resume(), f"resume refused for {cache!r} on {mgr!r}"
        mgr.check_invariants()
        oracle.verify_cache(cache)
        reused = cache.num_reused_tokens
        cache.extend(list(tokens)[reused:])
        mgr.check_invariants()
        oracle.fill_cache(cache, reused // mgr.tokens_per_block)
        cache.commit()
        mgr.check_invariants()
        if close:
            cache.close()
            mgr.check_invariants()
        return cache

    return run


def _page_state(page: Page) -> tuple[int, int, int, int, int]:
    return (page.uid, int(page.level), int(page.slot), page.pins, page.holders)


@pytest.fixture
def state_of() -> Callable[[CacheManager], dict[str, Any]]:
    """Snapshot a manager (after checking its invariants) for before/after comparisons."""

    def snapshot(mgr: CacheManager) -> dict[str, Any]:
        mgr.check_invariants()
        caches = sorted(mgr.open_caches(), key=lambda c: c.cache_id)
        return {
            "blocks": mgr.committed_blocks(),
            "stats": mgr.stats(),
            "used": tuple(p.num_used for p in mgr.pools),
            "last_event_id": mgr.events.last_event_id,
            "tree_pages": sorted((b.key, _page_state(b.page)) for b in mgr.tree.iter_blocks()),
            "caches": [
                (
                    c.cache_id,
                    c.status,
                    c.num_tokens,
                    c.num_committed_blocks,
                    c.tokens.tolist(),
                    [_page_state(p) for p in c.pages()],
                )
                for c in caches
            ],
            "eviction_order": [
                [p.uid for p in mgr.policy.candidates(level)] for level in range(len(mgr.pools))
            ],
        }

    return snapshot

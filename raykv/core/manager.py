"""CacheManager: the facade users call for the cache of one device.

The state and its bookkeeping (tiers, block tree, eviction, pins, leases, events, counters, the
lock) live in one :class:`~raykv.core.store.PageStore` (``mgr.store``), which requests
(:class:`~raykv.core.kvcache.KvCache`), export/import and the invariant checks work on; this class
validates arguments, takes the lock and delegates.

Lifecycle of a request (see :class:`raykv.core.kvcache.KvCache`): ``create`` matches the longest cached
prefix and holds it; ``resume`` brings its pages to the top tier and pins them; ``extend``
allocates pages for new tokens; the engine writes KV into the pages; ``commit`` puts full blocks
into the tree; ``suspend`` unpins (pages may then be demoted); ``close`` releases everything.

Every public method holds the manager's lock, so a manager may be shared between threads. A
rejected call raises a typed error and leaves the manager unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.config import CacheConfig
from raykv.core.errors import InvalidArgumentError
from raykv.core.events import CacheEvent
from raykv.core.eviction import EvictionPolicy
from raykv.core.export_import import export_blocks, import_blocks, import_pages
from raykv.core.invariants import check_store
from raykv.core.keys import DEFAULT_SCOPE, MultimodalItem, ReuseScope, TokenSeq, block_keys, check_mm_items
from raykv.core.kvcache import KvCache, Status
from raykv.core.radix import Block, Root
from raykv.core.records import (
    BlockLease,
    BlockRecords,
    CommittedBlockInfo,
    ExportedBlock,
    ImportResult,
    LeasedBlock,
    ProbeResult,
)
from raykv.core.stats import CacheStats, RequestStats
from raykv.core.store import PageStore, StoreLock
from raykv.core.tiers import PagePool
from raykv.core.types import (
    DEFAULT_PRIORITY,
    PageId,
    check_block_keys,
    check_priority,
    check_u64,
)

log = logging.getLogger(__name__)

_POLICY_METHODS = ("add", "remove", "touch", "cool", "candidates", "count")


class CacheManager:
    """The cache of one device. See the module docstring for the request lifecycle."""

    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None) -> None:
        """Build the tiers ``config`` describes. Raises InvalidArgumentError ``config`` for a
        non-CacheConfig, ``policy`` for an object lacking the EvictionPolicy methods; OutOfMemoryError
        when a tier cannot reserve its memory or file space."""
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError("config", "must be a CacheConfig")
        if policy is not None and not all(callable(getattr(policy, m, None)) for m in _POLICY_METHODS):
            raise InvalidArgumentError("policy", f"must be an EvictionPolicy, got {type(policy).__name__}")
        self.store = PageStore(config, policy)
        """The page bookkeeping every part of the cache works on (:mod:`raykv.core.store`)."""
        store = self.store
        # The store's objects, for readers (each is the same object as the store's).
        self.config = config
        self.layout = config.layout
        self.tokens_per_block = config.layout.tokens_per_block
        self.pools = store.pools
        self.tier_kinds = store.tier_kinds
        self.copy = store.copy
        self.tree = store.tree
        self.policy = store.policy
        self.events = store.events
        self.counters = store.counters
        self._lock_ctx = store.locked()  # one object per store: no call through the store per use
        log.debug(
            "CacheManager up: tiers %s, page %d bytes",
            [(p.kind.name, p.num_slots) for p in self.pools],
            self.layout.page_bytes,
        )

    def locked(self) -> StoreLock:
        """Hold the manager lock (``with mgr.locked():``, re-entrant); first release requests
        that were garbage-collected while open.

        (A KvCache finalizer only queues its pages here: it may run at any point, even inside
        another call on this thread, so it must not touch the tree or queues itself.)
        """
        return self._lock_ctx

    # ---- properties ----------------------------------------------------------------------------
    @property
    def top_pool(self) -> PagePool:
        """The top tier's pool (the one engines read); its slot ids are page ids."""
        return self.pools[0]

    @property
    def num_open_requests(self) -> int:
        with self.locked():
            return self.store.num_open

    @property
    def closed(self) -> bool:
        return self.store.closed

    # ---- requests ------------------------------------------------------------------------------
    def create(
        self,
        tokens: TokenSeq,
        scope: ReuseScope | None = None,
        priority: int = DEFAULT_PRIORITY,
        request_id: int | None = None,
        mm_items: Iterable[MultimodalItem] = (),
    ) -> KvCache:
        """Open a request: match the longest cached prefix of ``tokens`` and hold it.

        Returns a SUSPENDED KvCache whose ``num_reused_tokens`` (a multiple of tokens_per_block)
        says how much KV is already cached; the cache starts holding exactly those tokens. If the
        engine must recompute the last prompt token, drop it from ``tokens``.

        Raises InvalidArgumentError (a ValueError) naming the argument for bad ``tokens`` (ids
        outside ``0 ..= 2**31 - 1``, non-integers, ``bytes``/``str``, arrays not one-dimensional),
        ``scope``, ``priority`` (int in 0..100), ``request_id`` (u64) or ``mm_items``; StateError
        after shutdown. A refused call changes nothing.
        """
        scope = DEFAULT_SCOPE if scope is None else scope
        if not isinstance(scope, ReuseScope):
            raise InvalidArgumentError("scope", f"must be a ReuseScope, got {type(scope).__name__}")
        prio = check_priority(priority)
        if request_id is not None:
            check_u64("request_id", request_id)
        items = check_mm_items(mm_items, None)
        with self.locked():
            self._check_open()
            cache = KvCache(self.store, scope, tokens, prio, request_id, items)
            self.store.track(cache.cache_id, cache)
            return cache

    def probe(
        self,
        tokens: TokenSeq | None = None,
        scope: ReuseScope | None = None,
        keys: Sequence[bytes] | None = None,
        mm_items: Iterable[MultimodalItem] = (),
    ) -> ProbeResult:
        """How many leading blocks of ``tokens`` (in ``scope``) or of ``keys`` are cached, and on
        which tier each one sits. Changes nothing (no LRU touch, no stats). Give exactly one of
        ``tokens`` and ``keys``; raises InvalidArgumentError (a ValueError) otherwise, and naming
        ``tokens``/``keys``/``key``/``scope``/``mm_items`` for a bad value."""
        if (tokens is None) == (keys is None):
            raise InvalidArgumentError("tokens", "give exactly one of tokens and keys")
        if keys is not None:
            checked = check_block_keys(keys)
            with self.locked():
                blocks = self.tree.match_keys(checked)  # type: ignore[arg-type]
                return self._probe_result(blocks)
        scope = DEFAULT_SCOPE if scope is None else scope
        assert tokens is not None
        chain = block_keys(tokens, self.tokens_per_block, scope, mm_items)
        with self.locked():
            return self._probe_result(self.tree.match(scope.root_key(), chain))

    def _probe_result(self, blocks: list[Block]) -> ProbeResult:
        tiers = tuple(self.tier_kinds[b.page.level] for b in blocks)
        return ProbeResult(len(blocks), len(blocks) * self.tokens_per_block, tiers)

    # ---- block exchange ------------------------------------------------------------------------
    def export_blocks(self, keys: Sequence[bytes]) -> list[ExportedBlock]:
        """Bytes and metadata of the committed blocks among ``keys`` (missing keys are skipped;
        order follows ``keys``). Pages stay where they are. Raises InvalidArgumentError ``key``
        for a malformed key (``keys`` when not a sequence of keys), StateError after shutdown.
        A disk page that fails its checksum is dropped (with its descendants) and skipped too.
        """
        checked = check_block_keys(keys)
        with self.locked():
            self._check_open()
            return export_blocks(self.store, checked)

    def import_blocks(
        self, blocks: Sequence[ExportedBlock], priority: int = DEFAULT_PRIORITY
    ) -> ImportResult:
        """Add blocks received from a peer as committed, matchable blocks on the top tier.

        Each block's parent must be in the tree, earlier in ``blocks``, or a scope root
        (``parent_is_root``). Blocks already present are skipped. The batch is rejected whole,
        with nothing changed, on a checksum mismatch (IntegrityError), a missing parent or a
        malformed record (ImportRejectedError), or no room (OutOfPagesError). Returns an
        ImportResult. InvalidArgumentError ``blocks`` when not a sequence, ``priority`` for a
        priority outside 0..100; StateError after shutdown.
        """
        prio = check_priority(priority)
        if isinstance(blocks, (bytes, bytearray, str)) or not isinstance(blocks, Iterable):
            raise InvalidArgumentError(
                "blocks", f"must be a sequence of ExportedBlock, got {type(blocks).__name__}"
            )
        with self.locked():
            self._check_open()
            return import_blocks(self.store, list(blocks), prio)

    def import_pages(
        self,
        records: BlockRecords,
        data: npt.NDArray[np.uint8],
        checksums: Sequence[int] | None = None,
        verify: bool = True,
        priority: int = DEFAULT_PRIORITY,
        confirm: Callable[[], object] | None = None,
    ) -> ImportResult:
        """:meth:`import_blocks` with the pages as rows: ``data[i]`` (uint8, shape
        ``[len(records), page_bytes]``) is block ``i``'s page. New blocks' rows reach the top tier
        in one batched copy; ``verify`` first compares each row's CRC-32 with ``checksums[i]``.
        Same all-or-nothing rules (:mod:`raykv.core.export_import`); ImportRejectedError (``index``
        None) for mismatched shapes. ``confirm`` runs after the rows are written, before any block
        is inserted, without the manager's lock (staged pages and cached parents leased): if it
        raises, the pages are given back and the error propagates (evictions made stay made).
        InvalidArgumentError ``records`` when not a BlockRecords, ``priority`` outside 0..100.
        """
        prio = check_priority(priority)
        if not isinstance(records, BlockRecords):
            raise InvalidArgumentError("records", f"must be a BlockRecords, got {type(records).__name__}")
        return import_pages(self.store, records, data, checksums, verify, prio, confirm)

    def cool_blocks(self, keys: Sequence[bytes]) -> int:
        """Make the committed blocks among ``keys`` the first to be demoted or evicted within their
        priority (e.g. a source whose copy a peer just pulled: one copy is enough). Missing or
        pinned blocks are skipped; nothing else changes. Returns how many were cooled.
        InvalidArgumentError ``key``/``keys`` for a malformed key; StateError after shutdown."""
        checked = check_block_keys(keys)
        with self.locked():
            self._check_open()
            found = [b for b in (self.tree.get(k) for k in checked) if b is not None]
            for block in found:  # each goes before the previous one: the deepest block is first
                self.policy.cool(block.page)
            return sum(1 for b in found if b.page.queued)

    def lease_blocks(self, keys: Sequence[bytes]) -> BlockLease:
        """Hold the committed blocks among ``keys`` in place for a zero-copy sender.

        Leased pages are neither moved nor dropped until :meth:`release_lease`; their bytes can be
        read with :meth:`leased_page` meanwhile. Missing keys are skipped. InvalidArgumentError
        ``key``/``keys`` for a malformed key; ``clear_reusable``/``shutdown`` refuse while leases
        are open.
        """
        checked = check_block_keys(keys)
        with self.locked():
            self._check_open()
            found = [b for b in (self.tree.get(k) for k in checked) if b is not None]
            lease_id = self.store.hold_pages([b.page for b in found])
            blocks = tuple(
                LeasedBlock(
                    b.key,
                    b.parent_key,
                    isinstance(b.parent, Root),
                    b.num_tokens,
                    self.tier_kinds[b.page.level],
                    b.page.level,
                    int(b.page.slot),
                    b.checksum,
                )
                for b in found
            )
            return BlockLease(lease_id, blocks)

    def remember_checksums(self, blocks: Sequence[LeasedBlock], sums: Sequence[int]) -> None:
        """Keep the page checksums a sender computed for leased ``blocks`` (same order), so later
        leases carry them (``LeasedBlock.checksum``) and no sender reads those pages to checksum
        them again. Call while the lease is held: its pages are then still the blocks' own. A
        block that already has one keeps it; blocks no longer in the tree are skipped.
        InvalidArgumentError ``sums`` when its length differs from ``blocks``."""
        blocks, sums = list(blocks), list(sums)
        if len(blocks) != len(sums):
            raise InvalidArgumentError("sums", f"{len(sums)} checksums for {len(blocks)} blocks")
        with self.locked():
            for leased, crc in zip(blocks, sums):
                block = self.tree.get(leased.key)
                if block is not None and block.checksum is None:
                    block.checksum = int(crc)

    def leased_page(self, block: LeasedBlock) -> Any:
        """The page of a leased block, in place: a numpy (host) or torch (GPU) uint8 view; a
        disk page is read into a new array, checked: PageCorruptError when it fails its checksum
        (the block is dropped at its next read under the lock). Valid until the lease is
        released."""
        pool = self.pools[block.level]
        if hasattr(pool, "page"):
            self.copy.settle(block.level, [PageId(block.slot)])  # a copy into it may be in flight
            return pool.page(PageId(block.slot))
        return self.copy.read(block.level, [PageId(block.slot)])[0]

    def release_lease(self, lease_id: int) -> None:
        """Release a lease (idempotent); its pages become movable again. InvalidArgumentError
        ``lease_id`` for a non-int."""
        if isinstance(lease_id, bool) or not isinstance(lease_id, int):
            raise InvalidArgumentError("lease_id", f"must be an int, got {type(lease_id).__name__}")
        self.store.release_lease(lease_id)

    def committed_blocks(self) -> list[CommittedBlockInfo]:
        """Snapshot of every committed block (parents before children) with its tier."""
        with self.locked():
            blocks = sorted(self.tree.iter_blocks(), key=lambda b: b.ordinal)
            return [
                CommittedBlockInfo(b.key, b.parent_key, self.tier_kinds[b.page.level], b.num_tokens)
                for b in blocks
            ]

    # ---- observation ---------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """A frozen snapshot of the counters and gauges (valid forever; it is a copy)."""
        with self.locked():
            return CacheStats(
                **self.counters.counters(),  # type: ignore[arg-type]
                tiers=self.tier_kinds,
                bytes_in_use=tuple(p.num_used * p.page_bytes for p in self.pools),
                capacity_bytes=tuple(p.capacity_bytes for p in self.pools),
                pinned_pages=self.store.pinned_top,
                open_requests=self.store.num_open,
            )

    def request_stats(self) -> list[RequestStats]:
        """Per-request lookup stats of the most recently finished requests (oldest first)."""
        with self.locked():
            return list(self.counters.recent)

    def drain_events(self, max_events: int | None = None) -> list[CacheEvent]:
        """Remove and return the oldest queued events (all when ``max_events`` is None).
        InvalidArgumentError ``max_events`` unless None or an int >= 0."""
        if max_events is not None and (
            isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 0
        ):
            raise InvalidArgumentError("max_events", f"must be None or an int >= 0, got {max_events!r}")
        return self.events.drain(max_events)

    def top_utilization(self) -> float:
        """Fraction of top-tier pages pinned by active requests."""
        return self.store.pinned_top / self.top_pool.num_slots

    # ---- global operations ---------------------------------------------------------------------
    def clear_reusable(self) -> int:
        """Drop every committed block; returns how many. Emits AllCleared.

        Raises ResourceBusyError (changing nothing) while requests are open.
        """
        with self.locked():
            self._check_open()
            self.store.refuse_if_busy("clear_reusable()")
            return self.store.clear()

    def shutdown(self) -> None:
        """Clear the tree and release every tier (the disk tier's temp files go). Idempotent.

        Raises ResourceBusyError (changing nothing) while requests are open.
        """
        with self.locked():
            if self.store.closed:
                return
            self.store.refuse_if_busy("shutdown()")
            self.store.close()

    def _check_open(self) -> None:
        self.store.check_open()

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Verify tree, pools, pins, holders, queues and counters; AssertionError on a violation."""
        with self.locked():
            check_store(self.store, self.stats())

    def open_caches(self) -> list[KvCache]:
        """The open requests (their KvCache objects) still alive."""
        return self.store.open_requests()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{p.kind.name}:{p.num_used}/{p.num_slots}" for p in self.pools)
        return f"CacheManager({tiers}, blocks={len(self.tree)}, open={self.store.num_open})"


__all__ = ["CacheManager", "KvCache", "Status"]

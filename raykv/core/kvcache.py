"""KvCache: one request's view of the cache.

Lengths: the cache holds ``num_tokens`` tokens in ``num_blocks`` pages (the last may be partial).
``num_committed_blocks`` of them are committed (full, keyed, matchable). A new cache holds exactly
its ``num_reused_tokens``.

Status: SUSPENDED (initial) -> ``resume()`` -> ACTIVE -> ``suspend()`` -> SUSPENDED ... ->
``close()`` -> CLOSED. While ACTIVE every page is pinned on the top tier, so ``page_ids()`` and the
page views stay valid until the next ``suspend()`` or ``close()``. While SUSPENDED pages may be
demoted (never dropped). A cache garbage-collected while open warns and closes itself.

If a block this request commits is already in the tree (another request committed the same
tokens), this request's page stays private to it: page ids never change under an active engine.

A page that fails its checksum when read back from the disk tier is never served: ``resume`` (and
``commit``) cut the cache before the first such page, so ``num_tokens``, ``num_blocks``,
``num_committed_blocks`` and ``num_reused_tokens`` may shrink there (a shorter hit, as if those
blocks had not been cached): read them after ``resume``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.errors import InvalidArgumentError, StateError
from raykv.core.keys import MultimodalItem, ReuseScope, TokenSeq, chain_keys, check_mm_items, tokens_to_array
from raykv.core.page import Page
from raykv.core.radix import Block
from raykv.core.stats import StatsDelta
from raykv.core.store import PageStore
from raykv.core.types import BlockKey, PageId, Priority, TierKind


class Status(enum.Enum):
    SUSPENDED = "suspended"
    ACTIVE = "active"
    CLOSED = "closed"


class KvCache:
    """A request's KV pages. Create through :meth:`CacheManager.create`."""

    def __init__(
        self,
        store: PageStore,
        scope: ReuseScope,
        tokens: TokenSeq,
        priority: Priority,
        request_id: int | None,
        mm_items: tuple[MultimodalItem, ...],
    ) -> None:
        self.status = Status.CLOSED  # until fully built, so __del__ of a failed init is quiet
        arr = tokens_to_array(tokens)
        self.mm_items = check_mm_items(mm_items, len(arr))
        self._store = store
        self.scope = scope
        self.root_key = scope.root_key()
        self.priority = priority
        self.request_id = request_id
        self.cache_id = store.next_cache_id()
        store.note_scope(self.root_key, scope.salt)
        tpb = store.tokens_per_block
        self.tokens_per_block = tpb
        input_keys = chain_keys(self.root_key, arr, tpb, 0, self.mm_items)
        matched = store.tree.match(self.root_key, input_keys)
        self._keys: list[BlockKey] = [b.key for b in matched]
        self._pages: list[Page] = [b.page for b in matched]
        self._num_committed = len(matched)
        self.num_reused_tokens = len(matched) * tpb
        self._buf = np.array(arr[: self.num_reused_tokens], dtype=np.uint32)
        self._len = self.num_reused_tokens
        for page in self._pages:
            page.holders += 1
            store.policy.touch(page)
        self._pending: StatsDelta | None = self._lookup_stats(matched, len(input_keys), len(arr))
        self._input = (arr, input_keys)  # reused at commit when the prompt is what was extended
        self.status = Status.SUSPENDED

    def _lookup_stats(self, matched: list[Block], n_full: int, n_tokens: int) -> StatsDelta:
        n = len(self._store.pools)
        hit_blocks, hit_tokens = [0] * n, [0] * n
        self._hit_levels = [block.page.level for block in matched]
        for level in self._hit_levels:
            hit_blocks[level] += 1
            hit_tokens[level] += self.tokens_per_block
        zero = StatsDelta.zero(n)
        return StatsDelta(
            hit_blocks=tuple(hit_blocks),
            hit_tokens=tuple(hit_tokens),
            miss_blocks=n_full - len(matched),
            miss_tokens=n_tokens - self.num_reused_tokens,
            evictions=zero.evictions,
            demotions=zero.demotions,
            promotions=zero.promotions,
            imported_blocks=0,
            exported_blocks=0,
            committed_blocks=0,
        )

    # ---- read-only state ------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._len

    @property
    def num_blocks(self) -> int:
        return len(self._pages)

    @property
    def num_committed_blocks(self) -> int:
        return self._num_committed

    @property
    def tokens(self) -> npt.NDArray[np.uint32]:
        """A copy of the tokens this cache holds."""
        return self._buf[: self._len].copy()

    @property
    def is_active(self) -> bool:
        return self.status is Status.ACTIVE

    @property
    def pending_stats(self) -> StatsDelta | None:
        """This request's lookup stats not yet folded into the manager (None once folded)."""
        return self._pending

    def committed_keys(self) -> list[BlockKey]:
        """The keys of the committed blocks, in order (a new list)."""
        return self._keys[: self._num_committed]

    def block_key(self, index: int) -> BlockKey:
        """Key of block ``index`` over the tokens it holds now (a partial block's key is private:
        it is never shared; the content oracle uses it to name the page's bytes).
        InvalidArgumentError ``index`` for an index outside the blocks held."""
        self._check_index(index)
        parent = self.root_key if index == 0 else self._full_keys(index)[index - 1]
        end = min(self._len, (index + 1) * self.tokens_per_block)  # hash this block only
        return chain_keys(
            parent, self._buf[:end], self.tokens_per_block, index, self.mm_items, allow_partial=True
        )[0]

    def block_num_tokens(self, index: int) -> int:
        """Tokens held by block ``index`` (tokens_per_block except maybe for the last block).
        InvalidArgumentError ``index`` for an index outside the blocks held."""
        self._check_index(index)
        return min(self.tokens_per_block, self._len - index * self.tokens_per_block)

    def _full_keys(self, upto: int) -> list[BlockKey]:
        """Keys of full blocks ``0 .. upto-1`` (computed once, then cached)."""
        have = len(self._keys)
        arr, input_keys = self._input
        n = min(upto, len(input_keys))
        if have < n:
            tpb = self.tokens_per_block
            if np.array_equal(self._buf[have * tpb : n * tpb], arr[have * tpb : n * tpb]):
                self._keys += input_keys[have:n]
                have = n
        if upto > have:
            parent = self._keys[-1] if have else self.root_key
            self._keys += chain_keys(
                parent, self._buf[: upto * self.tokens_per_block], self.tokens_per_block, have, self.mm_items
            )
        return self._keys

    # ---- lifecycle ------------------------------------------------------------------------------
    def resume(self) -> bool:
        """SUSPENDED -> ACTIVE: bring every page to the top tier and pin it.

        Returns False, changing nothing, when the top tier's pinned fraction would exceed the
        config's ``max_util_for_resume`` or room cannot be made. True if already active. Raises
        StateError when closed. A page that fails its checksum on the way up (or failed one
        earlier) is dropped and the cache is cut before it (see the module docstring): the
        caller sees a shorter ``num_reused_tokens``/``num_tokens``, never an exception.
        """
        mgr = self._store
        with mgr.locked():
            self._check_not_closed()
            if self.status is Status.ACTIVE:
                return True
            newly_pinned = sum(1 for p in self._pages if p.pins == 0)
            top = mgr.top_pool.num_slots
            if (mgr.pinned_top + newly_pinned) / top > mgr.config.max_util_for_resume:
                return False
            lower = [p for p in self._pages if p.level != 0]
            if lower:
                planner = mgr.plan_room(0, len(lower), {p.uid for p in self._pages})
                if planner is None:
                    return False
                mgr.execute(planner)
                lower.sort(key=lambda p: p.level)
                for level in sorted({p.level for p in lower}):
                    mgr.move_pages([p for p in lower if p.level == level], 0)
            self._cut_corrupt()
            for page in self._pages:
                mgr.pin(page)
            self.status = Status.ACTIVE
            return True

    def suspend(self) -> None:
        """ACTIVE -> SUSPENDED: unpin every page (they become evictable, may be demoted).
        No-op when already suspended; StateError when closed."""
        with self._store.locked():
            self._check_not_closed()
            if self.status is Status.ACTIVE:
                for page in self._pages:
                    self._store.unpin(page)
                self.status = Status.SUSPENDED

    def extend(self, tokens: TokenSeq) -> None:
        """Append tokens, allocating top-tier pages for the blocks they start. ACTIVE only.

        Raises InvalidArgumentError ``tokens`` (a ValueError) for bad tokens, StateError when not
        active, OutOfPagesError when no page can be evicted; in every case nothing changes.
        """
        mgr = self._store
        with mgr.locked():
            arr = tokens_to_array(tokens)
            if self.status is not Status.ACTIVE:
                raise StateError(f"extend() needs an active cache (status {self.status.value})")
            new_len = self._len + len(arr)
            need = math.ceil(new_len / self.tokens_per_block) - len(self._pages)
            pages = mgr.allocate_pages(need, self.priority, set())
            for page in pages:
                page.holders = 1
                mgr.pin(page)
            self._pages += pages
            if new_len > len(self._buf):
                grown = np.empty(max(new_len, 2 * len(self._buf), 64), dtype=np.uint32)
                grown[: self._len] = self._buf[: self._len]
                self._buf = grown
            self._buf[self._len : new_len] = arr
            self._len = new_len

    def commit(self, num_tokens: int | None = None) -> int:
        """Commit the full blocks among the first ``num_tokens`` tokens (default: all held).

        Their KV must already be written, or queued on the current CUDA stream for a GPU tier
        (an event recorded there orders every later copy or peer read after it). Each newly
        committed block becomes matchable (a BlockStored event) unless an identical block is
        already cached. Folds this request's pending stats into the manager. Returns how many
        blocks were newly committed (under ``max_blocks_per_salt``, blocks the salt's quota
        refused stay private to this request and are not counted). A suspended cache holding a
        page that failed its checksum is cut first (the module docstring), so ``num_tokens`` may
        then be fewer than asked for.
        Raises InvalidArgumentError ``num_tokens`` for a non-int or a count outside
        ``0 ..= num_tokens`` held, StateError when closed; either way nothing changes.
        """
        mgr = self._store
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)):
            raise InvalidArgumentError("num_tokens", f"must be an int or None, got {num_tokens!r}")
        with mgr.locked():
            self._check_not_closed()
            self._cut_corrupt()
            upto = self._len if num_tokens is None else num_tokens
            if not 0 <= upto <= self._len:
                raise InvalidArgumentError("num_tokens", f"must be in 0..{self._len}, got {upto!r}")
            last = upto // self.tokens_per_block
            keys = self._full_keys(last)
            start = self._num_committed
            new = [i for i in range(start, last) if keys[i] not in mgr.tree]
            if new and mgr.tier_kinds[0] is TierKind.GPU:
                # The engine's KV writes may still be queued: order every later reader (copies out,
                # gpu_peer readers) after them, before the blocks become visible.
                slots = [self._pages[i].slot for i in new if self._pages[i].level == 0]
                mgr.pools[0].record_written(slots)  # type: ignore[attr-defined]
            refused = self._insert(new[0], last, start) if new else 0
            self._num_committed = max(start, last)
            committed = max(0, last - start) - refused
            mgr.counters.committed_blocks += committed
            self._fold_stats()
            return committed

    def _insert(self, first: int, last: int, start: int) -> int:
        """Cache blocks ``first .. last - 1`` (``first``: the first new one; any of them cached
        meanwhile is skipped), after the private ancestors whose twin is gone (the run of
        uncached blocks just before ``first``), in one :meth:`PageStore.cache_blocks`. Returns
        how many blocks from ``start`` on were left uncached (the salt's quota refused them: they
        stay this request's private pages; a later commit offers them again)."""
        keys, tree = self._keys, self._store.tree
        while first > 0 and keys[first - 1] not in tree:
            first -= 1
        parents = [self.root_key if first == 0 else keys[first - 1], *keys[first : last - 1]]
        n = last - first
        skipped = self._store.cache_blocks(
            keys[first:last],
            parents,
            [first == 0] + [False] * (n - 1),
            self._pages[first:last],
            [self.tokens_per_block] * n,
            self.request_id,
        )
        return sum(1 for j in skipped if first + j >= start)

    def close(self) -> None:
        """Release every page (committed blocks stay cached). Idempotent."""
        mgr = self._store
        with mgr.locked():
            if self.status is Status.CLOSED:
                return
            mgr.release_cache_pages(self._pages, self.status is Status.ACTIVE)
            self._fold_stats()
            self.status = Status.CLOSED
            self._pages = []
            mgr.forget_cache(self.cache_id)

    def _cut_corrupt(self) -> None:
        """Keep only the blocks before the first page that failed its checksum (if any): the
        rest are released, and the lookup stats count the reused blocks cut as misses."""
        corrupt = self._store.corrupt
        if not corrupt:
            return
        cut = next((i for i, p in enumerate(self._pages) if p.uid in corrupt), None)
        if cut is None:
            return
        self._store.release_cache_pages(self._pages[cut:], self.status is Status.ACTIVE)
        del self._pages[cut:]
        del self._keys[cut:]
        tpb = self.tokens_per_block
        self._num_committed = min(self._num_committed, cut)
        self._len = min(self._len, cut * tpb)
        lost = self._hit_levels[cut:]
        del self._hit_levels[cut:]
        self.num_reused_tokens = min(self.num_reused_tokens, cut * tpb)
        if self._pending is not None and lost:
            self._pending = self._pending + self._as_misses(lost)

    def _as_misses(self, levels: Sequence[int]) -> StatsDelta:
        """A delta that turns hits on ``levels`` (one entry per block) into misses."""
        n, tpb = len(self._store.pools), self.tokens_per_block
        blocks, tokens = [0] * n, [0] * n
        for level in levels:
            blocks[level] -= 1
            tokens[level] -= tpb
        zero = StatsDelta.zero(n)
        return dataclasses.replace(
            zero,
            hit_blocks=tuple(blocks),
            hit_tokens=tuple(tokens),
            miss_blocks=len(levels),
            miss_tokens=len(levels) * tpb,
        )

    def _fold_stats(self) -> None:
        if self._pending is not None:
            self._store.counters.fold(self._pending, self.request_id)
            self._pending = None

    def _check_not_closed(self) -> None:
        if self.status is Status.CLOSED:
            raise StateError("this KvCache is closed")

    def _check_active(self) -> None:
        if self.status is not Status.ACTIVE:
            raise StateError(f"page access needs an active cache (status {self.status.value})")

    # ---- page access ----------------------------------------------------------------------------
    def page_ids(self) -> list[PageId]:
        """Top-tier slot of every block, in order. ACTIVE only; valid until suspend/close."""
        with self._store.locked():
            self._check_active()
            return [p.slot for p in self._pages]

    def page(self, index: int) -> Any:
        """Writable view of block ``index``'s whole page: numpy uint8 on a host top tier, a
        torch uint8 tensor on a GPU top tier. ACTIVE only; valid until suspend/close."""
        with self._store.locked():
            self._check_active()
            return self._store.top_pool.page(self._page_at(index).slot)  # type: ignore[attr-defined]

    def buffer_view(self, index: int, layer_id: int, role: str) -> Any:
        """Typed view ``[tokens_per_block, *shape]`` of one (layer, role) buffer of block
        ``index``. Raises RoleNotFoundError for a (layer, role) the layout lacks."""
        with self._store.locked():
            self._check_active()
            slot = self._page_at(index).slot
            return self._store.top_pool.buffer_view(slot, layer_id, role)  # type: ignore[attr-defined]

    def _check_index(self, index: object) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._pages):
            raise InvalidArgumentError("index", f"block {index!r} not in 0..{len(self._pages) - 1}")

    def _page_at(self, index: int) -> Page:
        self._check_index(index)
        return self._pages[index]

    def pages(self) -> list[Page]:
        """The page handles (for invariant checks and tests)."""
        return list(self._pages)

    def __enter__(self) -> KvCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        status = getattr(self, "status", Status.CLOSED)
        if status is Status.CLOSED:
            return
        warnings.warn(
            f"KvCache {self.cache_id} was garbage-collected while open; closing it",
            ResourceWarning,
            stacklevel=2,
        )
        # Only queue the release: a finalizer may run in the middle of another manager call.
        self.status = Status.CLOSED
        pending, self._pending = self._pending, None
        self._store.defer_release(
            self.cache_id, self._pages, status is Status.ACTIVE, pending, self.request_id
        )
        self._pages = []

    def __repr__(self) -> str:
        return (
            f"KvCache(id={self.cache_id}, {self.status.value}, tokens={self._len}, "
            f"blocks={len(self._pages)}, committed={self._num_committed}, "
            f"reused={self.num_reused_tokens})"
        )

"""Stateful (model-based) tests of CacheManager's core lifecycle.

A hypothesis RuleBasedStateMachine drives two small managers (a host top tier, sometimes a disk
tier below it) through create / resume / extend / commit / suspend / close, block export and
import in both directions, probes and clear_reusable. An "engine" (the ContentOracle) writes the
KV of every page an extend allocates. After every step both managers' invariants hold, every page
of every active cache and every committed block (on whatever tier) holds the oracle's bytes, the
event stream mirrors the committed set, the stats counters match what the test did, and every
committed block is matchable from its root. Every refusal (OutOfPagesError, resume() -> False,
a rejected import) must leave the manager untouched, and OutOfPagesError / resume() -> False
must only happen when room really could not be made (``achievable_room``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from stateful_support import (
    BASES,
    ORACLE,
    PAGE,
    ROOT_KEYS,
    SCOPES,
    SMALL_TOKEN,
    TPB,
    ExpectedStats,
    achievable_room,
    check_matchable,
    make_config,
    prompts,
    record_keys,
    snapshot,
)

from raykv.core.errors import (
    ImportRejectedError,
    IntegrityError,
    OutOfPagesError,
    ResourceBusyError,
    StateError,
)
from raykv.core.events import AllCleared, BlockRemoved, BlockStored, BlockTierChanged
from raykv.core.keys import ReuseScope, block_keys
from raykv.core.kvcache import KvCache, Status
from raykv.core.manager import CacheManager
from raykv.core.records import ExportedBlock
from raykv.core.stats import StatsDelta
from raykv.core.types import TierKind


class CacheMachine(RuleBasedStateMachine):
    caches = Bundle("caches")

    def __init__(self) -> None:
        super().__init__()
        self.mgr: CacheManager | None = None
        self.mgr2: CacheManager | None = None
        self.open: dict[int, KvCache] = {}
        self.model: dict[bytes, tuple[ReuseScope, tuple[int, ...]]] = {}
        self.mirror: dict[int, dict[bytes, tuple[bytes, TierKind]]] = {}
        self.expected: dict[int, ExpectedStats] = {}
        self.unfolded: dict[int, tuple[KvCache, StatsDelta]] = {}

    # ---- setup ---------------------------------------------------------------------------------
    @initialize(
        host=st.integers(6, 12),
        disk=st.one_of(st.none(), st.integers(8, 16)),
        util=st.sampled_from([1.0, 0.75]),
        host2=st.integers(3, 10),
        disk2=st.one_of(st.none(), st.integers(4, 12)),
    )
    def setup(self, host: int, disk: int | None, util: float, host2: int, disk2: int | None) -> None:
        self.mgr = CacheManager(make_config(host, disk, util, shared=True))
        self.mgr2 = CacheManager(make_config(host2, disk2, 1.0))
        for m in (self.mgr, self.mgr2):
            assert m.top_pool.num_slots == (host if m is self.mgr else host2)
            self.mirror[id(m)] = {}
            self.expected[id(m)] = ExpectedStats(len(m.pools))

    def managers(self) -> tuple[CacheManager, CacheManager]:
        assert self.mgr is not None and self.mgr2 is not None
        return self.mgr, self.mgr2

    # ---- requests ------------------------------------------------------------------------------
    def _create(
        self, tokens: tuple[int, ...], scope: ReuseScope, priority: int, request_id: int | None = None
    ) -> KvCache:
        mgr, _ = self.managers()
        probed = mgr.probe(tokens, scope)
        cache = mgr.create(list(tokens), scope=scope, priority=priority, request_id=request_id)
        self.open[cache.cache_id] = cache
        # The lookup accounting, folded into the manager at the first commit or at close.
        hits = [probed.tiers.count(kind) for kind in mgr.tier_kinds]
        lookup = cache.pending_stats
        assert lookup is not None
        assert lookup.hit_blocks == tuple(hits)
        assert lookup.hit_tokens == tuple(h * TPB for h in hits)
        assert lookup.miss_blocks == len(tokens) // TPB - probed.num_blocks
        assert lookup.miss_tokens == len(tokens) - probed.num_tokens
        self.unfolded[cache.cache_id] = (cache, lookup)
        # Reuse: a fresh request holds exactly the prefix probe() reported just before.
        assert cache.num_reused_tokens == probed.num_tokens
        assert cache.num_tokens == cache.num_reused_tokens
        assert cache.num_blocks == probed.num_blocks
        assert cache.num_committed_blocks == probed.num_blocks
        assert tuple(int(t) for t in cache.tokens) == tokens[: cache.num_reused_tokens]
        assert cache.status is Status.SUSPENDED
        assert mgr.num_open_requests == len(self.open)
        return cache

    def _closed(self, cache: KvCache, call: Any) -> bool:
        """For a cache closed by close_all (still in the bundle): ``call`` must raise StateError
        and change nothing. Returns True when the cache was closed."""
        if cache.status is not Status.CLOSED:
            return False
        mgr, _ = self.managers()
        before = snapshot(mgr)
        with pytest.raises(StateError):
            call()
        assert snapshot(mgr) == before
        return True

    def _resume(self, cache: KvCache) -> bool:
        mgr, _ = self.managers()
        was_active = cache.is_active
        before = snapshot(mgr)
        ok = cache.resume()
        if was_active:
            assert ok
            assert snapshot(mgr) == before
        elif not ok:
            assert cache.status is Status.SUSPENDED
            assert snapshot(mgr) == before, "resume() returned False but changed the manager"
            pages = cache.pages()
            newly = sum(1 for p in pages if p.pins == 0)
            if (mgr.store.pinned_top + newly) / mgr.top_pool.num_slots <= mgr.config.max_util_for_resume:
                lower = sum(1 for p in pages if p.level != 0)
                room = achievable_room(mgr, {p.uid for p in pages})
                assert room < lower, f"resume() refused: {lower} page(s) to promote, room for {room}"
        else:
            assert cache.is_active
            assert all(p.level == 0 and p.pins >= 1 for p in cache.pages())
            assert mgr.top_utilization() <= mgr.config.max_util_for_resume + 1e-9
        return ok

    def _extend(self, cache: KvCache, new: list[int]) -> bool:
        """Extend an active cache and write the new KV. False (nothing changed) when out of pages."""
        mgr, _ = self.managers()
        old_len = cache.num_tokens
        old_tokens = tuple(int(t) for t in cache.tokens)
        before = snapshot(mgr)
        try:
            cache.extend(new)
        except OutOfPagesError:
            assert snapshot(mgr) == before, "extend() raised OutOfPagesError but changed the manager"
            assert cache.num_tokens == old_len
            need = -(-(old_len + len(new)) // TPB) - cache.num_blocks
            room = achievable_room(mgr, set())
            assert room < need, f"extend() raised OutOfPagesError: {need} page(s) needed, room for {room}"
            return False
        assert cache.num_tokens == old_len + len(new)
        assert tuple(int(t) for t in cache.tokens) == old_tokens + tuple(new)
        assert cache.num_blocks == -(-cache.num_tokens // TPB)
        assert all(p.level == 0 and p.pins >= 1 for p in cache.pages())
        # The engine writes KV for the new tokens; the previously partial last block's content
        # (and so its private key) changed, so it is rewritten too.
        ORACLE.fill_cache(cache, old_len // TPB)
        return True

    def _commit(self, cache: KvCache, num_tokens: int | None) -> None:
        mgr, _ = self.managers()
        upto = cache.num_tokens if num_tokens is None else num_tokens
        last = upto // TPB
        start = cache.num_committed_blocks
        tokens = tuple(int(t) for t in cache.tokens)
        self._mirror_events(mgr)
        in_tree_before = {c.key for c in mgr.committed_blocks()}
        got = cache.commit(num_tokens)
        assert got == max(0, last - start)
        assert cache.pending_stats is None
        self.expected[id(mgr)].committed += got
        # Every block this commit put in the tree is announced, tagged with this request's id.
        stored = [ev for ev in self._mirror_events(mgr) if isinstance(ev, BlockStored)]
        new_keys = {c.key for c in mgr.committed_blocks()} - in_tree_before
        assert {ev.key for ev in stored} == new_keys
        assert all(ev.request_id == cache.request_id and ev.num_tokens == TPB for ev in stored)
        assert cache.num_committed_blocks == max(start, last)
        record_keys(self.model, cache.scope, tokens[: last * TPB])
        if last > start:
            # The committed chain is complete and matchable right after the commit.
            assert mgr.probe(tokens[: last * TPB], cache.scope).num_blocks == last
            keys = block_keys(tokens[: last * TPB], TPB, cache.scope)
            for i in range(start, last):
                page = cache.pages()[i]
                assert page.block is None or page.block.key == keys[i]

    def _close(self, cache: KvCache) -> None:
        mgr, _ = self.managers()
        cache.close()
        assert cache.status is Status.CLOSED
        cache.close()  # idempotent
        del self.open[cache.cache_id]
        assert mgr.num_open_requests == len(self.open)

    @rule(
        target=caches,
        tokens=prompts(),
        scope=st.sampled_from(SCOPES),
        priority=st.sampled_from([0, 35, 60, 100]),
        request_id=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    )
    def create(
        self, tokens: tuple[int, ...], scope: ReuseScope, priority: int, request_id: int | None
    ) -> KvCache:
        return self._create(tokens, scope, priority, request_id)

    @rule(
        target=caches,
        tokens=prompts(),
        scope=st.sampled_from(SCOPES),
        priority=st.sampled_from([0, 35, 60, 100]),
        end=st.sampled_from(["close", "close", "suspend", "active"]),
        request_id=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    )
    def turn(
        self, tokens: tuple[int, ...], scope: ReuseScope, priority: int, end: str, request_id: int | None
    ) -> Any:
        """A whole request, as an engine runs it: reuse, prefill the rest, commit."""
        cache = self._create(tokens, scope, priority, request_id)
        if self._resume(cache) and self._extend(cache, list(tokens[cache.num_reused_tokens :])):
            self._commit(cache, None)
        if end == "close":
            self._close(cache)
            return multiple()
        if end == "suspend":
            cache.suspend()
        return cache

    @rule(
        target=caches,
        tokens=prompts(),
        scope=st.sampled_from(SCOPES),
        priority=st.sampled_from([0, 35, 100]),
    )
    def twin(self, tokens: tuple[int, ...], scope: ReuseScope, priority: int) -> Any:
        """Two requests prefill the same tokens; the second commits first, so the first one's
        blocks stay private twins of the tree's (its later commits re-insert them once the
        tree's twins are evicted)."""
        first = self._create(tokens, scope, priority, 1)
        if not (self._resume(first) and self._extend(first, list(tokens[first.num_reused_tokens :]))):
            return first
        second = self._create(tokens, scope, 0, 2)
        if self._resume(second) and self._extend(second, list(tokens[second.num_reused_tokens :])):
            self._commit(second, None)
        self._close(second)
        self._commit(first, None)
        return first

    @rule(cache=caches)
    def resume(self, cache: KvCache) -> None:
        if not self._closed(cache, cache.resume):
            self._resume(cache)

    @rule(cache=caches, data=st.data())
    def extend(self, cache: KvCache, data: st.DataObject) -> None:
        mgr, _ = self.managers()
        old_len = cache.num_tokens
        old_tokens = tuple(int(t) for t in cache.tokens)
        continuing = [b for b in BASES if b[:old_len] == old_tokens and len(b) > old_len]
        n = data.draw(st.integers(1, 10), label="n")
        if continuing and data.draw(st.booleans(), label="continue_base"):
            base = data.draw(st.sampled_from(continuing), label="base")
            new = list(base[old_len : old_len + n])
        else:
            new = data.draw(st.lists(SMALL_TOKEN, min_size=n, max_size=n), label="tokens")
        if not cache.is_active:
            # Mostly resume first (as an engine would); sometimes check the not-active contract.
            if cache.status is Status.CLOSED or data.draw(st.integers(0, 3), label="no_resume") == 0:
                before = snapshot(mgr)
                with pytest.raises(StateError):
                    cache.extend(new)
                assert snapshot(mgr) == before
                assert cache.num_tokens == old_len
                return
            if not self._resume(cache):
                return
        if self._extend(cache, new) and data.draw(st.booleans(), label="then_commit"):
            self._commit(cache, None)

    @rule(cache=caches, data=st.data())
    def commit(self, cache: KvCache, data: st.DataObject) -> None:
        if self._closed(cache, cache.commit):
            return
        num_tokens = data.draw(st.one_of(st.none(), st.integers(0, cache.num_tokens)), label="num_tokens")
        self._commit(cache, num_tokens)

    @rule(cache=caches)
    def suspend(self, cache: KvCache) -> None:
        if self._closed(cache, cache.suspend):
            return
        cache.suspend()
        assert cache.status is Status.SUSPENDED

    @rule(cache=consumes(caches))
    def close(self, cache: KvCache) -> None:
        mgr, _ = self.managers()
        if cache.status is Status.CLOSED:  # closed by close_all
            before = snapshot(mgr)
            cache.close()
            assert snapshot(mgr) == before, "close() of a closed cache changed the manager"
            return
        self._close(cache)

    # ---- block exchange ------------------------------------------------------------------------
    def _exchange(self, src: CacheManager, dst: CacheManager, data: st.DataObject) -> None:
        committed = src.committed_blocks()
        mode = data.draw(st.sampled_from(["frontier", "subset", "with_ancestors", "reversed"]), label="mode")
        if mode == "frontier":
            # What a peer syncing from us lacks next: blocks whose parent it already has.
            have = {c.key for c in dst.committed_blocks()}
            frontier = [
                c.key
                for c in committed
                if c.key not in have and (c.parent_key in have or c.parent_key in ROOT_KEYS)
            ]
            keys = []
            if frontier:
                keys = data.draw(st.lists(st.sampled_from(frontier), unique=True), label="keys")
        else:
            chosen = set()
            if committed:
                indices = st.integers(0, len(committed) - 1)
                chosen = data.draw(st.sets(indices, min_size=1, max_size=12), label="subset")
            keys = [committed[i].key for i in sorted(chosen)]
            if mode != "subset":
                parent = {c.key: c.parent_key for c in committed}
                closed: set[bytes] = set()
                for key in keys:
                    k: bytes | None = key
                    while k is not None and k in parent and k not in closed:
                        closed.add(k)
                        k = parent[k]
                keys = [c.key for c in committed if c.key in closed]
            if mode == "reversed":
                keys.reverse()

        src_before = snapshot(src)
        exported = src.export_blocks(keys)
        self.expected[id(src)].exported += len(exported)
        src_after = snapshot(src)
        # Export reads pages wherever they are: nothing but the export counter changes.
        assert src_after[0] == src_before[0] and src_after[2:] == src_before[2:]
        assert (src_after[1] - src_before[1]).exported_blocks == len(keys)
        assert [b.key for b in exported] == keys
        for rec in exported:
            assert ORACLE.check(rec.data, rec.key), "exported block holds the wrong bytes"
            assert rec.num_tokens == TPB
            assert rec.parent_is_root == (rec.parent_key in ROOT_KEYS)

        # Now and then one record is damaged in transit: its bytes no longer match its checksum.
        tampered = -1
        if exported and data.draw(st.integers(0, 9), label="tamper") >= 8:
            tampered = data.draw(st.integers(0, len(exported) - 1), label="tampered_record")
            rec = exported[tampered]
            bad = bytearray(rec.data)
            bad[data.draw(st.integers(0, PAGE - 1), label="byte")] ^= 0xFF
            exported[tampered] = ExportedBlock(
                rec.key, rec.parent_key, rec.parent_is_root, rec.num_tokens, rec.checksum, bytes(bad)
            )

        # The first bad record (validated in order) decides the error; nothing changes on any.
        present = {c.key for c in dst.committed_blocks()}
        seen: set[bytes] = set()
        error: type[Exception] | None = None
        for i, rec in enumerate(exported):
            if i == tampered:
                error = IntegrityError
                break
            if not (rec.parent_is_root or rec.parent_key in present or rec.parent_key in seen):
                error = ImportRejectedError
                break
            seen.add(rec.key)
        before = snapshot(dst)
        if error is not None:
            with pytest.raises(ImportRejectedError) as info:
                dst.import_blocks(exported)
            assert (error is IntegrityError) == isinstance(info.value, IntegrityError), info.value
            assert snapshot(dst) == before, "rejected import changed the manager"
            return
        priority = data.draw(st.sampled_from([0, 35, 100]), label="priority")
        try:
            result = dst.import_blocks(exported, priority=priority)
        except OutOfPagesError:
            assert snapshot(dst) == before, "import raising OutOfPagesError changed the manager"
            new = [r for r in exported if r.key not in present]
            parents = [dst.tree.get(r.parent_key) for r in new]
            room = achievable_room(dst, {b.page.uid for b in parents if b is not None})
            assert room < len(new), f"import raised OutOfPagesError: {len(new)} new, room for {room}"
            return
        self.expected[id(dst)].imported += len(result.imported)
        assert result.imported == tuple(k for k in keys if k not in present)
        stored = [ev for ev in self._mirror_events(dst) if isinstance(ev, BlockStored)]
        assert [ev.key for ev in stored] == list(result.imported)
        assert all(ev.request_id is None for ev in stored)
        assert result.already_present == tuple(k for k in keys if k in present)
        now = {c.key: c for c in dst.committed_blocks()}
        for key in result.imported:
            assert key in now, "imported block missing right after import"
            assert now[key].tier is dst.tier_kinds[0], "imported block not on the top tier"

    @rule(data=st.data())
    def export_to_peer(self, data: st.DataObject) -> None:
        mgr, mgr2 = self.managers()
        self._exchange(mgr, mgr2, data)

    @rule(data=st.data())
    def import_from_peer(self, data: st.DataObject) -> None:
        mgr, mgr2 = self.managers()
        self._exchange(mgr2, mgr, data)

    @rule(tokens=prompts(), scope=st.sampled_from(SCOPES), which=st.booleans())
    def cool(self, tokens: tuple[int, ...], scope: ReuseScope, which: bool) -> None:
        """Cooling reorders eviction only: the committed blocks and their tiers stay as they are."""
        mgr = self.managers()[0 if which else 1]
        before = {c.key: c.tier for c in mgr.committed_blocks()}
        keys = block_keys(tokens, TPB, scope)
        movable = [k for k in keys if k in before and mgr.tree.blocks[k].page.queued]  # not pinned
        assert mgr.cool_blocks(keys) == len(movable)
        assert {c.key: c.tier for c in mgr.committed_blocks()} == before

    # ---- observation and global operations ----------------------------------------------------
    @rule(tokens=prompts(), scope=st.sampled_from(SCOPES), which=st.booleans())
    def probe(self, tokens: tuple[int, ...], scope: ReuseScope, which: bool) -> None:
        mgr = self.managers()[0 if which else 1]
        before = snapshot(mgr)
        by_tokens = mgr.probe(tokens, scope)
        keys = block_keys(tokens, TPB, scope)
        by_keys = mgr.probe(keys=keys)
        assert by_tokens == by_keys
        assert by_tokens.num_tokens == by_tokens.num_blocks * TPB
        assert len(by_tokens.tiers) == by_tokens.num_blocks
        committed = {c.key: c.tier for c in mgr.committed_blocks()}
        n = by_tokens.num_blocks
        assert all(committed.get(k) is t for k, t in zip(keys[:n], by_tokens.tiers))
        if n < len(keys):
            assert keys[n] not in committed
        assert snapshot(mgr) == before, "probe() changed the manager"

    @rule(which=st.integers(0, 9))
    def clear_reusable(self, which: int) -> None:
        # Clearing wipes the tree, so mostly only the refusal (requests open) is exercised.
        mgr = self.managers()[1 if which == 9 else 0]
        if which < 8 and not mgr.num_open_requests:
            return
        before = snapshot(mgr)
        if mgr.num_open_requests:
            with pytest.raises(ResourceBusyError):
                mgr.clear_reusable()
            assert snapshot(mgr) == before
            return
        n = mgr.clear_reusable()
        assert n == len(before[0])
        assert mgr.committed_blocks() == []
        assert all(p.num_used == 0 for p in mgr.pools)

    @precondition(lambda self: len(self.open) >= 3)
    @rule()
    def close_all(self) -> None:
        """Drop every request at once (so clear_reusable can succeed); the closed caches stay in
        the bundle, where the lifecycle rules check the closed-cache contract."""
        mgr, _ = self.managers()
        for cache in list(self.open.values()):
            cache.close()
        self.open.clear()
        assert mgr.num_open_requests == 0
        assert sum(p.num_used for p in mgr.pools) == len(mgr.committed_blocks()), "pages leaked"

    # ---- invariants ----------------------------------------------------------------------------
    def _mirror_events(self, mgr: CacheManager) -> list[Any]:
        """Apply the queued events to a mirror of the committed set; it must equal the tree."""
        mirror = self.mirror[id(mgr)]
        events = mgr.drain_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.key not in mirror, "BlockStored for a block already stored"
                mirror[ev.key] = (ev.parent_key, ev.tier)
            elif isinstance(ev, BlockRemoved):
                assert ev.key in mirror, "BlockRemoved for an unknown block"
                assert mirror.pop(ev.key)[1] is ev.tier, "BlockRemoved from the wrong tier"
                self.expected[id(mgr)].removed_events += 1
            elif isinstance(ev, BlockTierChanged):
                assert ev.key in mirror, "BlockTierChanged for an unknown block"
                parent, tier = mirror[ev.key]
                assert tier is ev.old_tier, "BlockTierChanged from the wrong tier"
                mirror[ev.key] = (parent, ev.new_tier)
            elif isinstance(ev, AllCleared):
                mirror.clear()
        tree = {c.key: (c.parent_key, c.tier) for c in mgr.committed_blocks()}
        assert mirror == tree, "events disagree with the committed blocks"
        return events

    @invariant()
    def consistent(self) -> None:
        if self.mgr is None:
            return
        for cid, (cache, lookup) in list(self.unfolded.items()):
            if cache.pending_stats is None:
                self.expected[id(self.mgr)].fold(lookup)
                del self.unfolded[cid]
        for mgr in self.managers():
            mgr.check_invariants()
            self.expected[id(mgr)].exported += ORACLE.verify_manager(mgr)
            self._mirror_events(mgr)
            self.expected[id(mgr)].check(mgr.stats())
            check_matchable(mgr, self.model)
        mgr = self.mgr
        assert mgr.num_open_requests == len(self.open)
        for cache in self.open.values():
            if cache.is_active:
                assert all(p.level == 0 for p in cache.pages()), "active page below the top tier"
                ORACLE.verify_cache(cache)
                assert len(cache.page_ids()) == cache.num_blocks
            else:
                # A suspended request's pages (maybe demoted) still hold what was written.
                for i, page in enumerate(cache.pages()):
                    data = mgr.copy.read(page.level, [page.slot])[0]
                    key, n = cache.block_key(i), cache.block_num_tokens(i)
                    assert ORACLE.check(data, key, n), f"{cache!r}: suspended block {i} corrupted"

    def teardown(self) -> None:
        try:
            for cache in list(self.open.values()):
                with contextlib.suppress(Exception):
                    cache.close()
            self.open.clear()
            if self.mgr is not None:
                self.mgr.check_invariants()
                assert sum(p.num_used for p in self.mgr.pools) == len(self.mgr.committed_blocks())
        finally:
            for m in (self.mgr, self.mgr2):
                if m is not None:
                    with contextlib.suppress(Exception):
                        m.shutdown()


TestCacheManagerStateful = CacheMachine.TestCase
TestCacheManagerStateful.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
)

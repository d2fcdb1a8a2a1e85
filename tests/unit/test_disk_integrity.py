"""Checksummed disk pages: a disk tier file corrupted, truncated, zeroed or deleted under a live
CacheManager never serves a wrong byte. Every affected page is dropped (with its descendants)
and counted in ``integrity_drops``; the rest still verify byte for byte; later requests recompute
and store again; ``check_invariants`` holds after every step."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from import_support import toks

from raykv import CacheConfig, ConfigError, PageCorruptError, TierConfig, TierKind
from raykv.core.tiers import DiskPool

TPB = 4
PROMPTS = [toks(seed, 2 * TPB) for seed in range(1, 13)]  # 12 prompts of two blocks each


def disk_pool(mgr) -> DiskPool:
    pool = mgr.pools[-1]
    assert isinstance(pool, DiskPool)
    return pool


def disk_keys(mgr) -> list[bytes]:
    return [b.key for b in mgr.committed_blocks() if b.tier is TierKind.DISK]


def flip_byte(mgr, key: bytes, offset: int = 100) -> None:
    pool = disk_pool(mgr)
    block = mgr.tree.get(key)
    assert block is not None and block.page.level == len(mgr.pools) - 1
    with open(pool.path, "r+b") as f:
        f.seek(int(block.page.slot) * pool.stride + offset)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0xFF]))


def filled(make_manager, run_request, prompts=PROMPTS):
    """A manager with 4 host and 40 disk pages after running ``prompts`` (most end on disk)."""
    mgr = make_manager(4, 40)
    for tokens in prompts:
        run_request(mgr, tokens)
    assert len(disk_keys(mgr)) >= 16
    return mgr


def subtree(mgr, key: bytes) -> set[bytes]:
    out, stack = set(), [mgr.tree.get(key)]
    while stack:
        block = stack.pop()
        out.add(block.key)
        stack.extend(block.children.values())
    return out


def rerun_all(mgr, run_request, oracle) -> None:
    """Every prompt again (recomputing what was dropped), then every cached block verifies."""
    for tokens in PROMPTS:
        run_request(mgr, tokens)
    assert oracle.verify_manager(mgr) == len(mgr.committed_blocks())
    mgr.check_invariants()


def test_one_flipped_byte_drops_that_block_and_its_descendants(make_manager, run_request, oracle):
    mgr = filled(make_manager, run_request)
    victim = disk_keys(mgr)[0]
    gone = subtree(mgr, victim)
    before = {b.key for b in mgr.committed_blocks()}
    flip_byte(mgr, victim)
    assert oracle.verify_manager(mgr) == len(before) - len(gone)  # every other page byte for byte
    mgr.check_invariants()
    assert {b.key for b in mgr.committed_blocks()} == before - gone
    assert mgr.stats().integrity_drops == 1
    rerun_all(mgr, run_request, oracle)
    assert mgr.stats().integrity_drops == 1


def test_resume_cuts_the_request_before_a_bad_page(make_manager, run_request, oracle):
    mgr = filled(make_manager, run_request)
    tokens = PROMPTS[2]
    assert mgr.probe(tokens).tiers == (TierKind.DISK, TierKind.DISK)
    cache = mgr.create(tokens)
    other = mgr.create(tokens)  # a second suspended holder of the same pages
    assert cache.num_reused_tokens == 2 * TPB
    flip_byte(mgr, cache.committed_keys()[1])
    mgr.check_invariants()
    assert cache.resume()
    mgr.check_invariants()
    assert cache.num_reused_tokens == TPB and cache.num_tokens == TPB and cache.num_blocks == 1
    oracle.verify_cache(cache)
    assert mgr.stats().integrity_drops == 1
    cache.extend(tokens[TPB:])
    oracle.fill_cache(cache, 1)
    assert cache.commit() == 1
    cache.close()
    mgr.check_invariants()
    assert other.resume()  # the block was recommitted meanwhile, but other's page is the bad one
    assert other.num_reused_tokens == TPB
    oracle.verify_cache(other)
    other.close()
    mgr.check_invariants()
    assert mgr.stats().integrity_drops == 1
    rerun_all(mgr, run_request, oracle)


def test_lookup_stats_count_the_cut_blocks_as_misses(make_manager, run_request):
    mgr = filled(make_manager, run_request)
    tokens = PROMPTS[1]
    before = mgr.stats()
    with mgr.create(tokens) as cache:
        flip_byte(mgr, cache.committed_keys()[0])
        assert cache.resume() and cache.num_reused_tokens == 0
    delta = mgr.stats() - before
    assert sum(delta.hit_blocks) == 0 and delta.miss_blocks == 2
    assert delta.integrity_drops == 1
    mgr.check_invariants()


@pytest.mark.parametrize("damage", ["truncate", "zeros", "truncate_half"])
def test_whole_file_damage_drops_every_disk_page(make_manager, run_request, oracle, damage):
    mgr = filled(make_manager, run_request)
    pool = disk_pool(mgr)
    on_disk = disk_keys(mgr)
    size = os.path.getsize(pool.path)
    if damage == "zeros":
        with open(pool.path, "r+b") as f:
            f.write(bytes(size))
        bad = set(on_disk)
    elif damage == "truncate":
        os.truncate(pool.path, 0)
        bad = set(on_disk)
    else:
        slots = sorted(int(mgr.tree.get(k).page.slot) for k in on_disk)
        limit = slots[len(slots) // 2]
        os.truncate(pool.path, limit * pool.stride + 7)  # that page and those after come back short
        bad = {k for k in on_disk if int(mgr.tree.get(k).page.slot) >= limit}
    gone = set().union(*(subtree(mgr, k) for k in bad))
    before = {b.key for b in mgr.committed_blocks()}
    assert oracle.verify_manager(mgr) == len(before - gone)
    mgr.check_invariants()
    assert mgr.stats().integrity_drops == len(bad) > 0
    assert not set(disk_keys(mgr)) & bad
    rerun_all(mgr, run_request, oracle)


def test_deleted_file_still_serves_its_own_pages(make_manager, run_request, oracle):
    """An unlinked file stays readable through the tier's descriptor: nothing is wrong."""
    mgr = filled(make_manager, run_request)
    os.unlink(disk_pool(mgr).path)
    count = len(mgr.committed_blocks())
    assert oracle.verify_manager(mgr) == count
    assert mgr.stats().integrity_drops == 0
    rerun_all(mgr, run_request, oracle)


def test_a_leased_bad_page_raises_and_goes_once_released(make_manager, run_request, oracle):
    mgr = filled(make_manager, run_request)
    key = disk_keys(mgr)[0]
    lease = mgr.lease_blocks([key])
    flip_byte(mgr, key)
    with pytest.raises(PageCorruptError) as info:
        mgr.leased_page(lease.blocks[0])
    assert info.value.positions == (0,)
    with pytest.raises(PageCorruptError):
        mgr.copy.read(lease.blocks[0].level, [lease.blocks[0].slot])
    mgr.check_invariants()
    assert key not in {b.key for b in mgr.export_blocks([key])}  # dropped, though still leased
    mgr.check_invariants()
    used = disk_pool(mgr).num_used
    mgr.release_lease(lease.lease_id)  # the orphaned page is freed now
    mgr.check_invariants()
    assert disk_pool(mgr).num_used == used - 1
    assert mgr.stats().integrity_drops == 1
    rerun_all(mgr, run_request, oracle)


def test_a_leased_descendant_of_a_bad_page_is_freed_at_release(make_manager, run_request, oracle):
    mgr = filled(make_manager, run_request)
    keys = mgr.create(PROMPTS[3]).committed_keys()
    lease = mgr.lease_blocks([keys[1]])
    flip_byte(mgr, keys[0])
    assert mgr.export_blocks(keys) == []
    mgr.check_invariants()
    assert oracle.check(mgr.leased_page(lease.blocks[0]), keys[1])  # still its own bytes
    mgr.release_lease(lease.lease_id)
    mgr.check_invariants()
    rerun_all(mgr, run_request, oracle)


def test_checksums_can_be_turned_off_and_the_switch_is_validated(make_manager, run_request, layout):
    mgr = make_manager(2, 8, verify_disk_checksums=False)
    for tokens in PROMPTS[:3]:
        run_request(mgr, tokens)
    pool = disk_pool(mgr)
    assert not pool.verify and pool.failed(list(range(pool.num_slots))) == []
    with pytest.raises(ConfigError):
        CacheConfig(layout, (TierConfig.host(4 * layout.page_bytes),), verify_disk_checksums=1)  # type: ignore[arg-type]


def test_disk_pool_marks_bad_pages_until_their_slot_is_released(layout):
    pool = DiskPool(TierConfig.disk(8 * layout.page_bytes), layout)
    try:
        slots = pool.allocate(4)
        data = np.random.default_rng(0).integers(0, 256, (4, layout.page_bytes), dtype=np.uint8)
        pool.write_pages(slots, data)
        out = np.empty_like(data)
        pool.read_pages(slots, out)
        assert np.array_equal(out, data) and pool.failed(slots) == []
        with open(pool.path, "r+b") as f:
            f.seek(slots[2] * pool.stride)
            f.write(b"\0" * 8)
        pool.read_pages(slots, out)
        assert pool.failed(slots) == [2]
        pool.write_pages(slots[2:3], data[2:3])  # rewritten (a new page): good again
        assert pool.failed(slots) == []
        pool.release(slots)
        assert pool.failed(slots) == [0, 1, 2, 3]  # freed slots hold no page
    finally:
        pool.close()


# ---- random mixes ----------------------------------------------------------------------------------
SHARED = toks(90, 2 * TPB)
MIXED = [SHARED + toks(seed, TPB * (seed % 3) + 2) for seed in range(1, 9)] + PROMPTS[:6]


@pytest.mark.parametrize("seed", range(6))
def test_random_corruptions_never_serve_a_wrong_byte(make_manager, run_request, oracle, seed):
    """Requests (some left suspended while their pages sink to disk), byte flips in random disk
    pages, exports: every byte a request or an export gets is the oracle's."""
    rng = random.Random(seed)
    mgr = make_manager(6, 24)
    suspended = []
    flips = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.45:
            run_request(mgr, rng.choice(MIXED))
        elif op < 0.65 and disk_keys(mgr):
            flip_byte(mgr, rng.choice(disk_keys(mgr)), offset=rng.randrange(mgr.layout.page_bytes))
            flips += 1
        elif op < 0.8 and len(suspended) < 2:
            cache = run_request(mgr, rng.choice(MIXED), close=False)
            cache.extend([7, 7])  # a partial private block too
            oracle.fill_cache(cache, cache.num_blocks - 1)
            cache.suspend()
            suspended.append(cache)
        elif op < 0.9 and suspended:
            cache = suspended.pop(rng.randrange(len(suspended)))
            assert cache.resume()
            oracle.verify_cache(cache)
            cache.close()
        else:
            oracle.verify_manager(mgr)
        mgr.check_invariants()
    for cache in suspended:
        assert cache.resume()
        oracle.verify_cache(cache)
        cache.close()
    oracle.verify_manager(mgr)
    mgr.check_invariants()
    assert 0 < mgr.stats().integrity_drops <= flips  # a flipped page may be evicted unread

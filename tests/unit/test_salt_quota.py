"""Per-salt block quotas (``CacheConfig.max_blocks_per_salt``): a tenant over its quota drops its
own least valuable blocks, never another tenant's; with none of its own droppable its new blocks
are refused (left private to the request); the quota holds after every operation."""

from __future__ import annotations

import random

import pytest

from raykv import ReuseScope, block_keys
from raykv.core.config import CacheConfig
from raykv.core.errors import ConfigError

TPB = 4
N = 4
A, B, C = ReuseScope(salt=1), ReuseScope(salt=2), ReuseScope(lora_id=7, salt=3)


def prompt(tenant: int, i: int, blocks: int = 2) -> list[int]:
    """A prompt of ``blocks`` full blocks, distinct for each (tenant, i)."""
    return [tenant * 100_000 + i * 100 + j for j in range(blocks * TPB)]


def held(mgr, scope: ReuseScope) -> int:
    return mgr.store.quota.count(scope.salt)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_config_rejects_bad_quota(make_manager, bad) -> None:
    mgr = make_manager(4)
    with pytest.raises(ConfigError, match="max_blocks_per_salt"):
        CacheConfig(mgr.config.layout, mgr.config.tiers, max_blocks_per_salt=bad)


def test_tenant_over_quota_evicts_only_its_own(make_manager, oracle, run_request) -> None:
    mgr = make_manager(16, max_blocks_per_salt=N)
    b_prompt = prompt(2, 0, blocks=N)
    run_request(mgr, b_prompt, scope=B)
    for i in range(20):  # A commits 40 blocks against a quota of 4
        run_request(mgr, prompt(1, i), scope=A)
        assert held(mgr, A) <= N
        assert mgr.probe(b_prompt, scope=B).num_blocks == N
    assert held(mgr, A) == N and held(mgr, B) == N
    stats = mgr.stats()
    assert stats.quota_evictions == 20 * 2 - N
    assert sum(stats.evictions) == stats.quota_evictions
    assert stats.quota_refused == 0
    assert oracle.verify_manager(mgr) == 2 * N
    assert mgr.probe(prompt(1, 19), scope=A).num_blocks == 2  # the newest of A's stay


def test_quota_counts_all_tiers_and_drops_coldest_first(make_manager, run_request) -> None:
    mgr = make_manager(4, 8, max_blocks_per_salt=N)
    for i in range(6):
        run_request(mgr, prompt(1, i), scope=A)
        assert held(mgr, A) <= N
    # the oldest went first: the last two requests' blocks stay
    assert mgr.probe(prompt(1, 5), scope=A).num_blocks == 2
    assert mgr.probe(prompt(1, 4), scope=A).num_blocks == 2
    assert mgr.probe(prompt(1, 0), scope=A).num_blocks == 0
    mgr.check_invariants()


def test_full_quota_with_nothing_droppable_refuses_new_blocks(make_manager, oracle, run_request) -> None:
    mgr = make_manager(16, max_blocks_per_salt=N)
    b_prompt = prompt(2, 0, blocks=3)
    run_request(mgr, b_prompt, scope=B)
    first = run_request(mgr, prompt(1, 0, blocks=N), scope=A, close=False)  # holds all of A's
    cache = mgr.create(prompt(1, 1, blocks=2), scope=A)
    assert cache.resume()
    cache.extend(prompt(1, 1, blocks=2))
    oracle.fill_cache(cache)
    assert cache.commit() == 0  # refused: A is at its quota and holds every block of its own
    mgr.check_invariants()
    assert mgr.stats().quota_refused == 2 and mgr.stats().quota_evictions == 0
    assert mgr.probe(prompt(1, 1, blocks=2), scope=A).num_blocks == 0
    assert mgr.probe(b_prompt, scope=B).num_blocks == 3
    oracle.verify_cache(cache)  # the refused blocks stay the request's private pages
    first.close()
    cache.extend([9] * TPB)  # a later commit offers the refused blocks again
    oracle.fill_cache(cache, 2)
    assert cache.commit() == 1
    mgr.check_invariants()
    assert mgr.probe(prompt(1, 1, blocks=2), scope=A).num_blocks == 2
    assert held(mgr, A) == N and mgr.probe(b_prompt, scope=B).num_blocks == 3
    cache.close()
    assert oracle.verify_manager(mgr) == N + 3


def test_unsalted_blocks_are_one_group(make_manager, run_request) -> None:
    mgr = make_manager(16, max_blocks_per_salt=N)
    run_request(mgr, prompt(2, 0, blocks=N), scope=B)
    for i in range(5):
        run_request(mgr, prompt(0, i))
        assert mgr.store.quota.count(None) <= N
    assert held(mgr, B) == N


def test_imported_blocks_count_in_their_scope(make_manager, oracle, run_request) -> None:
    src = make_manager(16)
    for i in range(4):
        run_request(src, prompt(1, i), scope=A)
    exported = src.export_blocks([b.key for b in src.committed_blocks()])
    dst = make_manager(16, max_blocks_per_salt=N)
    run_request(dst, prompt(1, 9), scope=A)  # dst learns A's scope
    run_request(dst, prompt(2, 0, blocks=N), scope=B)
    dst.import_blocks(exported)
    dst.check_invariants()
    assert held(dst, A) == N and held(dst, B) == N
    assert oracle.verify_manager(dst) == 2 * N


@pytest.mark.parametrize("blocks", [1, 2], ids=["one block", "a chain"])
def test_an_import_over_quota_reports_its_blocks_refused(make_manager, oracle, run_request, blocks) -> None:
    """Blocks a salt's quota refuses are reported ``refused``, not ``already_present``, and are
    not cached; blocks cached already stay ``already_present``."""
    src = make_manager(16)
    run_request(src, prompt(1, 7, blocks=blocks), scope=A)
    run_request(src, prompt(2, 0), scope=B)
    a_keys = [bytes(k) for k in block_keys(prompt(1, 7, blocks=blocks), TPB, A)]
    b_keys = [bytes(k) for k in block_keys(prompt(2, 0), TPB, B)]
    exported = src.export_blocks([*a_keys, *b_keys])
    dst = make_manager(16, max_blocks_per_salt=N)
    run_request(dst, prompt(2, 0), scope=B)  # B's blocks are here already
    first = run_request(dst, prompt(1, 0, blocks=N), scope=A, close=False)  # holds all of A's quota
    result = dst.import_blocks(exported)
    dst.check_invariants()
    assert result.imported == () and result.refused == tuple(a_keys)
    assert result.already_present == tuple(b_keys)
    assert all(dst.tree.get(k) is None for k in a_keys)
    first.close()
    assert oracle.verify_manager(dst) == N + 2


def test_random_interleaving_keeps_every_tenant_within_quota(make_manager, oracle) -> None:
    rng = random.Random(1234)
    mgr = make_manager(24, 8, max_blocks_per_salt=N)
    scopes = [A, B, C]
    open_caches = []
    for step in range(300):
        op = rng.random()
        if op < 0.5 or not open_caches:
            t = rng.randrange(3)
            base = prompt(t + 1, rng.randrange(12), blocks=rng.randrange(1, 4))
            cache = mgr.create(base, scope=scopes[t])
            if cache.resume():
                cache.extend(base[cache.num_reused_tokens :])
                oracle.fill_cache(cache, cache.num_reused_tokens // TPB)
                oracle.verify_cache(cache)
                cache.commit()
            open_caches.append(cache)
        elif op < 0.75:
            open_caches.pop(rng.randrange(len(open_caches))).close()
        else:
            t = rng.randrange(3)
            mgr.probe(prompt(t + 1, rng.randrange(12)), scope=scopes[t])
        if len(open_caches) > 3:
            open_caches.pop(0).close()
        mgr.check_invariants()
        for scope in scopes:
            assert held(mgr, scope) <= N, f"step {step}"
    for cache in open_caches:
        cache.close()
    mgr.check_invariants()
    assert mgr.stats().quota_evictions > 0
    oracle.verify_manager(mgr)


def test_quota_off_is_unchanged(make_manager, run_request) -> None:
    mgr = make_manager(16)
    assert mgr.store.quota is None
    for i in range(8):
        run_request(mgr, prompt(1, i), scope=A)
    assert len(mgr.committed_blocks()) == 16
    stats = mgr.stats()
    assert stats.quota_evictions == stats.quota_refused == 0 and sum(stats.evictions) == 0

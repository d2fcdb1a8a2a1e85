"""CacheWorker's Prometheus export (actors/cache/metrics.py), in-process with a recording backend: the
series hold what the stats say, per tag, and a second export adds nothing."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from metrics_support import Recorder

from actors.cache.metrics import WorkerMetrics
from actors.testing import TestingCacheWorker
from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig, TransferError
from raykv.transfer import PeerAddress, TransferConfig

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)


@pytest.fixture
def workers(layout: KVLayout) -> Iterator[tuple[TestingCacheWorker, TestingCacheWorker]]:
    token = secrets.token_bytes(32)
    config = CacheConfig(layout, (TierConfig.host(64 * layout.page_bytes, pin_memory=False),))
    made = [TestingCacheWorker(name, i, config, token=token, transfer=CFG) for i, name in enumerate("ab")]
    yield made[0], made[1]
    for worker in made:
        worker.shutdown()


def test_cache_and_transfer_series_follow_the_stats(workers, layout: KVLayout) -> None:
    a, b = workers
    ra, rb = Recorder(), Recorder()
    assert not a.export_metrics()  # not enabled: nothing done
    a.enable_metrics(ra)
    b.enable_metrics(rb)
    prompt = list(range(10 * layout.tokens_per_block))
    a.run_request(prompt)
    a.run_request(prompt)  # every block a hit the second time
    keys = [bytes(blk.key) for blk in a.manager.committed_blocks()]
    address = a.page_server_address()
    assert address is not None
    outcome = b.pull(address, keys, prefer_shm=False)
    assert len(outcome.imported) == 10 and outcome.path == "ucx"
    pull_tags = {"worker": "b", "path": "ucx"}
    assert rb.observed == [("raykv_transfer_pull_seconds", pull_tags, outcome.seconds)]
    with pytest.raises(TransferError):
        b.pull(PeerAddress("127.0.0.1", 1), keys[:1])  # nothing listens there: reason "connect"
    for _ in range(2):  # the second export sends no change
        assert a.export_metrics() and b.export_metrics()
        stats = a.stats()
        for i, kind in enumerate(stats.tiers):
            tier = kind.name.lower()
            assert ra.get("raykv_hit_blocks", worker="a", tier=tier) == stats.hit_blocks[i]
            assert ra.get("raykv_bytes_in_use", worker="a", tier=tier) == stats.bytes_in_use[i]
        assert ra.get("raykv_hit_blocks", worker="a", tier="host") == 10
        assert ra.get("raykv_miss_blocks", worker="a") == stats.miss_blocks > 0
        nbytes = 10 * layout.page_bytes
        assert ra.named("raykv_transfer_served_pulls") == {(("path", "ucx"), ("worker", "a")): 1}
        assert ra.get("raykv_transfer_served_bytes", worker="a", path="ucx") == nbytes
        assert ra.get("raykv_transfer_open_leases", worker="a") == 0
        assert rb.named("raykv_transfer_pulls") == {(("path", "ucx"), ("worker", "b")): 1}
        assert rb.get("raykv_transfer_pulled_bytes", worker="b", path="ucx") == nbytes
        assert rb.named("raykv_transfer_failures") == {(("reason", "connect"), ("worker", "b")): 1}
        assert rb.get("raykv_bytes_in_use", worker="b", tier="host") == nbytes


def test_failure_labels_are_exactly_the_enum_values() -> None:
    from actors.cache.metrics import REASON_LABELS, WorkerMetrics
    from raykv.core.errors import TransferFailure

    assert {r.value for r in TransferFailure} == REASON_LABELS
    rec = Recorder()
    metrics = WorkerMetrics("w", rec)
    failures = {r.value: 1 for r in TransferFailure} | {"unknown": 5, "peer": 2}
    transfer = {"client": {"failures": failures}, "server": {"errors": {"internal": 1, "bogus": 3}}}
    metrics.update_transfer(transfer)
    labels = {dict(tags)["reason"] for tags in rec.named("raykv_transfer_failures")}
    assert labels == REASON_LABELS
    assert {dict(tags)["reason"] for tags in rec.named("raykv_transfer_server_errors")} == {"internal"}


def test_integrity_drops_are_exported(layout: KVLayout) -> None:
    page = layout.page_bytes
    config = CacheConfig(layout, (TierConfig.host(2 * page, pin_memory=False), TierConfig.disk(8 * page)))
    oracle, recorder = ContentOracle(layout), Recorder()
    metrics = WorkerMetrics("w", recorder)
    with CacheManager(config) as mgr:
        for seed in range(3):
            with mgr.create(list(range(seed * 100, seed * 100 + layout.tokens_per_block))) as cache:
                assert cache.resume()
                cache.extend(list(range(seed * 100, seed * 100 + layout.tokens_per_block)))
                oracle.fill_cache(cache)
                cache.commit()
        disk = mgr.pools[1]
        with open(disk.path, "r+b") as f:  # type: ignore[attr-defined]
            f.write(bytes(disk.num_slots * disk.stride))  # type: ignore[attr-defined]
        assert oracle.verify_manager(mgr) == 2  # the two host blocks; the disk one is dropped
        for _ in range(2):
            metrics.update(mgr.stats())
            assert recorder.get("raykv_integrity_drops", worker="w") == 1


def test_quota_counters_are_exported(layout: KVLayout) -> None:
    page = layout.page_bytes
    config = CacheConfig(layout, (TierConfig.host(64 * page, pin_memory=False),), max_blocks_per_salt=2)
    oracle, recorder = ContentOracle(layout), Recorder()
    metrics = WorkerMetrics("w", recorder)
    tpb = layout.tokens_per_block
    with CacheManager(config) as mgr:
        tokens = list(range(1, 5 * tpb + 1))
        with mgr.create(tokens) as cache:  # 5 blocks of one (unsalted) group, quota 2
            assert cache.resume()
            cache.extend(tokens)
            oracle.fill_cache(cache)
            cache.commit()
        stats = mgr.stats()
        assert stats.quota_evictions + stats.quota_refused > 0
        for _ in range(2):  # exported once, as deltas
            metrics.update(mgr.stats())
            got = recorder.get("raykv_quota_evictions", worker="w") + recorder.get(
                "raykv_quota_refused", worker="w"
            )
            assert got == stats.quota_evictions + stats.quota_refused

"""GPU tier on a real CUDA device: pages as torch views, demotion/promotion through host and disk.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

import pytest
from deps import require_cuda

torch = require_cuda()

import raykv  # noqa: E402
from raykv.core.tiers.gpu import GpuPool  # noqa: E402


def _manager(gpu_pages: int, host_pages: int, disk_pages: int) -> raykv.CacheManager:
    layout = raykv.KVLayout.uniform(4, 2, 64, tokens_per_block=16, dtype="bfloat16")
    page = layout.page_bytes
    tiers = (
        raykv.TierConfig.gpu(gpu_pages * page),
        raykv.TierConfig.host(host_pages * page),
        raykv.TierConfig.disk(disk_pages * page),
    )
    return raykv.CacheManager(raykv.CacheConfig(layout, tiers))


def test_gpu_pages_are_device_views_and_round_trip_through_tiers() -> None:
    mgr = _manager(gpu_pages=8, host_pages=8, disk_pages=32)
    oracle = raykv.ContentOracle(mgr.layout)
    assert isinstance(mgr.top_pool, GpuPool)
    assert mgr.pools[1].pinned  # type: ignore[attr-defined]
    prompts = [[1000 * i + t for t in range(64)] for i in range(6)]
    for prompt in prompts:
        kv = mgr.create(prompt)
        assert kv.resume()
        kv.extend(prompt)
        page = kv.page(0)
        assert page.is_cuda and page.dtype == torch.uint8
        k = kv.buffer_view(0, 1, "k")
        assert k.dtype == torch.bfloat16 and tuple(k.shape) == (16, 2, 64)
        oracle.fill_cache(kv)
        kv.commit()
        kv.close()
        mgr.check_invariants()
    stats = mgr.stats()
    assert stats.demotions[0] > 0 and stats.demotions[1] > 0  # GPU -> host -> disk happened
    assert oracle.verify_manager(mgr) == len(mgr.committed_blocks())
    first = prompts[0]
    assert mgr.probe(first).tiers[0] is not raykv.TierKind.GPU
    kv = mgr.create(first)
    assert kv.num_reused_tokens == 64
    assert kv.resume()
    oracle.verify_cache(kv)  # promoted back onto the GPU, bytes intact
    assert all(p.level == 0 for p in kv.pages())
    kv.close()
    mgr.check_invariants()
    mgr.shutdown()


def test_layer_view_indexes_pages_by_page_id() -> None:
    mgr = _manager(gpu_pages=4, host_pages=4, disk_pages=4)
    oracle = raykv.ContentOracle(mgr.layout)
    kv = mgr.create([7] * 32)
    assert kv.resume()
    kv.extend([7] * 32)
    oracle.fill_cache(kv)
    pool = mgr.top_pool
    assert isinstance(pool, GpuPool)
    view = pool.layer_view(2, "v")
    assert tuple(view.shape) == (pool.num_slots, 16, 2, 64)
    for i, page_id in enumerate(kv.page_ids()):
        assert torch.equal(view[page_id], kv.buffer_view(i, 2, "v"))
    kv.close()
    mgr.shutdown()


def test_gpu_tier_larger_than_free_memory_fails_clearly() -> None:
    free, _ = torch.cuda.mem_get_info()
    layout = raykv.KVLayout.uniform(1, 1, 64, tokens_per_block=16)
    config = raykv.CacheConfig(layout, (raykv.TierConfig.gpu(free * 2),))
    with pytest.raises(raykv.OutOfMemoryError, match="GPU tier wants"):
        raykv.CacheManager(config)


def test_commit_orders_later_readers_after_kv_still_queued_on_the_stream() -> None:
    """The engine commits right after queueing its KV writes (no synchronize): a read of those
    pages (a demotion, a peer's gpu_peer copy) must still see the finished KV, not what the pages
    held before the queued writes ran."""
    from raykv.gpu_oracle import DeviceOracle

    mgr = _manager(gpu_pages=4, host_pages=8, disk_pages=8)
    pool = mgr.top_pool
    prompt = list(range(64))
    kv = mgr.create(prompt)
    assert kv.resume()
    kv.extend(prompt)
    slots = list(kv.page_ids())
    keys = [kv.block_key(i) for i in range(kv.num_blocks)]
    DeviceOracle(mgr.layout, pool.device).fill_cache(pool, kv)
    index = torch.as_tensor(slots, dtype=torch.long, device=pool.device)
    correct = pool.tensor.index_select(0, index).clone()  # type: ignore[attr-defined]
    pool.tensor.index_fill_(0, index, 0)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the stream stays busy (~0.1 s) ...
    pool.tensor.index_copy_(0, index, correct)  # type: ignore[attr-defined]  # ... before the KV lands
    kv.commit()
    assert pool.events.pending(slots)  # type: ignore[attr-defined]  # the commit's event
    kv.close()
    pool.events.wait_host(slots)  # type: ignore[attr-defined]  # what the gpu_peer owner does first
    side = torch.cuda.Stream(pool.device)  # a reader not ordered after the engine's stream
    with torch.cuda.stream(side):
        data = pool.tensor.index_select(0, index).cpu().numpy()  # type: ignore[attr-defined]
    host = raykv.ContentOracle(mgr.layout)
    assert len(keys) == 4 and all(host.check(row, key) for row, key in zip(data, keys))
    mgr.check_invariants()
    mgr.shutdown()

"""Asynchronous GPU <-> host <-> disk copies: events, not global synchronization, keep bytes right.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest
from deps import require_cuda

torch = require_cuda()

import raykv  # noqa: E402
from raykv.core.copy import CopyEngine  # noqa: E402
from raykv.core.tiers.copy_plan import runs  # noqa: E402
from raykv.core.tiers.cuda_batch import batch_memcpy  # noqa: E402
from raykv.core.tiers.gpu import GpuPool  # noqa: E402
from raykv.core.tiers.host import HostPool  # noqa: E402
from raykv.core.types import PageId  # noqa: E402
from raykv.gpu_oracle import DeviceOracle  # noqa: E402


def _manager(layout: raykv.KVLayout, gpu: int, host: int, disk: int) -> raykv.CacheManager:
    page = layout.page_bytes
    tiers = [raykv.TierConfig.gpu(gpu * page)]
    if host:
        tiers.append(raykv.TierConfig.host(host * page))
    if disk:
        tiers.append(raykv.TierConfig.disk(disk * page))
    return raykv.CacheManager(raykv.CacheConfig(layout, tuple(tiers)))


def _run_workload(mgr: raykv.CacheManager, prompts: list[list[int]]) -> None:
    """Requests written by the device oracle; every reused prefix verified on the device."""
    pool = mgr.top_pool
    dev = DeviceOracle(mgr.layout, pool.device)  # type: ignore[attr-defined]
    for prompt in prompts:
        kv = mgr.create(prompt)
        assert kv.resume()
        if kv.num_reused_tokens:
            reused = kv.num_reused_tokens // mgr.tokens_per_block
            keys = [kv.block_key(i) for i in range(reused)]
            assert all(dev.check(pool, kv.page_ids()[:reused], keys)), "promoted bytes differ"
        kv.extend(prompt[kv.num_reused_tokens :])
        dev.fill_cache(pool, kv, kv.num_reused_tokens // mgr.tokens_per_block)
        kv.commit()
        kv.close()
        mgr.check_invariants()


@pytest.mark.parametrize("tiers", [(6, 12, 64), (6, 0, 64)], ids=["gpu-host-disk", "gpu-disk"])
def test_async_demotion_and_promotion_under_pressure(tiers: tuple[int, int, int]) -> None:
    layout = raykv.KVLayout.uniform(8, 8, 128, tokens_per_block=16)  # 512 KiB pages
    mgr = _manager(layout, *tiers)
    rng = np.random.default_rng(1)
    base = [[int(t) for t in rng.integers(0, 30000, 64)] for _ in range(8)]
    prompts = base + [p + [int(t) for t in rng.integers(0, 30000, 32)] for p in base] + base[::-1]
    _run_workload(mgr, prompts)
    stats = mgr.stats()
    assert stats.demotions[0] > 0 and sum(stats.promotions) > 0
    host_oracle = raykv.ContentOracle(layout)
    assert host_oracle.verify_manager(mgr) == len(mgr.committed_blocks())  # byte for byte, host side
    mgr.shutdown()


def _pools(layout: raykv.KVLayout, pages: int) -> tuple[GpuPool, HostPool, CopyEngine]:
    gpu = GpuPool(raykv.TierConfig.gpu(pages * layout.page_bytes), layout)
    host = HostPool(raykv.TierConfig.host(pages * layout.page_bytes), layout, pin=True)
    assert host.pinned
    return gpu, host, CopyEngine([gpu, host])


def test_released_slot_is_not_overwritten_before_its_drain_completes() -> None:
    """Demote big pages, release the GPU slots at once, reuse and overwrite them immediately: the
    host must still receive the old bytes (the overwrite waits for the drain's event)."""
    layout = raykv.KVLayout.uniform(64, 8, 128, tokens_per_block=16)  # 4 MiB pages
    gpu, host, engine = _pools(layout, 64)
    dev = DeviceOracle(layout, gpu.device)
    keys = [bytes([i]) * 32 for i in range(64)]
    slots = gpu.allocate(64)
    dev.fill(gpu, slots, keys)
    dst = host.allocate(64)
    engine.copy(0, slots, 1, dst)  # asynchronous: ~5 ms of D2H in flight
    assert len(gpu.events) == 1  # one event for the whole batch, not yet seen complete
    gpu.release(slots)
    again = gpu.allocate(64)  # the same slots (LIFO), handed out while the drain may still run
    assert sorted(again) == sorted(slots)
    gpu.tensor[torch.as_tensor(again, device=gpu.device)] = 0xAB  # queued after the drain
    oracle = raykv.ContentOracle(layout)
    rows = engine.read(1, dst)  # waits for the host slots' pending copy
    assert all(oracle.check(rows[i], keys[i]) for i in range(64))
    # And back: promote into fresh slots while the old ones are rewritten; current stream ordered.
    back = list(again)
    engine.copy(1, dst, 0, back)
    assert all(dev.check(gpu, back, keys))
    engine.synchronize()
    gpu.close()
    host.close()


@pytest.mark.parametrize("method", ["kernel", "memcpy", "batch", "auto"])
@pytest.mark.parametrize("page_tokens", [1, 16])
def test_copy_methods_agree_on_scattered_slots(method: str, page_tokens: int) -> None:
    """200 scattered pages (about 200 runs: two chunks of batched DMA copies) GPU -> host ->
    GPU and within the pool, by each method, checked against the content oracle."""
    layout = raykv.KVLayout.uniform(2, 2, 64, tokens_per_block=page_tokens)
    gpu, host, engine = _pools(layout, 300)
    gpu.copier.method = method
    if method == "kernel":
        assert gpu.copier.kernel_available(), "the copy kernel did not compile"
    if method == "batch" and batch_memcpy() is None:
        pytest.skip("the driver has no cuMemcpyBatchAsync (CUDA < 12.8)")
    dev = DeviceOracle(layout, gpu.device)
    rng = np.random.default_rng(7)
    src = [PageId(int(s)) for s in rng.permutation(300)[:200]]
    dst = [PageId(int(s)) for s in rng.permutation(300)[:200]]
    keys = [i.to_bytes(4, "little") * 8 for i in range(200)]
    gpu.allocate(300)
    dev.fill(gpu, src, keys)
    engine.copy(0, src, 1, dst)  # d2h
    back = [PageId(int(s)) for s in rng.permutation(300)[:200]]
    engine.copy(1, dst, 0, back)  # h2d, ordered after the d2h through the host slots' events
    assert all(dev.check(gpu, back, keys))
    engine.settle(1, dst)
    oracle = raykv.ContentOracle(layout)
    assert all(oracle.check(host.array[d], keys[i]) for i, d in enumerate(dst))
    spare = sorted(set(range(300)) - set(back))[:50]
    gpu.copy_slots(back[:50], [PageId(s) for s in spare])  # within the pool, on the d2d stream
    assert all(dev.check(gpu, spare, keys[:50]))
    engine.synchronize()
    gpu.close()
    host.close()


def test_empty_and_zero_byte_batches_are_noops() -> None:
    layout = raykv.KVLayout.uniform(1, 1, 8, tokens_per_block=4)
    gpu, host, engine = _pools(layout, 4)
    engine.copy(0, [], 1, [])
    engine.copy(1, [], 0, [])
    assert engine.read(0, []).shape == (0, layout.page_bytes)
    engine.write(0, [], np.empty((0, layout.page_bytes), dtype=np.uint8))
    assert gpu.copier.copy("d2h", gpu.base_address, [], 0, [], layout.page_bytes) is None
    assert gpu.copier.copy("h2d", 0, [0], gpu.base_address, [0], 0) is None  # zero bytes
    assert gpu.copier.copy_many(
        "d2d", gpu.base_address, gpu.base_address, layout.page_bytes, [([], [])] * 2
    ) == [
        None,
        None,
    ]
    with pytest.raises(ValueError):  # checked before anything is enqueued
        gpu.copier.copy_many(
            "d2d", gpu.base_address, gpu.base_address, layout.page_bytes, [([0], [1]), ([2], [])]
        )
    gpu.copy_slots([], [])
    assert len(gpu.events) == 0 and sum(engine.bytes_moved.values()) == 0
    with pytest.raises(ValueError):
        engine.copy(0, [PageId(0)], 1, [])
    assert runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
    assert runs(np.array([3, 4, 5, 9]), np.array([0, 1, 7, 8])) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    gpu.close()
    host.close()


def test_device_oracle_matches_the_host_oracle_byte_for_byte() -> None:
    extra = (raykv.BufferSpec("k_scale", (3,), "float16"),)
    layout = raykv.KVLayout.uniform(3, 2, 24, tokens_per_block=5, extra=extra)  # padded regions
    dev = DeviceOracle(layout)
    host = raykv.ContentOracle(layout)
    keys = [bytes([i]) * 32 for i in range(6)]
    ntok = [5, 3, 1, 5, 2, 4]
    got = dev.expected(keys, ntok).cpu().numpy()
    for i, key in enumerate(keys):
        assert np.array_equal(got[i], host.expected(key, ntok[i]))


@pytest.mark.parametrize("batched", [False, True], ids=["copy", "copy_many"])
@pytest.mark.parametrize("method", ["kernel", "memcpy", "batch"])
def test_consecutive_copies_complete_in_order(method: str, batched: bool) -> None:
    """Copies on one stream (a pipelined import's chunks), one call each or one ``copy_many``:
    each one's bytes are right once its own event completed, earlier ones are done by then, and
    an empty chunk gets no event."""
    layout = raykv.KVLayout.uniform(2, 2, 64, tokens_per_block=16)
    gpu, host, engine = _pools(layout, 64)
    gpu.copier.method = method
    if method == "batch" and batch_memcpy() is None:
        pytest.skip("the driver has no cuMemcpyBatchAsync (CUDA < 12.8)")
    dev = DeviceOracle(layout, gpu.device)
    keys = [i.to_bytes(4, "little") * 8 for i in range(24)]
    src, dst = list(range(24)), [63 - i for i in range(24)]
    gpu.allocate(64)
    dev.fill(gpu, [PageId(s) for s in src], keys)
    torch.cuda.synchronize(gpu.device)
    base, page = gpu.base_address, layout.page_bytes
    spans = ((0, 5), (5, 5), (5, 17), (17, 24))
    if batched:
        events = gpu.copier.copy_many("d2d", base, base, page, [(src[lo:hi], dst[lo:hi]) for lo, hi in spans])
    else:
        events = [gpu.copier.copy("d2d", base, src[lo:hi], base, dst[lo:hi], page) for lo, hi in spans]
    assert events[1] is None
    assert all(e is not None for e in (events[0], events[2], events[3]))
    events[2].synchronize()
    assert events[0].query()  # earlier chunks are done once a later one is
    assert all(dev.check(gpu, [PageId(d) for d in dst[:17]], keys[:17]))
    events[3].synchronize()
    assert all(dev.check(gpu, [PageId(d) for d in dst], keys))
    engine.synchronize()
    gpu.close()
    host.close()


def test_batched_dma_refuses_arrays_that_do_not_match() -> None:
    batch = batch_memcpy()
    if batch is None:
        pytest.skip("the driver has no cuMemcpyBatchAsync (CUDA < 12.8)")
    stream = torch.cuda.Stream()
    ok = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError):
        batch.enqueue(stream.cuda_stream, ok, ok[:3], ok)
    with pytest.raises(ValueError):
        batch.enqueue(stream.cuda_stream, ok, ok, ok.astype(np.int64))  # type: ignore[arg-type]

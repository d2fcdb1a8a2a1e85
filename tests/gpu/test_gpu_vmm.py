"""GPU pool memory: CUDA virtual memory (fixed base across grow/shrink), K/V views, typed errors.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

import pickle

import pytest
from deps import require_cuda

torch = require_cuda()

import raykv  # noqa: E402
from raykv.core.errors import CudaError, InvalidArgumentError, OutOfMemoryError, StateError  # noqa: E402
from raykv.core.tiers.cuda_util import check, driver  # noqa: E402
from raykv.core.tiers.gpu import GpuPool  # noqa: E402
from raykv.core.types import PageId  # noqa: E402
from raykv.gpu_oracle import DeviceOracle  # noqa: E402

LAYOUT = raykv.KVLayout.uniform(4, 2, 64, tokens_per_block=16, dtype="bfloat16")


def _pool(pages: int, use_vmm: bool | None = True) -> GpuPool:
    return GpuPool(raykv.TierConfig.gpu(pages * LAYOUT.page_bytes), LAYOUT, use_vmm=use_vmm)


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i % 256, i // 256]) * 11 for i in range(n)]


def test_vmm_pool_base_stays_fixed_across_grow_and_shrink() -> None:
    pool = _pool(64)
    assert pool.arena is not None, "VMM unavailable on this machine (fell back to a plain allocation)"
    oracle = DeviceOracle(LAYOUT, pool.device)
    base = pool.base_address
    assert pool.tensor.data_ptr() == base
    slots = pool.allocate(64)
    oracle.fill(pool, slots, _keys(64))
    chunk = pool.arena.chunk_bytes
    grow_to = 64 + 3 * chunk // LAYOUT.page_bytes + 5  # several new chunks
    pool.resize(grow_to)
    assert pool.base_address == base and pool.tensor.data_ptr() == base
    assert pool.num_slots == grow_to and pool.num_free == grow_to - 64
    assert pool.arena.mapped_bytes >= grow_to * LAYOUT.page_bytes
    assert all(oracle.check(pool, slots, _keys(64)))  # old pages intact
    new = pool.allocate(grow_to - 64)
    oracle.fill(pool, new, _keys(len(new), salt=1))
    assert all(oracle.check(pool, new, _keys(len(new), salt=1)))
    with pytest.raises(StateError, match="in use"):
        pool.resize(64)  # pages above 64 are in use
    pool.release(new)
    pool.resize(64)
    assert pool.base_address == base and pool.tensor.data_ptr() == base
    assert pool.arena.mapped_bytes < grow_to * LAYOUT.page_bytes
    assert all(oracle.check(pool, slots, _keys(64)))
    pool.check_slots()
    with pytest.raises(InvalidArgumentError):
        pool.resize(0)
    pool.close()
    pool.close()  # idempotent


def test_kv_views_index_pages_by_page_id() -> None:
    pool = _pool(16)
    oracle = DeviceOracle(LAYOUT, pool.device)
    slots = pool.allocate(16)
    oracle.fill(pool, slots, _keys(16))
    views = pool.kv_views()
    assert len(views) == 4
    for layer, (k, v) in enumerate(views):
        for role, view in (("k", k), ("v", v)):
            region = LAYOUT.buffer_region(layer, role)
            assert tuple(view.shape) == (16, 16, 2, 64) and view.dtype == torch.bfloat16
            assert view.stride(0) * 2 == LAYOUT.page_bytes
            assert view.data_ptr() == pool.base_address + region.offset
            for page_id in (0, 7, 15):
                assert torch.equal(view[page_id], pool.buffer_view(PageId(page_id), layer, role))
                expected = oracle.expected([_keys(16)[slots.index(PageId(page_id))]])[0]
                raw = expected[region.offset : region.offset + region.nbytes]
                assert torch.equal(view[page_id].reshape(-1).view(torch.uint8), raw)
    pool.close()


def test_plain_allocation_fallback_works_but_cannot_resize() -> None:
    pool = _pool(8, use_vmm=False)
    assert pool.arena is None
    oracle = DeviceOracle(LAYOUT, pool.device)
    slots = pool.allocate(8)
    oracle.fill(pool, slots, _keys(8))
    assert all(oracle.check(pool, slots, _keys(8)))
    with pytest.raises(StateError, match="virtual-memory"):
        pool.resize(16)
    pool.close()


def test_more_than_free_memory_fails_at_construction_with_vmm() -> None:
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(OutOfMemoryError, match="GPU tier wants"):
        GpuPool(raykv.TierConfig.gpu(free + (1 << 30)), LAYOUT, use_vmm=True)
    pool = _pool(4)  # the failed attempt left nothing reserved or mapped behind
    pool.close()


def test_cuda_errors_are_typed_and_named() -> None:
    with pytest.raises(CudaError) as info:
        GpuPool(raykv.TierConfig.gpu(LAYOUT.page_bytes, device=99), LAYOUT)
    assert info.value.cuda_error == "CUDA_ERROR_INVALID_DEVICE"
    drv = driver()
    with pytest.raises(CudaError) as info:
        check(drv.cuMemAddressFree(drv.CUdeviceptr(0x1000), 4096), "cuMemAddressFree")
    assert info.value.cuda_error.startswith("CUDA_ERROR_")
    assert "cuMemAddressFree failed" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))
    assert again.cuda_error == info.value.cuda_error and str(again) == str(info.value)
    with pytest.raises(OutOfMemoryError) as oom:
        check(drv.cuMemAlloc(1 << 50), "cuMemAlloc")
    assert oom.value.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY"

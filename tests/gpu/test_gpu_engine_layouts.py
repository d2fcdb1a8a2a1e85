"""The vLLM connector's block copies on CUDA: KV tensors laid out as vLLM 0.32 registers them for
its GPU attention backends (every physical order, and a kernel-block split; built by
raykv.integrations.vllm.testing.vllm_kv_caches, no vLLM needed) save random blocks into
token-major page rows that are byte-identical across layouts, and those rows load into an engine
of another layout (and into a CPU-backend tensor in host memory) with the same K and V per
token and head, bit for bit.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from deps import require_cuda

torch = require_cuda()

from raykv import ConfigError, InvalidArgumentError, KVLayout  # noqa: E402
from raykv.core.tiers import cuda_blocks  # noqa: E402
from raykv.integrations.vllm.copier import BlockCopier  # noqa: E402
from raykv.integrations.vllm.layout import native_layout  # noqa: E402
from raykv.integrations.vllm.testing import (  # noqa: E402
    backend_kv,
    fill_backend,
    reference_rows,
    vllm_kv_caches,
)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
BLOCKS, HEADS, TOKENS, HEAD = 64, 4, 16, 64

# (kv_cache_layout, vLLM KVCacheLayout, kernel block size)
GPU_ENGINES = [
    ("flash_attn", "LBNHC", None),  # vLLM's default ("NHD")
    ("flashinfer", "LBHNC", None),  # "HND"
    ("flashinfer", "BLHNC", None),  # blocks outermost
    ("flash_attn", "BLNHC", None),
    ("triton_attn", "LHBNC", None),
    ("flex_attention", "BHLNC", None),
    ("flashinfer", "LBNHC", TOKENS // 2),  # kernel blocks of 8 tokens
]


def _engine(kind: str, order: str, kernel: int | None, dtype: str, device: str = "cuda") -> dict[str, Any]:
    return vllm_kv_caches(
        LAYERS, BLOCKS, HEADS, TOKENS, HEAD, dtype, device=device, order=order, kernel_block_size=kernel
    )


def _reference(dtype: str, seed: int) -> tuple[Any, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (len(LAYERS), BLOCKS, TOKENS, HEADS, HEAD)
    return tuple(torch.randn(shape, generator=gen, device="cuda").to(getattr(torch, dtype)) for _ in range(2))


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8).cpu()


def _check_loaded(
    kind: str, caches: dict[str, Any], ref: tuple[Any, Any], ids: list[int], into: list[int]
) -> None:
    rest = [b for b in range(BLOCKS) if b not in into]
    for i, name in enumerate(LAYERS):
        for got, values in zip(backend_kv(kind, caches[name], HEAD, TOKENS), ref):
            assert torch.equal(_bits(got[into]), _bits(values[i][ids])), (kind, name)
            assert not _bits(got[rest]).any(), (kind, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("chunk_pages", [None, 5])  # one chunk, or alternating staging slots
@pytest.mark.parametrize("scattered", [True, False], ids=["scattered", "run"])
def test_pages_identical_across_gpu_layouts(dtype: str, chunk_pages: int | None, scattered: bool) -> None:
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, dtype)
    chunk = {} if chunk_pages is None else {"chunk_bytes": chunk_pages * layout.page_bytes}
    rng = np.random.default_rng(7)
    perm = [int(b) for b in rng.permutation(BLOCKS)]
    ids, into = (perm[:23], perm[23:46]) if scattered else (list(range(3, 26)), list(range(30, 53)))
    ref = _reference(dtype, seed=3)
    want = reference_rows(layout, ref, ids)
    for n, (kind, order, kernel) in enumerate(GPU_ENGINES):
        src = _engine(kind, order, kernel, dtype)
        fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
        rows = np.full((len(ids), layout.page_bytes), 0xA5, dtype=np.uint8)
        BlockCopier(layout, LAYERS, src, kind, **chunk).save(ids, rows)
        assert np.array_equal(rows, want), (kind, order, kernel)
        d_kind, d_order, d_kernel = GPU_ENGINES[(n + 1) % len(GPU_ENGINES)]  # another layout
        dst = _engine(d_kind, d_order, d_kernel, dtype)
        BlockCopier(layout, LAYERS, dst, d_kind, **chunk).load(rows, into)
        _check_loaded(d_kind, dst, ref, ids, into)
    host = _engine("cpu", "LBHNC", None, dtype, device="cpu")  # the CPU backend reads them too
    BlockCopier(layout, LAYERS, host, "cpu").load(want, into)
    _check_loaded("cpu", host, tuple(r.cpu() for r in ref), ids, into)


def test_cpu_saved_pages_load_into_gpu_engines() -> None:
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "bfloat16")
    ref = _reference("bfloat16", seed=4)
    ids, into = [9, 2, 40, 41, 42, 7], [0, 63, 5, 6, 8, 30]
    host = _engine("cpu", "LBHNC", None, "bfloat16", device="cpu")
    fill_backend("cpu", host, LAYERS, tuple(r.cpu() for r in ref), HEAD, TOKENS)
    rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
    BlockCopier(layout, LAYERS, host, "cpu").save(ids, rows)
    rows.flags.writeable = False  # loads read peers' read-only mapped tiers
    for kind, order, kernel in GPU_ENGINES:
        dst = _engine(kind, order, kernel, "bfloat16")
        BlockCopier(layout, LAYERS, dst, kind).load(rows, into)
        _check_loaded(kind, dst, ref, ids, into)


def test_engine_native_refused_on_gpu_layouts() -> None:
    layout = native_layout(len(LAYERS), HEADS, HEAD, TOKENS, "bfloat16")
    for kind, order, kernel in GPU_ENGINES:
        with pytest.raises(ConfigError):
            BlockCopier(layout, LAYERS, _engine(kind, order, kernel, "bfloat16"), kind)


def test_benchmark_quick_runs() -> None:
    """The benchmark module's quick mode on this GPU (every row, no error)."""
    from raykv.bench.vllm_blocks import QUICK, Settings, benchmarks

    settings = Settings(layers=1, repeats=1, warmup=0, warm_s=0.0)
    assert settings.repeats <= QUICK.repeats
    for bench in benchmarks(settings, "cuda"):
        rows = bench.run()
        assert rows and all(r.error is None and r.ours > 0 for r in rows)


@pytest.mark.parametrize("chunk_pages", [None, 5])
def test_pinned_rows_are_copied_directly_and_exactly(chunk_pages: int | None) -> None:
    """Page rows in a registered (page-locked) shared host tier: saves DMA into them and loads
    DMA out of them (no host staging copy), with the same bytes as through pageable rows."""
    from raykv import TierConfig
    from raykv.core.tiers.host import HostPool

    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "bfloat16")
    chunk = {} if chunk_pages is None else {"chunk_bytes": chunk_pages * layout.page_bytes}
    ref = _reference("bfloat16", seed=5)
    ids, into = [5, 1, 60, 61, 62, 20, 33], [0, 63, 2, 3, 4, 40, 12]
    want = reference_rows(layout, ref, ids)
    pool = HostPool(TierConfig.host(16 * layout.page_bytes, shared=True), layout, pin=True)
    try:
        assert pool.pinned and torch.from_numpy(pool.array).is_pinned()
        rows = pool.array[: len(ids)]
        kind, order, kernel = GPU_ENGINES[1]
        src = _engine(kind, order, kernel, "bfloat16")
        fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
        BlockCopier(layout, LAYERS, src, kind, **chunk).save(ids, rows)
        assert np.array_equal(rows, want)
        dst = _engine(*GPU_ENGINES[0][:2], None, "bfloat16")
        BlockCopier(layout, LAYERS, dst, GPU_ENGINES[0][0], **chunk).load(rows, into)
        _check_loaded(GPU_ENGINES[0][0], dst, ref, ids, into)
    finally:
        pool.close()
    assert not pool.pinned


@pytest.mark.parametrize(("kind", "order", "kernel"), GPU_ENGINES)
def test_block_kernel_matches_torch_copies(
    kind: str, order: str, kernel: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-launch block kernel (the default on CUDA) writes the same bytes as torch's
    gathers and scatters, both ways, and loads straight from device pages by slot, with its
    table passed by value (small batches) or uploaded (``SMALL_PAGES`` 0)."""
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "bfloat16")
    ref = _reference("bfloat16", seed=11)
    ids, into = [4, 9, 10, 11, 50, 2], [60, 0, 1, 2, 30, 31]
    want = reference_rows(layout, ref, ids)
    src = _engine(kind, order, kernel, "bfloat16")
    fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
    fast = BlockCopier(layout, LAYERS, src, kind)
    slow = BlockCopier(layout, LAYERS, src, kind, use_kernel=False)
    assert fast.kernel is not None and slow.kernel is None
    for copier in (fast, slow):
        rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
        copier.save(ids, rows)
        assert np.array_equal(rows, want), copier.kernel
    pages = torch.zeros((16, layout.page_bytes), dtype=torch.uint8, device="cuda")
    slots = [7, 3, 4, 5, 15, 0]
    pages[torch.tensor(slots, device="cuda")] = torch.from_numpy(want).cuda()
    # the table by value (packed by raykv.native._slots, by numpy), uploaded; torch
    for use_kernel, small, pure in ((True, 480, "0"), (True, 480, "1"), (True, 0, "0"), (False, 480, "0")):
        monkeypatch.setattr(cuda_blocks, "SMALL_PAGES", small)
        monkeypatch.setenv("RAYKV_PURE_SLOTS", pure)
        dst = _engine(kind, order, kernel, "bfloat16")
        BlockCopier(layout, LAYERS, dst, kind, use_kernel=use_kernel).load_device(pages, slots, into)
        _check_loaded(kind, dst, ref, ids, into)
        rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
        BlockCopier(layout, LAYERS, src, kind, use_kernel=use_kernel).save(ids, rows)
        assert np.array_equal(rows, want)
    monkeypatch.undo()
    with pytest.raises(InvalidArgumentError):
        fast.load_device(pages.cpu(), slots, into)
    with pytest.raises(InvalidArgumentError):
        fast.load_device(pages, [*slots[:-1], 16], into)
    dst = _engine(kind, order, kernel, "bfloat16")
    before = {name: tensor.clone() for name, tensor in dst.items()}
    copier = BlockCopier(layout, LAYERS, dst, kind)
    bad = (
        ([*slots[:-1], -1], into),
        (slots, [*into[:-1], BLOCKS]),
        (slots[:-1], into),
        (slots, [*into[:-1], "x"]),
    )
    for small in (480, 0):
        monkeypatch.setattr(cuda_blocks, "SMALL_PAGES", small)
        for bad_slots, bad_into in bad:
            with pytest.raises(InvalidArgumentError):
                copier.load_device(pages, bad_slots, bad_into)
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(before[name]), _bits(dst[name])) for name in dst)  # nothing written


@pytest.mark.parametrize(("kind", "order", "kernel"), GPU_ENGINES)
def test_fp8_pages_of_uint8_kv_tensors_round_trip(kind: str, order: str, kernel: int | None) -> None:
    """vLLM keeps an fp8 KV cache in uint8 tensors: pages of float8_e4m3fn save and load its
    blocks byte for byte through the GPU copy path."""
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "float8_e4m3fn")
    gen = torch.Generator(device="cuda").manual_seed(9)
    shape = (len(LAYERS), BLOCKS, TOKENS, HEADS, HEAD)
    ref = tuple(
        torch.randint(1, 256, shape, generator=gen, device="cuda", dtype=torch.uint8) for _ in range(2)
    )
    ids, into = [5, 3, 40, 41, 42, 7], [60, 1, 2, 3, 30, 31]
    src, dst = _engine(kind, order, kernel, "uint8"), _engine(kind, order, kernel, "uint8")
    fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
    rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
    BlockCopier(layout, LAYERS, src, kind).save(ids, rows)
    BlockCopier(layout, LAYERS, dst, kind).load(rows, into)
    _check_loaded(kind, dst, ref, ids, into)


@pytest.mark.parametrize("order, kernel", [("LBNHC", None), ("BLHNC", None), ("LBNHC", TOKENS // 2)])
def test_mla_latent_pages_through_every_gpu_copy_path(order: str, kernel: int | None) -> None:
    """An MLA engine's cache (one 576-value latent per token, H = 1, as vLLM's dense MLA backends
    keep it): saves give the reference latents token after token, and loads from host rows and
    from device pages by slot write exactly the chosen blocks, with the block kernel and with
    torch copies."""
    from raykv.integrations.vllm.layout import mla_layout

    latent = 576
    layout = mla_layout(len(LAYERS), latent, TOKENS, "bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(13)
    ref = (torch.randn((len(LAYERS), BLOCKS, TOKENS, 1, latent), generator=gen, device="cuda").bfloat16(),)
    ids, into = [4, 9, 10, 11, 50, 2], [60, 0, 1, 2, 30, 31]
    want = reference_rows(layout, ref, ids)

    def engine() -> dict[str, Any]:
        return vllm_kv_caches(
            LAYERS,
            BLOCKS,
            1,
            TOKENS,
            0,
            "bfloat16",
            device="cuda",
            order=order,
            kernel_block_size=kernel,
            cells=latent,
        )

    src = engine()
    fill_backend("mla", src, LAYERS, ref, latent, TOKENS)
    pages = torch.zeros((16, layout.page_bytes), dtype=torch.uint8, device="cuda")
    slots = [7, 3, 4, 5, 15, 0]
    pages[torch.tensor(slots, device="cuda")] = torch.from_numpy(want).cuda()
    for use_kernel in (True, False):
        copier = BlockCopier(layout, LAYERS, src, use_kernel=use_kernel)
        assert copier.format.name == "mla" and (copier.kernel is not None) == use_kernel
        rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
        copier.save(ids, rows)
        assert np.array_equal(rows, want), use_kernel
        for load in ("rows", "pages"):
            dst = engine()
            copier = BlockCopier(layout, LAYERS, dst, "mla", use_kernel=use_kernel)
            if load == "rows":
                copier.load(rows, into)
            else:
                copier.load_device(pages, slots, into)
            _check_loaded("mla", dst, ref, ids, into)

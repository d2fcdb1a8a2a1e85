"""BlockCopier without an engine, on CPU tensors laid out as each vLLM attention backend gets
them (testing.vllm_kv_caches, checked against vLLM's own allocation when vllm is installed):
token-major pages are byte-identical whichever backend and physical order wrote them and load
into any other; engine_native pages round-trip on the CPU backend and are refused by the GPU
ones; ambiguous and bad inputs raise typed errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from deps import require

torch = require("torch")

from raykv import ConfigError, InvalidArgumentError, KVLayout  # noqa: E402
from raykv.integrations.vllm.copier import BlockCopier  # noqa: E402
from raykv.integrations.vllm.kv_blocks import check_page_layout, resolve_layout  # noqa: E402
from raykv.integrations.vllm.layout import (  # noqa: E402
    check_parallel,
    layer_index,
    native_layout,
    torch_dtype_name,
)
from raykv.integrations.vllm.testing import (  # noqa: E402
    KV_CACHE_ORDERS,
    backend_kv,
    fill_backend,
    reference_rows,
    tiny_layout,
    vllm_kv_caches,
)

NAMES = [f"model.layers.{i}.self_attn.attn" for i in (1, 0)]  # out of order on purpose
LAYERS = sorted(NAMES, key=layer_index)
BLOCKS, HEADS, TOKENS, HEAD = 12, 2, 16, 32

# (kv_cache_layout, vLLM KVCacheLayout, kernel block size): the CPU backend (LBHNC only), then
# the GPU backends under every physical order, and a kernel-block split.
ENGINES = [
    ("cpu", "LBHNC", None),
    ("flash_attn", "LBNHC", None),  # vLLM's default order ("NHD")
    ("flashinfer", "LBHNC", None),  # "HND" (FlashInfer on Blackwell)
    ("flashinfer", "BLHNC", None),
    ("flash_attn", "BLNHC", None),
    ("triton_attn", "LHBNC", None),
    ("flex_attention", "BHLNC", None),
    ("flashinfer", "LBNHC", TOKENS // 4),
]


def _engine(kind: str, order: str, kernel: int | None, dtype: str) -> dict[str, Any]:
    return vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, dtype, order=order, kernel_block_size=kernel)


def _reference(dtype: str, seed: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    shape = (len(LAYERS), BLOCKS, TOKENS, HEADS, HEAD)
    return tuple(torch.randn(shape, generator=gen).to(getattr(torch, dtype)) for _ in range(2))


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 7], [3, 4, 5, 9, 1, 0, 11]], ids=["run", "scattered"])
def test_token_major_pages_are_the_same_for_every_backend(dtype: str, ids: list[int]) -> None:
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, dtype)
    ref = _reference(dtype, seed=1)
    want = reference_rows(layout, ref, ids)
    into = [(b * 5 + 2) % BLOCKS for b in ids] if len(ids) > 5 else [0, 1, 2, 3, 4]
    for kind, order, kernel in ENGINES:
        src = _engine(kind, order, kernel, dtype)
        fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
        rows = np.full((len(ids) + 1, layout.page_bytes), 7, dtype=np.uint8)
        BlockCopier(layout, LAYERS, src, kind, chunk_bytes=3 * layout.page_bytes).save(ids, rows)
        assert np.array_equal(rows[: len(ids)], want), (kind, order, kernel)
        assert (rows[len(ids)] == 7).all()
    for kind, order, kernel in ENGINES:
        dst = _engine(kind, order, kernel, dtype)
        BlockCopier(layout, LAYERS, dst, kind, chunk_bytes=3 * layout.page_bytes).load(want, into)
        rest = [b for b in range(BLOCKS) if b not in into]
        for i, name in enumerate(LAYERS):
            for got, values in zip(backend_kv(kind, dst[name], HEAD, TOKENS), ref):
                assert torch.equal(_bits(got[into]), _bits(values[i][ids])), (kind, order, kernel)
                assert not _bits(got[rest]).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_native_round_trip_on_cpu(dtype: str) -> None:
    layout = native_layout(len(LAYERS), HEADS, HEAD, TOKENS, dtype)
    src, dst = _engine("cpu", "LBHNC", None, dtype), _engine("cpu", "LBHNC", None, dtype)
    fill_backend("cpu", src, LAYERS, _reference(dtype, seed=2), HEAD, TOKENS)
    ids, into = [3, 4, 5, 9, 1], [0, 1, 2, 7, 11]
    rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
    BlockCopier(layout, LAYERS, src, "cpu").save(ids, rows)
    BlockCopier(layout, LAYERS, dst, "cpu").load(rows, into)
    for name in LAYERS:
        assert torch.equal(_bits(dst[name][into]), _bits(src[name][ids]))
    region = layout.buffer_region(0, "kv_block")  # verbatim: block 3 of layer 0
    assert (
        rows[0, region.offset : region.offset + region.nbytes].tobytes()
        == _bits(src[LAYERS[0]][3]).numpy().tobytes()
    )


@pytest.mark.parametrize("kind, order, kernel", [e for e in ENGINES if e[0] != "cpu"] + [("cpu", "LBHNC", 8)])
def test_engine_native_refused_off_the_cpu_backend(kind: str, order: str, kernel: int | None) -> None:
    layout = native_layout(len(LAYERS), HEADS, HEAD, TOKENS, "float32")
    with pytest.raises(ConfigError):
        BlockCopier(layout, LAYERS, _engine(kind, order, kernel, "float32"), kind)
    if kernel is None:
        with pytest.raises(ConfigError):
            check_page_layout(kind, "engine_native")
    check_page_layout(kind, "token_major")


def test_format_from_strides_or_setting() -> None:
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "float32")
    BlockCopier(layout, LAYERS, _engine("flash_attn", "LBNHC", None, "float32"))  # only packed fits
    hnd = _engine("flashinfer", "LBHNC", None, "float32")  # cpu and packed both fit
    with pytest.raises(ConfigError, match="flash_attn"):
        BlockCopier(layout, LAYERS, hnd)
    assert BlockCopier(layout, LAYERS, hnd, "flashinfer").format.name == "packed"
    assert BlockCopier(layout, LAYERS, hnd, "cpu").format.name == "cpu"
    with pytest.raises(InvalidArgumentError, match=r"layers\.0.*\(12, 2, 16, 64\)"):
        BlockCopier(layout, LAYERS, _engine("flash_attn", "LBNHC", None, "float32"), "cpu")
    with pytest.raises(ConfigError, match="cpu"):
        BlockCopier(layout, LAYERS, hnd, "LBHNC")


def test_resolve_layout() -> None:
    assert resolve_layout(None, None) is None
    assert resolve_layout(None, "CPU_ATTN") == "cpu"
    assert resolve_layout(None, "FLASHINFER") == "flashinfer"
    assert resolve_layout("flash_attn", "FLASHINFER") == "flash_attn"  # same format
    assert resolve_layout("flash_attn", "SOME_NEW_BACKEND") == "flash_attn"
    for explicit, backend in [("cpu", "FLASH_ATTN"), (None, "SOME_NEW_BACKEND"), ("nhd", None)]:
        with pytest.raises(ConfigError):
            resolve_layout(explicit, backend)


def test_bad_inputs_raise_typed_errors() -> None:
    layout = tiny_layout()
    caches = vllm_kv_caches(LAYERS, BLOCKS, 2, 32, 64, order="LBHNC")
    copier = BlockCopier(layout, LAYERS, caches, "cpu")
    with pytest.raises(InvalidArgumentError):
        copier.load(np.zeros((1, layout.page_bytes), np.uint8), [BLOCKS])
    with pytest.raises(InvalidArgumentError):
        copier.save([-1], np.zeros((1, layout.page_bytes), np.uint8))
    with pytest.raises(InvalidArgumentError):
        copier.save([0], np.zeros((1, 10), np.uint8))
    with pytest.raises(InvalidArgumentError):
        copier.save([0, 1], np.zeros((1, layout.page_bytes), np.uint8))
    copier.save([], np.zeros((0, layout.page_bytes), np.uint8))
    with pytest.raises(InvalidArgumentError):
        BlockCopier(layout, LAYERS[:1], caches, "cpu")
    with pytest.raises(InvalidArgumentError, match="no KV tensor"):
        BlockCopier(layout, ["model.layers.0.x", "model.layers.7.x"], caches, "cpu")
    with pytest.raises(InvalidArgumentError, match=r"layers\.1.*\(12, 2, 32, 64\)"):
        bad = {**caches, LAYERS[1]: torch.zeros(12, 2, 32, 64)}
        BlockCopier(layout, LAYERS, bad, "cpu")
    with pytest.raises(InvalidArgumentError, match="float16"):
        BlockCopier(layout, LAYERS, {n: t.half() for n, t in caches.items()}, "cpu")
    with pytest.raises(InvalidArgumentError):  # block size 16 for a 32-token layout: not a kernel split
        BlockCopier(layout, LAYERS, vllm_kv_caches(LAYERS, 5, 2, 16, 64, order="LBHNC"), "cpu")
    with pytest.raises(InvalidArgumentError):
        BlockCopier(native_layout(2, 2, 64, 16, "float32"), LAYERS, caches, "cpu")


@pytest.mark.parametrize("order", sorted(KV_CACHE_ORDERS))
@pytest.mark.parametrize("kernel", [None, TOKENS // 2])
def test_vllm_kv_caches_matches_vllm(order: str, kernel: int | None) -> None:
    """testing.vllm_kv_caches gives the views vLLM's allocation gives (shape, strides, offset)."""
    iface = require("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[order]
    if kernel is not None and layout.stride_order[:2] != (0, 1):
        pytest.skip("vLLM splits blocks into kernel blocks only where a block is one dense page")
    spec = iface.FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    strides = iface.compute_layout_strides(spec, BLOCKS, len(LAYERS), layout)
    size = BLOCKS * len(LAYERS) * spec.page_size_bytes
    tensor = iface.KVCacheTensor(size=size, layers=LAYERS, layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8)
    theirs = iface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel)
    ours = vllm_kv_caches(
        LAYERS, BLOCKS, HEADS, TOKENS, HEAD, "bfloat16", order=order, kernel_block_size=kernel
    )
    for view, name in zip(theirs, LAYERS):
        mine = ours[name]
        assert (mine.shape, mine.stride(), mine.storage_offset()) == (
            view.shape,
            view.stride(),
            view.storage_offset(),
        )
    assert math.prod(theirs[0].shape) * 2 * len(LAYERS) == size


@pytest.mark.parametrize(
    "name", ["pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"]
)
def test_an_engine_splitting_layers_or_tokens_over_ranks_is_refused(name: str) -> None:
    """Pipeline or context parallelism leaves a rank part of a block's layers or tokens, which
    a page does not describe: the connector refuses to start (ConfigError naming the setting).
    Tensor parallelism (its size returned) and data parallelism pass, and so does a config
    without the field."""
    from types import SimpleNamespace

    names = ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size")
    sizes = dict.fromkeys((*names, "decode_context_parallel_size"), 1)
    assert (
        check_parallel(SimpleNamespace(parallel_config=SimpleNamespace(**sizes, data_parallel_size=4))) == 1
    )
    tensor = SimpleNamespace(parallel_config=SimpleNamespace(**{**sizes, "tensor_parallel_size": 4}))
    assert check_parallel(tensor) == 4
    assert check_parallel(SimpleNamespace()) == 1
    split = SimpleNamespace(parallel_config=SimpleNamespace(**{**sizes, name: 2}))
    with pytest.raises(ConfigError) as err:
        check_parallel(split)
    assert err.value.field == name and str(err.value).startswith(f"{name}: is 2;")


def test_kv_cache_dtypes_name_their_pages() -> None:
    """vLLM keeps fp8 KV caches in uint8 tensors: the cache dtype setting tells the format."""
    assert torch_dtype_name(torch.bfloat16) == "bfloat16"
    assert (
        torch_dtype_name(torch.uint8, "fp8") == torch_dtype_name(torch.uint8, "fp8_e4m3") == "float8_e4m3fn"
    )
    assert torch_dtype_name(torch.uint8, "fp8_e5m2") == "float8_e5m2"
    assert torch_dtype_name(torch.float8_e5m2) == "float8_e5m2"
    for dtype, cache in ((torch.uint8, "auto"), (torch.int8, "fp8"), (torch.float64, "auto")):
        with pytest.raises(ConfigError):
            torch_dtype_name(dtype, cache)


def test_fp8_pages_of_uint8_kv_tensors_round_trip_on_every_backend() -> None:
    """An fp8 KV cache lives in uint8 tensors: pages of float8_e4m3fn (one byte per value) save
    and load its blocks byte for byte, in every backend's format."""
    layout = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "float8_e4m3fn")
    gen = torch.Generator().manual_seed(5)
    shape = (len(LAYERS), BLOCKS, TOKENS, HEADS, HEAD)
    ref = tuple(torch.randint(1, 256, shape, generator=gen, dtype=torch.uint8) for _ in range(2))
    ids, into = [3, 4, 5, 9, 1], [0, 1, 2, 7, 11]
    want = reference_rows(layout, ref, ids)
    for kind, order, kernel in ENGINES:
        src, dst = _engine(kind, order, kernel, "uint8"), _engine(kind, order, kernel, "uint8")
        fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
        rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
        BlockCopier(layout, LAYERS, src, kind).save(ids, rows)
        assert np.array_equal(rows, want), (kind, order, kernel)
        BlockCopier(layout, LAYERS, dst, kind).load(rows, into)
        for i, name in enumerate(LAYERS):
            for got, values in zip(backend_kv(kind, dst[name], HEAD, TOKENS), ref):
                assert torch.equal(got[into], values[i][ids]), (kind, order, kernel)

"""Engines beyond one plain full-attention engine core, without an engine. MLA (multi-head
latent attention, DeepSeek-style): the page layout derived from vLLM's MLAAttentionSpec,
BlockCopier over latent tensors in every physical order (pages byte-identical to the reference
latents, loads writing exactly the chosen blocks), and the refusals (padded or scale-packed
caches, engine_native pages, a key/value format named for latent pages and the reverse). Data
parallelism: each rank's engine core pairs with a worker of its own. (Sliding-window groups:
test_vllm_groups.py.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from deps import require

torch = require("torch")

from raykv import ConfigError, InvalidArgumentError, KVLayout  # noqa: E402
from raykv.integrations.vllm.copier import BlockCopier  # noqa: E402
from raykv.integrations.vllm.kv_blocks import MLA_BACKENDS, resolve_layout  # noqa: E402
from raykv.integrations.vllm.layout import MLA_ROLE, engine_layout, layer_index, mla_layout  # noqa: E402
from raykv.integrations.vllm.testing import (  # noqa: E402
    KV_CACHE_ORDERS,
    backend_kv,
    fill_backend,
    reference_rows,
    vllm_kv_caches,
)

NAMES = [f"model.layers.{i}.self_attn.attn" for i in (1, 0, 2)]  # out of order on purpose
LAYERS = sorted(NAMES, key=layer_index)
BLOCKS, TOKENS, LATENT = 10, 16, 72


def _latents(order: str, kernel: int | None, dtype: str) -> dict[str, Any]:
    return vllm_kv_caches(
        LAYERS, BLOCKS, 1, TOKENS, 0, dtype, order=order, kernel_block_size=kernel, cells=LATENT
    )


def _reference(dtype: str, seed: int) -> tuple[Any]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((len(LAYERS), BLOCKS, TOKENS, 1, LATENT), generator=gen).to(getattr(torch, dtype)),)


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8)


ORDERS = [(order, None) for order in sorted(KV_CACHE_ORDERS)] + [("LBNHC", TOKENS // 4)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_pages_round_trip_in_every_physical_order(dtype: str) -> None:
    """Each layer's page region holds the block's latents token after token, whatever order the
    engine allocated; loading them into an engine of another order writes the chosen blocks and
    nothing else."""
    layout = mla_layout(len(LAYERS), LATENT, TOKENS, dtype)
    ref = _reference(dtype, seed=3)
    ids, into = [2, 3, 4, 9, 0], [5, 6, 7, 1, 8]
    want = reference_rows(layout, ref, ids)
    for order, kernel in ORDERS:
        src = _latents(order, kernel, dtype)
        fill_backend("mla", src, LAYERS, ref, LATENT, TOKENS)
        rows = np.full((len(ids) + 1, layout.page_bytes), 7, dtype=np.uint8)
        BlockCopier(layout, LAYERS, src, chunk_bytes=2 * layout.page_bytes).save(ids, rows)
        assert np.array_equal(rows[: len(ids)], want), (order, kernel)
        assert (rows[len(ids)] == 7).all()
        dst = _latents(ORDERS[-1 - ORDERS.index((order, kernel))][0], None, dtype)
        BlockCopier(layout, LAYERS, dst, "mla").load(rows[: len(ids)], into)
        rest = [b for b in range(BLOCKS) if b not in into]
        for i, name in enumerate(LAYERS):
            (got,) = backend_kv("mla", dst[name], LATENT, TOKENS)
            assert torch.equal(_bits(got[into]), _bits(ref[0][i][ids])), (order, kernel)
            assert not _bits(got[rest]).any()


def test_cpu_latent_loads_assign_whole_blocks_where_pages_are_the_blocks() -> None:
    """A latent block has one head, so in every physical order its bytes are one run, token
    after token: the page region verbatim, and CPU loads assign whole blocks (the round trip
    above checks their content). Key and value pages of several heads in head-major blocks are
    not, and go through the reorder."""
    layout = mla_layout(len(LAYERS), LATENT, TOKENS, "float32")
    for order, kernel in ORDERS:
        assert BlockCopier(layout, LAYERS, _latents(order, kernel, "float32"), "mla").verbatim, order
    kv = KVLayout.uniform(len(LAYERS), 2, 8, TOKENS, "float32")
    caches = vllm_kv_caches(LAYERS, BLOCKS, 2, TOKENS, 8, "float32", order="LBHNC")
    assert not BlockCopier(kv, LAYERS, caches, "cpu").verbatim


def _spec(**changes: Any) -> Any:
    iface = require("vllm.v1.kv_cache_interface")
    fields = dict(block_size=TOKENS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return iface.MLAAttentionSpec(**{**fields, **changes})


def _config(spec: Any) -> Any:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=NAMES)])


def test_engine_layout_of_an_mla_spec() -> None:
    """vLLM's MLAAttentionSpec gives one "kv_latent" buffer of (1, head_size) per layer, in layer
    order; an fp8 cache with a per-tensor scale (uint8 tensors) pages as float8_e4m3fn."""
    layout, names = engine_layout(_config(_spec()))
    assert names == tuple(LAYERS)
    assert layout == mla_layout(3, 576, TOKENS, "bfloat16")
    assert layout.roles(0) == (MLA_ROLE,) and layout.page_bytes == 3 * TOKENS * 576 * 2
    iface = require("vllm.v1.kv_cache_interface")
    fp8 = _spec(dtype=torch.uint8, kv_quant_mode=iface.KVQuantMode.FP8_PER_TENSOR)
    assert engine_layout(_config(fp8), cache_dtype="fp8")[0] == mla_layout(3, 576, TOKENS, "float8_e4m3fn")


def test_mla_caches_raykv_cannot_page_are_refused() -> None:
    """engine_native pages, padded blocks, per-token quantization or an fp8 format with scales
    packed beside the latent: ConfigError when the connector starts, naming the setting."""
    iface = require("vllm.v1.kv_cache_interface")
    with pytest.raises(ConfigError) as err:
        engine_layout(_config(_spec()), page_layout="engine_native")
    assert err.value.field == "page_layout"
    per_token = iface.KVQuantMode.FP8_PER_TOKEN_HEAD
    for spec, cache_dtype in [
        (_spec(page_size_padded=TOKENS * 576 * 2 + 64), "auto"),
        (_spec(dtype=torch.uint8, kv_quant_mode=per_token), "fp8"),
        (_spec(dtype=torch.uint8), "fp8_ds_mla"),
    ]:
        with pytest.raises(ConfigError):
            engine_layout(_config(spec), cache_dtype=cache_dtype)


def test_latent_pages_and_key_value_formats_do_not_mix() -> None:
    """Latent pages take the "mla" format only and key/value pages never take it; a tensor with
    more than one head is no latent cache. Every MLA backend resolves to "mla"."""
    layout = mla_layout(len(LAYERS), LATENT, TOKENS, "float32")
    with pytest.raises(ConfigError, match="mla"):
        BlockCopier(layout, LAYERS, _latents("LBNHC", None, "float32"), "flash_attn")
    kv = KVLayout.uniform(len(LAYERS), 1, LATENT // 2, TOKENS, "float32")
    with pytest.raises(ConfigError, match="mla"):
        BlockCopier(kv, LAYERS, _latents("LBNHC", None, "float32"), "mla")
    two_heads = vllm_kv_caches(LAYERS, BLOCKS, 2, TOKENS, 0, order="LBNHC", cells=LATENT)
    with pytest.raises(InvalidArgumentError, match="H = 1"):
        BlockCopier(layout, LAYERS, two_heads)
    for backend in MLA_BACKENDS:
        assert resolve_layout(None, backend) == "mla"
    with pytest.raises(ConfigError):
        resolve_layout("flash_attn", "FLASHMLA")


def test_hf_kv_layout_sends_mla_configs_to_the_latent_layout() -> None:
    """``hf.kv_layout`` builds key/value pages; for an MLA config it raises ConfigError spelling
    out the latent layout a vLLM deployment needs, which is the engine's own."""
    transformers = require("transformers")
    from raykv.integrations.hf import kv_layout
    from raykv.integrations.vllm.testing import MLA_FIELDS, tiny_mla_layout

    config = transformers.DeepseekV2Config(**MLA_FIELDS)
    with pytest.raises(ConfigError, match=r"mla_layout\(2, 576, 16, 'float32'\)"):
        kv_layout(config, 16)
    assert tiny_mla_layout() == mla_layout(2, 576, 16, "float32")


def test_each_data_parallel_rank_pairs_with_a_worker_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker`` as a list: the engine core of data-parallel rank r pairs with entry r (an index
    or a name), read from ``data_parallel_index`` (kept when vLLM resets a dense model's rank);
    a scalar is used as given; a list with fewer entries than ranks is refused. The connector's
    scheduler side opens its link to that worker."""
    from raykv.integrations.vllm import connector
    from raykv.integrations.vllm.layout import paired_worker

    def config(rank: int, size: int, **more: Any) -> Any:
        parallel = dict(data_parallel_rank=rank, data_parallel_size=size, **more)
        return SimpleNamespace(parallel_config=SimpleNamespace(**parallel))

    assert [paired_worker([3, 1, "w7"], config(r, 3)) for r in range(3)] == [3, 1, "w7"]
    assert paired_worker([3, 1], config(0, 2, data_parallel_index=1)) == 1  # dense: rank reset to 0
    assert paired_worker(2, config(1, 2)) == paired_worker(2, SimpleNamespace()) == 2
    assert paired_worker(["w0"], SimpleNamespace()) == "w0"
    for bad in ([], [0]):
        with pytest.raises(ConfigError) as err:
            paired_worker(bad, config(1, 2))
        assert err.value.field == "worker"

    opened: list[Any] = []
    monkeypatch.setattr(connector, "open_link", lambda extra: opened.append(extra["worker"]))
    iface = require("vllm.v1.kv_cache_interface")
    spec = iface.FullAttentionSpec(block_size=TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    for rank in (0, 1):
        transfer = SimpleNamespace(
            kv_connector_extra_config={"worker": ["raykv-worker-5", "raykv-worker-2"]},
            is_kv_consumer=True,
            is_kv_producer=True,
        )
        vllm_config = config(rank, 2, tensor_parallel_size=1)
        vllm_config.kv_transfer_config = transfer
        connector._ConnectorImpl()._setup(vllm_config, SimpleNamespace(name="SCHEDULER"), _config(spec))
    assert opened == ["raykv-worker-5", "raykv-worker-2"]

"""Engines whose layers sit in several KV cache groups (vLLM's hybrid KV cache manager: full
attention beside sliding-window attention), without an engine: the page layout covers every
layer whatever its group, and GroupedCopier moves each group's layers of a page through that
group's block, skipping the null blocks before a sliding window on loads, byte for byte against
reference K and V, on the CPU backend's blocks and FlashAttention's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from deps import require

torch = require("torch")

from raykv import ConfigError, InvalidArgumentError, KVLayout  # noqa: E402
from raykv.integrations.vllm.groups import GroupedCopier  # noqa: E402
from raykv.integrations.vllm.layout import engine_layout, is_grouped, layer_groups  # noqa: E402
from raykv.integrations.vllm.plan import NULL_BLOCK  # noqa: E402
from raykv.integrations.vllm.testing import backend_kv, fill_backend, vllm_kv_caches  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
GROUPS = (0, 1, 0)  # layers 0 and 2 full attention, layer 1 sliding window
BLOCKS, HEADS, TOKENS, HEAD = 12, 2, 16, 32
LAYOUT = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "float32")
ENGINES = [("cpu", "LBHNC"), ("flash_attn", "LBNHC"), ("flashinfer", "BLHNC")]


def _reference(seed: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    shape = (len(LAYERS), BLOCKS, TOKENS, HEADS, HEAD)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8)


def _rows(ref: tuple[Any, Any], table: list[tuple[int, int]]) -> np.ndarray:
    """Page rows built straight from the reference: page i's layer L from block
    ``table[i][GROUPS[L]]``."""
    rows = np.zeros((len(table), LAYOUT.page_bytes), dtype=np.uint8)
    for i, blocks in enumerate(table):
        for layer in LAYOUT.layer_ids:
            block = blocks[GROUPS[layer]]
            for role, values in zip(("k", "v"), ref):
                region = LAYOUT.buffer_region(layer, role)
                raw = _bits(values[layer][block]).reshape(-1).numpy()
                rows[i, region.offset : region.offset + region.nbytes] = raw
    return rows


@pytest.mark.parametrize("kind,order", ENGINES)
def test_pages_save_from_and_load_into_each_groups_blocks(kind: str, order: str) -> None:
    ref = _reference(seed=3)
    src = vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, order=order)
    fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
    table = [(1, 7), (2, 8), (5, 3), (6, 4)]  # (full-attention block, sliding-window block) per page
    rows = np.full((len(table) + 1, LAYOUT.page_bytes), 9, dtype=np.uint8)
    GroupedCopier(LAYOUT, LAYERS, GROUPS, src, kind).save(table, rows)
    assert np.array_equal(rows[: len(table)], _rows(ref, table))
    assert (rows[len(table)] == 9).all()

    dst = vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, order=order)
    into = [(3, NULL_BLOCK), (4, NULL_BLOCK), (9, 10), (11, 2)]  # the window covers pages 2 and 3
    GroupedCopier(LAYOUT, LAYERS, GROUPS, dst, kind).load(rows[: len(table)], into)
    for layer, name in enumerate(LAYERS):
        g = GROUPS[layer]
        loaded = [(page, blocks[g]) for page, blocks in enumerate(into) if blocks[g] != NULL_BLOCK]
        written = {b for _, b in loaded}
        for got, values in zip(backend_kv(kind, dst[name], HEAD, TOKENS), ref):
            for page, block in loaded:
                assert torch.equal(_bits(got[block]), _bits(values[layer][table[page][g]])), (layer, page)
            rest = [b for b in range(BLOCKS) if b not in written]
            assert not _bits(got[rest]).any(), (kind, layer)  # null block 0 included: untouched


def test_bad_block_tables_raise_and_copy_nothing() -> None:
    caches = vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, order="LBHNC")
    copier = GroupedCopier(LAYOUT, LAYERS, GROUPS, caches, "cpu")
    rows = np.ones((2, LAYOUT.page_bytes), dtype=np.uint8)
    with pytest.raises(InvalidArgumentError, match="null block"):
        copier.save([(1, 2), (3, NULL_BLOCK)], rows)
    with pytest.raises(InvalidArgumentError, match="one id per KV cache group"):
        copier.load(rows, [1, 2])
    with pytest.raises(InvalidArgumentError, match="block ids"):
        copier.load(rows, [(1, 2), (3, BLOCKS)])
    assert all(not t.any() for t in caches.values())
    copier.save([], rows)  # no pages (a store whose blocks staging already holds): no copy
    copier.load(rows, [])
    assert (rows == 1).all() and all(not t.any() for t in caches.values())
    with pytest.raises(InvalidArgumentError, match="groups"):
        GroupedCopier(LAYOUT, LAYERS, (0, 2, 0), caches, "cpu")


def _spec(kind: str, **changes: Any) -> Any:
    iface = require("vllm.v1.kv_cache_interface")
    fields: dict[str, Any] = dict(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    if kind == "SlidingWindowSpec":
        fields["sliding_window"] = 40
    return getattr(iface, kind)(**{**fields, **changes})


def _config(*groups: tuple[Any, list[str]]) -> Any:
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in groups]
    )


def test_the_layout_covers_every_group_and_names_each_layers_group() -> None:
    """vLLM groups layers by spec (here the sliding-window layer apart); the page holds all
    three in layer order and each layer reads its own group's block table."""
    full, window = _spec("FullAttentionSpec"), _spec("SlidingWindowSpec")
    config = _config((full, [LAYERS[2], LAYERS[0]]), (window, [LAYERS[1]]))
    layout, names = engine_layout(config)
    assert layout == LAYOUT and names == tuple(LAYERS)
    assert layer_groups(config, names) == GROUPS and is_grouped(config)
    one_window = _config((window, LAYERS))  # a sliding-window-only model: one group with nulls
    assert engine_layout(one_window)[0] == LAYOUT and is_grouped(one_window)
    assert not is_grouped(_config((full, LAYERS)))
    with pytest.raises(InvalidArgumentError, match="no KV cache group"):
        layer_groups(config, [*names, "model.layers.9.self_attn.attn"])


@pytest.mark.parametrize(
    "spec,field",
    [
        (("SlidingWindowSpec", {"num_kv_heads": 1}), "kv_cache_groups"),
        (("SlidingWindowSpec", {"head_size": 64}), "kv_cache_groups"),
        (("MLAAttentionSpec", {"num_kv_heads": 1}), "kv_cache_spec"),
        (("ChunkedLocalAttentionSpec", {"attention_chunk_size": 64}), "kv_cache_spec"),
    ],
)
def test_groups_a_page_cannot_hold_are_refused(spec: tuple[str, dict[str, Any]], field: str) -> None:
    other = _spec(spec[0], **spec[1])
    with pytest.raises(ConfigError) as err:
        engine_layout(_config((_spec("FullAttentionSpec"), LAYERS[:2]), (other, LAYERS[2:])))
    assert err.value.field == field

"""GroupedCopier on CUDA: an engine whose layers sit in two KV cache groups (full attention and a
sliding window, vLLM's hybrid KV cache manager) in vLLM's GPU layouts. Pages saved from each
group's blocks equal reference K and V byte for byte (through the staging buffers and straight
into pinned rows), and load back from host rows and device to device from a page tensor into
each group's blocks, the null blocks before the window left untouched.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from deps import require_cuda

torch = require_cuda()

from raykv import KVLayout  # noqa: E402
from raykv.integrations.vllm.groups import GroupedCopier  # noqa: E402
from raykv.integrations.vllm.plan import NULL_BLOCK  # noqa: E402
from raykv.integrations.vllm.testing import backend_kv, fill_backend, vllm_kv_caches  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUPS = (1, 0, 1, 0)  # group 0 sliding window (layers 1, 3), group 1 full attention
BLOCKS, HEADS, TOKENS, HEAD = 48, 4, 16, 64
LAYOUT = KVLayout.uniform(len(LAYERS), HEADS, HEAD, TOKENS, "bfloat16")
ENGINES = [("flash_attn", "LBNHC"), ("flashinfer", "LBHNC"), ("flashinfer", "BLHNC")]
SAVED = [(3, 30), (4, 31), (9, 7), (2, 11), (40, 12)]  # (window block, full block) per page
INTO = [(NULL_BLOCK, 20), (NULL_BLOCK, 21), (5, 22), (6, 1), (8, 47)]  # window covers pages 2-4


def _reference(seed: int) -> tuple[Any, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (len(LAYERS), BLOCKS, TOKENS, HEADS, HEAD)
    return tuple(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8).cpu()


def _want(ref: tuple[Any, Any]) -> np.ndarray:
    rows = np.zeros((len(SAVED), LAYOUT.page_bytes), dtype=np.uint8)
    for i, blocks in enumerate(SAVED):
        for layer in LAYOUT.layer_ids:
            for role, values in zip(("k", "v"), ref):
                region = LAYOUT.buffer_region(layer, role)
                raw = _bits(values[layer][blocks[GROUPS[layer]]]).reshape(-1).numpy()
                rows[i, region.offset : region.offset + region.nbytes] = raw
    return rows


def _check_loaded(kind: str, dst: dict[str, Any], ref: tuple[Any, Any]) -> None:
    for layer, name in enumerate(LAYERS):
        g = GROUPS[layer]
        written = {blocks[g] for blocks in INTO if blocks[g] != NULL_BLOCK}
        for got, values in zip(backend_kv(kind, dst[name], HEAD, TOKENS), ref):
            for page, blocks in enumerate(INTO):
                if blocks[g] != NULL_BLOCK:
                    assert torch.equal(_bits(got[blocks[g]]), _bits(values[layer][SAVED[page][g]]))
            rest = [b for b in range(BLOCKS) if b not in written]
            assert not _bits(got[rest]).any(), (kind, layer)


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("kind,order", ENGINES)
def test_grouped_pages_round_trip_on_the_gpu(kind: str, order: str, pinned: bool) -> None:
    ref = _reference(seed=5)
    src = vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, "bfloat16", device="cuda", order=order)
    fill_backend(kind, src, LAYERS, ref, HEAD, TOKENS)
    host = torch.zeros((len(SAVED), LAYOUT.page_bytes), dtype=torch.uint8, pin_memory=pinned)
    rows = host.numpy()
    GroupedCopier(LAYOUT, LAYERS, GROUPS, src, kind).save(SAVED, rows)
    assert np.array_equal(rows, _want(ref))

    dst = vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, "bfloat16", device="cuda", order=order)
    GroupedCopier(LAYOUT, LAYERS, GROUPS, dst, kind).load(rows, INTO)
    _check_loaded(kind, dst, ref)

    pages = torch.zeros((9, LAYOUT.page_bytes), dtype=torch.uint8, device="cuda")
    slots = [7, 0, 4, 2, 8]
    pages[slots] = torch.from_numpy(rows).cuda()
    dst = vllm_kv_caches(LAYERS, BLOCKS, HEADS, TOKENS, HEAD, "bfloat16", device="cuda", order=order)
    GroupedCopier(LAYOUT, LAYERS, GROUPS, dst, kind).load_device(pages, slots, INTO)
    _check_loaded(kind, dst, ref)

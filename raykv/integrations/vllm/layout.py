"""The raykv page layout of a vLLM engine's KV cache, and the copies between the two.

A raykv page is one block of ``block_size`` tokens of every attention layer: buffer ``(i, "k")``
holds layer i's keys as ``[tokens, num_kv_heads, head_size]`` (token-major, the same layout
:mod:`raykv.integrations.hf` uses, so a block stored by vLLM reads back in transformers), ``"v"``
the values. Layer i is the engine's i-th attention layer by layer index.

vLLM's CPU attention backend keeps one tensor per layer of shape ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` whose memory is ``[num_blocks, num_kv_heads, 2 * block_size,
head_size]``: per (block, head) the block's keys, then its values (the backend's own view, see
``vllm/v1/attention/backends/cpu_attn.py``). :class:`BlockCopier` reads and writes exactly those
bytes, so a round trip engine -> page -> engine is bit-exact.

torch is imported inside functions only; this module never imports vllm or ray.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv import BufferSpec, ConfigError, InvalidArgumentError, KVLayout, LayerSpec

_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def torch_dtype_name(dtype: Any) -> str:
    """The raykv dtype name of a torch dtype (float32, float16 or bfloat16); ConfigError for any
    other (e.g. an fp8 KV cache, which raykv pages do not describe yet)."""
    name = _DTYPES.get(str(dtype))
    if name is None:
        raise ConfigError("kv_cache_dtype", f"{dtype} KV caches are not supported (float32/16, bf16)")
    return name


NATIVE_ROLE = "kv_block"
PAGE_LAYOUTS = ("token_major", "engine_native")


def native_layout(
    num_layers: int, num_kv_heads: int, head_size: int, block_size: int, dtype: str
) -> KVLayout:
    """The ``engine_native`` page layout: per layer one buffer ``"kv_block"`` holding the CPU
    backend's block bytes verbatim (``[heads, 2 * block_size, head_size]``: per head the keys,
    then the values). Its per-token shape ``(2 * heads * head_size,)`` only sizes the region: the
    bytes are head-major, not one row per token, so only engines of this backend read them (the
    HF adapter cannot), but a load or store is a plain copy per block (no transposition)."""
    spec = BufferSpec(NATIVE_ROLE, (2 * num_kv_heads * head_size,), dtype)
    return KVLayout(tuple(LayerSpec(i, (spec,)) for i in range(num_layers)), block_size)


def engine_layout(kv_cache_config: Any, page_layout: str = "token_major") -> tuple[KVLayout, tuple[str, ...]]:
    """The page layout for a vLLM ``KVCacheConfig`` and its attention layer names in layout order.
    ``page_layout``: ``"token_major"`` (``KVLayout.uniform``: "k" and "v" per layer, the HF
    adapter's layout) or ``"engine_native"`` (:func:`native_layout`); ConfigError otherwise.

    Needs one KV cache group of full attention (every layer the same heads, head size and dtype);
    ConfigError otherwise (hybrid, sliding-window-only or MLA models are not supported)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    if len(groups) != 1:
        raise ConfigError("kv_cache_groups", f"one KV cache group needed, the engine has {len(groups)}")
    spec = groups[0].kv_cache_spec
    for field in ("num_kv_heads", "head_size", "block_size", "dtype"):
        if not hasattr(spec, field):
            raise ConfigError("kv_cache_spec", f"{type(spec).__name__} has no {field} (not attention?)")
    if getattr(spec, "use_mla", False) or type(spec).__name__ != "FullAttentionSpec":
        raise ConfigError("kv_cache_spec", f"{type(spec).__name__} is not supported (full attention only)")
    if page_layout not in PAGE_LAYOUTS:
        raise ConfigError("page_layout", f"must be one of {PAGE_LAYOUTS}, got {page_layout!r}")
    names = tuple(sorted(groups[0].layer_names, key=layer_index))
    build = native_layout if page_layout == "engine_native" else KVLayout.uniform
    fields = (int(spec.num_kv_heads), int(spec.head_size), int(spec.block_size), torch_dtype_name(spec.dtype))
    return build(len(names), *fields), names


def layer_index(name: str) -> int:
    """The layer number in a module name such as ``model.layers.11.self_attn.attn``."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if not found:
        raise InvalidArgumentError("layer_name", f"no layer index in {name!r}")
    return int(found[-1])


class BlockCopier:
    """Copies whole blocks between a vLLM engine's per-layer KV tensors and raykv page rows.

    ``kv_caches`` maps layer names to the tensors vLLM registers (``register_kv_caches``);
    ``names`` gives layout order (from :func:`engine_layout`). InvalidArgumentError when a tensor
    does not have the CPU backend's shape ``[blocks, heads, block_size, 2 * head_size]`` for the
    layout, or a layer is missing.
    """

    def __init__(self, layout: KVLayout, names: Sequence[str], kv_caches: Mapping[str, Any]) -> None:
        self.layout = layout
        self.page_bytes = layout.page_bytes
        first = layout.layer_ids[0]
        self.native = layout.roles(first) == (NATIVE_ROLE,)
        roles = (NATIVE_ROLE,) if self.native else ("k", "v")
        self._regions = [tuple(layout.buffer_region(i, r) for r in roles) for i in layout.layer_ids]
        tpb = layout.tokens_per_block
        self._views: list[Any] = []
        for name in names:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise InvalidArgumentError("kv_caches", f"no KV tensor for layer {name!r}")
            heads, head = int(tensor.shape[1]), int(tensor.shape[3]) // 2
            region = self._regions[len(self._views)][0]
            want = heads * tpb * head * (2 if self.native else 1) * tensor.element_size()
            fits = (
                tensor.dim() == 4
                and tensor.shape[2] == tpb
                and str(tensor.dtype) == f"torch.{region.spec.dtype}"
            )
            if not fits or region.nbytes != want:
                raise InvalidArgumentError(
                    "kv_caches", f"{name}: {tuple(tensor.shape)} {tensor.dtype} does not fit the layout"
                )
            self._views.append(tensor.view(tensor.shape[0], heads, 2 * tpb, head))
        if len(self._views) != len(self._regions):
            raise InvalidArgumentError(
                "kv_caches", f"{len(names)} layers for a layout of {len(self._regions)}"
            )
        self.num_blocks = int(self._views[0].shape[0]) if self._views else 0

    def _page_views(self, rows: npt.NDArray[np.uint8]) -> list[tuple[Any, ...]]:
        """Per layer, its regions of ``rows`` as tensors: ``[n, tokens, heads, head]`` for "k"
        and "v", ``[n, heads, 2 * tokens, head]`` for the native block."""
        import torch

        with warnings.catch_warnings():  # read-only rows (a peer's mapped tier) are only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(rows)
        out = []
        for regions, view in zip(self._regions, self._views):
            typed = []
            for region in regions:
                raw = flat[:, region.offset : region.offset + region.nbytes]
                values = raw.view(getattr(torch, region.spec.dtype))
                shape = view.shape[1:] if self.native else region.view_shape
                typed.append(values.view(len(rows), *shape))
            out.append(tuple(typed))
        return out

    def _check(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[int]) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.page_bytes or len(rows) < len(block_ids):
            raise InvalidArgumentError("rows", f"need {len(block_ids)} rows of {self.page_bytes} bytes")
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise InvalidArgumentError("block_ids", f"block ids must be in 0..{self.num_blocks - 1}")

    def save(self, block_ids: Sequence[int], rows: npt.NDArray[np.uint8]) -> None:
        """Write engine blocks ``block_ids`` into ``rows[:len(block_ids)]`` (writable uint8)."""
        self._copy(block_ids, rows, to_engine=False)

    def load(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[int]) -> None:
        """Write ``rows[i]`` into engine block ``block_ids[i]`` for every i: one copy per layer,
        role and run of consecutive block ids (no intermediate buffer)."""
        self._copy(block_ids, rows, to_engine=True)

    def _copy(self, block_ids: Sequence[int], rows: npt.NDArray[np.uint8], to_engine: bool) -> None:
        self._check(rows, block_ids)
        tpb = self.layout.tokens_per_block
        pages = self._page_views(rows[: len(block_ids)])
        for lo, hi, first in _runs(block_ids):
            for view, parts in zip(self._views, pages):
                blocks = view[first : first + hi - lo]  # [n, heads, 2 * tpb, head]
                if self.native:
                    pairs = [(blocks, parts[0][lo:hi])]
                else:
                    k, v = (p[lo:hi].transpose(1, 2) for p in parts)
                    pairs = [(blocks[:, :, :tpb], k), (blocks[:, :, tpb:], v)]
                for engine, page in pairs:
                    (engine if to_engine else page).copy_(page if to_engine else engine)


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(lo, hi, first)`` for each run of consecutive ids: ``block_ids[lo:hi]`` are ``first,
    first + 1, ...``."""
    runs: list[tuple[int, int, int]] = []
    lo = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((lo, i, int(block_ids[lo])))
            lo = i
    return runs

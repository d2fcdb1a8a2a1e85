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

from raykv import ConfigError, InvalidArgumentError, KVLayout

_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def torch_dtype_name(dtype: Any) -> str:
    """The raykv dtype name of a torch dtype (float32, float16 or bfloat16); ConfigError for any
    other (e.g. an fp8 KV cache, which raykv pages do not describe yet)."""
    name = _DTYPES.get(str(dtype))
    if name is None:
        raise ConfigError("kv_cache_dtype", f"{dtype} KV caches are not supported (float32/16, bf16)")
    return name


def engine_layout(kv_cache_config: Any) -> tuple[KVLayout, tuple[str, ...]]:
    """The page layout for a vLLM ``KVCacheConfig`` and its attention layer names in layout order.

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
    names = tuple(sorted(groups[0].layer_names, key=layer_index))
    layout = KVLayout.uniform(
        len(names),
        int(spec.num_kv_heads),
        int(spec.head_size),
        int(spec.block_size),
        torch_dtype_name(spec.dtype),
    )
    return layout, names


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
        spec = layout.buffer_region(layout.layer_ids[0], "k").spec
        heads, head = spec.shape
        tpb = layout.tokens_per_block
        self._views: list[Any] = []
        for name in names:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise InvalidArgumentError("kv_caches", f"no KV tensor for layer {name!r}")
            if (
                tuple(tensor.shape[1:]) != (heads, tpb, 2 * head)
                or str(tensor.dtype) != f"torch.{spec.dtype}"
            ):
                raise InvalidArgumentError(
                    "kv_caches",
                    f"{name}: {tuple(tensor.shape)} {tensor.dtype} does not fit {heads}x{tpb}x{head}",
                )
            self._views.append(tensor.view(tensor.shape[0], heads, 2 * tpb, head))
        self._regions = [
            (layout.buffer_region(i, "k"), layout.buffer_region(i, "v")) for i in layout.layer_ids
        ]
        self.num_blocks = int(self._views[0].shape[0]) if self._views else 0

    def _page_views(self, rows: npt.NDArray[np.uint8]) -> list[tuple[Any, Any]]:
        """Per layer, the (k, v) regions of ``rows`` as ``[n, tokens, heads, head]`` tensors."""
        import torch

        with warnings.catch_warnings():  # read-only rows (a peer's mapped tier) are only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(rows)
        out = []
        for k, v in self._regions:
            pair = []
            for region in (k, v):
                raw = flat[:, region.offset : region.offset + region.nbytes]
                typed = raw.view(getattr(torch, region.spec.dtype))
                pair.append(typed.view(len(rows), *region.view_shape))
            out.append((pair[0], pair[1]))
        return out

    def _check(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[int]) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.page_bytes or len(rows) < len(block_ids):
            raise InvalidArgumentError("rows", f"need {len(block_ids)} rows of {self.page_bytes} bytes")
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise InvalidArgumentError("block_ids", f"block ids must be in 0..{self.num_blocks - 1}")

    def save(self, block_ids: Sequence[int], rows: npt.NDArray[np.uint8]) -> None:
        """Write engine blocks ``block_ids`` into ``rows[:len(block_ids)]`` (writable uint8)."""
        self._check(rows, block_ids)
        tpb = self.layout.tokens_per_block
        pages = self._page_views(rows[: len(block_ids)])
        for lo, hi, first in _runs(block_ids):
            for view, (k, v) in zip(self._views, pages):
                blocks = view[first : first + hi - lo]  # [n, heads, 2 * tpb, head]
                k[lo:hi].copy_(blocks[:, :, :tpb].transpose(1, 2))
                v[lo:hi].copy_(blocks[:, :, tpb:].transpose(1, 2))

    def load(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[int]) -> None:
        """Write ``rows[i]`` into engine block ``block_ids[i]`` for every i: one strided copy per
        layer, role and run of consecutive block ids (no intermediate buffer)."""
        self._check(rows, block_ids)
        tpb = self.layout.tokens_per_block
        pages = self._page_views(rows[: len(block_ids)])
        for lo, hi, first in _runs(block_ids):
            for view, (k, v) in zip(self._views, pages):
                blocks = view[first : first + hi - lo]
                blocks[:, :, :tpb].copy_(k[lo:hi].transpose(1, 2))
                blocks[:, :, tpb:].copy_(v[lo:hi].transpose(1, 2))


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

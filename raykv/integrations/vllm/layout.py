"""The raykv page layout of a vLLM engine's KV cache.

A raykv page is one block of ``block_size`` tokens of every attention layer: buffer ``(i, "k")``
holds layer i's keys as ``[tokens, num_kv_heads, head_size]`` (token-major, the same layout
:mod:`raykv.integrations.hf` uses, so a block stored by vLLM reads back in transformers), ``"v"``
the values. Layer i is the engine's i-th attention layer by layer index. These bytes do not
depend on the attention backend or on vLLM's physical KV cache layout: a block saved from a
FlashAttention engine loads into a CPU one.

The ``engine_native`` layout (:func:`native_layout`) instead holds the CPU attention backend's
block bytes verbatim; GPU backends refuse it (ConfigError when the connector starts). An engine
with multi-head latent attention (MLA: DeepSeek V2/V3-style models) caches one latent vector per
token instead of keys and values; its pages are :func:`mla_layout` (``"kv_latent"`` per layer).
:class:`~raykv.integrations.vllm.copier.BlockCopier` copies blocks between the engine's tensors
and pages of either layout; :mod:`~raykv.integrations.vllm.kv_blocks` describes how each backend
stores them.

torch is imported inside functions only; this module never imports vllm or ray.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from raykv import BufferSpec, ConfigError, InvalidArgumentError, KVLayout, LayerSpec

_DTYPES = {
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
}
_FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
ENGINE_TENSOR_DTYPES = {
    "float8_e4m3fn": ("torch.float8_e4m3fn", "torch.uint8"),
    "float8_e5m2": ("torch.float8_e5m2", "torch.uint8"),
}
"""Torch dtypes an engine's KV tensors may have for a page dtype, beyond ``torch.<dtype>``: vLLM
keeps an fp8 KV cache in uint8 tensors."""
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def torch_dtype_name(dtype: Any, cache_dtype: str = "auto") -> str:
    """The raykv dtype name of an engine's KV cache dtype: float32, float16, bfloat16, or an fp8
    format, which vLLM keeps in uint8 tensors and names in ``cache_dtype`` (its
    ``cache_config.cache_dtype``: ``fp8`` and ``fp8_e4m3`` are float8_e4m3fn, ``fp8_e5m2``
    float8_e5m2). ConfigError for any other (e.g. uint8 without an fp8 ``cache_dtype``)."""
    if str(dtype) == "torch.uint8" and cache_dtype in _FP8_CACHE_DTYPES:
        return _FP8_CACHE_DTYPES[cache_dtype]
    name = _DTYPES.get(str(dtype))
    if name is None:
        raise ConfigError(
            "kv_cache_dtype", f"{dtype} ({cache_dtype}) KV caches are not supported (float32/16, bf16, fp8)"
        )
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
    HF adapter cannot), but a load or store is a plain copy per block (no transposition). Engines
    of the GPU backends refuse these pages (ConfigError): their blocks interleave K and V per
    token in an order set by vLLM's KV cache layout, which the page layout could not tell apart,
    and their token-major copy costs the same (a gather on the device)."""
    spec = BufferSpec(NATIVE_ROLE, (2 * num_kv_heads * head_size,), dtype)
    return KVLayout(tuple(LayerSpec(i, (spec,)) for i in range(num_layers)), block_size)


MLA_ROLE = "kv_latent"


def mla_layout(num_layers: int, latent_size: int, block_size: int, dtype: str) -> KVLayout:
    """The page layout of a multi-head latent attention (MLA, DeepSeek-style) engine: per layer
    one buffer ``"kv_latent"`` of ``(1, latent_size)`` per token (``latent_size`` =
    ``kv_lora_rank + qk_rope_head_dim``, e.g. 512 + 64), the latent vectors the engine caches
    instead of keys and values, token-major. Only MLA engines read these pages."""
    spec = BufferSpec(MLA_ROLE, (1, latent_size), dtype)
    return KVLayout(tuple(LayerSpec(i, (spec,)) for i in range(num_layers)), block_size)


def is_latent(layout: KVLayout) -> bool:
    """Whether ``layout`` is an MLA engine's (:func:`mla_layout`)."""
    return layout.roles(layout.layer_ids[0]) == (MLA_ROLE,)


_WINDOWED = ("SlidingWindowSpec",)
"""KV cache specs whose blocks outside the window vLLM frees (null blocks in the block table)."""


def engine_layout(
    kv_cache_config: Any, page_layout: str = "token_major", cache_dtype: str = "auto"
) -> tuple[KVLayout, tuple[str, ...]]:
    """The page layout for a vLLM ``KVCacheConfig`` and its attention layer names in layout order.
    ``page_layout``: ``"token_major"`` (``KVLayout.uniform``: "k" and "v" per layer, the HF
    adapter's layout) or ``"engine_native"`` (:func:`native_layout`); ConfigError otherwise. An
    MLA engine's pages are :func:`mla_layout` (token-major only).

    A page holds every attention layer of the engine, whatever KV cache group vLLM's hybrid
    manager put it in (:func:`layer_groups`): groups of full attention and of sliding-window
    attention (Gemma 2/3, gpt-oss, Mistral style), every layer with the same heads, head size,
    block size and dtype; or one group of MLA. ConfigError otherwise (state-space hybrids, MLA
    beside other groups, and other specs are not supported)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    if not groups:
        raise ConfigError("kv_cache_groups", "the engine has no KV cache group")
    specs = [g.kv_cache_spec for g in groups]
    for spec in specs:
        for field in ("num_kv_heads", "head_size", "block_size", "dtype"):
            if not hasattr(spec, field):
                raise ConfigError("kv_cache_spec", f"{type(spec).__name__} has no {field} (not attention?)")
    if type(specs[0]).__name__ == "MLAAttentionSpec" and len(groups) == 1:
        return _mla_layout(specs[0], groups[0].layer_names, page_layout, cache_dtype)
    for spec in specs:
        _check_kv_spec(spec, specs[0])
    if page_layout not in PAGE_LAYOUTS:
        raise ConfigError("page_layout", f"must be one of {PAGE_LAYOUTS}, got {page_layout!r}")
    names = tuple(sorted((n for g in groups for n in g.layer_names), key=layer_index))
    build = native_layout if page_layout == "engine_native" else KVLayout.uniform
    spec = specs[0]
    dtype = torch_dtype_name(spec.dtype, cache_dtype)
    fields = (int(spec.num_kv_heads), int(spec.head_size), int(spec.block_size), dtype)
    return build(len(names), *fields), names


def _check_kv_spec(spec: Any, first: Any) -> None:
    """ConfigError unless ``spec`` is plain K and V pages of full or sliding-window attention with
    ``first``'s heads, head size, block size and dtype."""
    kind = type(spec).__name__
    if getattr(spec, "use_mla", False) or kind not in ("FullAttentionSpec", *_WINDOWED):
        raise ConfigError(
            "kv_cache_spec",
            f"{kind} is not supported (full attention, sliding-window attention beside or instead "
            "of it, or one group of dense MLA)",
        )
    packed = any(getattr(spec, f, None) is not None for f in ("num_head_slots", "state_content_bytes"))
    if packed or getattr(spec, "head_size_v", None) not in (None, spec.head_size):
        raise ConfigError("kv_cache_spec", "only pages of K and V of one head size are supported")
    same = ("num_kv_heads", "head_size", "block_size", "dtype")
    if any(getattr(spec, f) != getattr(first, f) for f in same):
        raise ConfigError(
            "kv_cache_groups",
            f"KV cache groups of different shapes ({', '.join(f'{f} {getattr(spec, f)}' for f in same)} "
            f"against {', '.join(f'{f} {getattr(first, f)}' for f in same)}): one page cannot hold them",
        )


def layer_groups(kv_cache_config: Any, names: Sequence[str]) -> tuple[int, ...]:
    """The KV cache group of each layer of ``names`` (layout order, :func:`engine_layout`): the
    index into ``kv_cache_config.kv_cache_groups``, whose block table holds that layer's blocks.
    InvalidArgumentError for a name no group lists."""
    group_of = {n: i for i, g in enumerate(kv_cache_config.kv_cache_groups) for n in g.layer_names}
    missing = [n for n in names if n not in group_of]
    if missing:
        raise InvalidArgumentError("layer_names", f"{missing} are in no KV cache group")
    return tuple(group_of[n] for n in names)


def is_grouped(kv_cache_config: Any) -> bool:
    """Whether the engine's blocks are addressed per KV cache group: more than one group (vLLM's
    hybrid manager on), or a group of sliding-window layers (null blocks outside the window). Such
    an engine's block ids come as one list per group, and vLLM takes load failures per request
    only (``failed_recving``), so every load is asynchronous
    (:mod:`~raykv.integrations.vllm.scheduler`)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    return len(groups) > 1 or any(type(g.kv_cache_spec).__name__ in _WINDOWED for g in groups)


_SPLITS = ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size")


def check_parallel(vllm_config: Any) -> int:
    """The engine's tensor-parallel size (1 without ``parallel_config``). ConfigError when it
    splits a block's layers or tokens over worker processes (pipeline or context parallelism
    above 1): each rank then holds part of a block's layers or tokens, which raykv pages do not
    describe. Tensor parallelism is fine: each rank holds all the layers and tokens of a block
    for some KV heads and keeps pages of its own (:func:`~raykv.integrations.vllm.plan.rank_scope`);
    so is data parallelism (each rank is a whole engine)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in _SPLITS:
        size = getattr(parallel, name, 1) if parallel is not None else 1
        if isinstance(size, int) and size > 1:
            raise ConfigError(
                name,
                f"is {size}; RaykvConnector needs each engine worker to hold every layer and token "
                "of a block (tensor and data parallelism are supported)",
            )
    size = getattr(parallel, "tensor_parallel_size", 1) if parallel is not None else 1
    return size if isinstance(size, int) and size > 1 else 1


def paired_worker(choice: Any, vllm_config: Any) -> Any:
    """The CacheWorker this engine pairs with, from the connector's ``worker`` setting: an index
    or actor name as given, or, for a list, the entry of the engine's data-parallel rank (each
    rank is an engine core with its own KV cache, usually on its own GPUs: it pairs with a
    worker of its own). The rank is ``parallel_config.data_parallel_index`` (vLLM keeps it when
    it resets a dense model's ``data_parallel_rank``), else ``data_parallel_rank``. ConfigError
    for an empty list or one with fewer entries than ``data_parallel_size``."""
    if not isinstance(choice, (list, tuple)):
        return choice
    parallel = getattr(vllm_config, "parallel_config", None)
    size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    rank = getattr(parallel, "data_parallel_index", None)
    rank = int(getattr(parallel, "data_parallel_rank", 0) or 0) if rank is None else int(rank)
    if len(choice) < max(size, rank + 1, 1):
        raise ConfigError(
            "worker",
            f"a list of {len(choice)} workers for {size} data-parallel ranks (this engine is rank "
            f"{rank}); give one worker per rank",
        )
    return choice[rank]


def _mla_layout(
    spec: Any, layer_names: Any, page_layout: str, cache_dtype: str
) -> tuple[KVLayout, tuple[str, ...]]:
    """:func:`mla_layout` of an ``MLAAttentionSpec``: one latent per token, unquantized or fp8
    with a per-tensor scale (the bytes are the engine's own either way). ConfigError for
    ``engine_native`` pages and for caches that pad blocks, pack scales beside the latent or
    quantize per token (DeepSeek V4's and the sparse backends' formats among them)."""
    if page_layout != "token_major":
        raise ConfigError("page_layout", f"an MLA engine's pages are token_major, not {page_layout!r}")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    extras = ("alignment", "page_size_padded", "state_content_bytes", "num_head_slots", "model_version")
    padded = [f for f in extras if getattr(spec, f, None) is not None]
    if int(spec.num_kv_heads) != 1 or quant not in ("NONE", "FP8_PER_TENSOR") or padded:
        raise ConfigError(
            "kv_cache_spec",
            f"only MLA caches of one plain latent per token are supported (heads {spec.num_kv_heads}, "
            f"quantization {quant}, {', '.join(padded) or 'no padding'})",
        )
    names = tuple(sorted(layer_names, key=layer_index))
    dtype = torch_dtype_name(spec.dtype, cache_dtype)
    return mla_layout(len(names), int(spec.head_size), int(spec.block_size), dtype), names


def layer_index(name: str) -> int:
    """The layer number in a module name such as ``model.layers.11.self_attn.attn``."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if not found:
        raise InvalidArgumentError("layer_name", f"no layer index in {name!r}")
    return int(found[-1])

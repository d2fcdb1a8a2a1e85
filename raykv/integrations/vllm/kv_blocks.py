"""How vLLM's attention backends keep one layer's KV blocks: the block formats of BlockCopier.

Checked against vLLM 0.32. Every attention layer's KV cache reaches the connector
(``register_kv_caches``) as a 4-D view of logical shape ``[B, H, N, C]`` = ``[blocks, num_kv_heads,
block_size, 2 * head_size]`` (``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``), for
every backend. What differs:

- the physical order, the engine's ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``): one
  buffer holds every layer as ``[L, B, H, N, C]`` permuted by ``LBNHC`` (the default, "NHD"),
  ``LBHNC`` ("HND": the CPU backend, FlashInfer on Blackwell), ``LHBNC``, or the block-outermost
  ``BLNHC`` / ``BLHNC`` / ``BHLNC`` (each block holds every layer's page). A layer's view
  carries it in its strides; the formats below index the logical shape only, so every order
  works.
- kernel blocks: when the backend's kernel block size is smaller than the manager's
  (``block_size``), the view has ``B = num_blocks * r`` and ``N = block_size / r``; manager block
  b is kernel blocks ``b*r .. b*r + r - 1``, token ``t`` is kernel token ``t % N`` of kernel
  block ``t // N``. :func:`engine_blocks` groups them back: ``[num_blocks, r, H, N, C]``.
- how C is read, the *block format*:

  ``cpu`` (``CPU_ATTN``, ``cpu_attn.py``): ``kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)``:
  per (block, head) the N keys, then the N values. Needs each (block, head)'s ``[N, C]``
  contiguous, which ``LBHNC`` (the only layout that backend accepts) gives.

  ``packed`` (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``, ``FLEX_ATTENTION``: each does
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``): per (block, head, token) the key is
  ``C[:D]``, the value ``C[D:]``. Any physical order.

  ``mla`` (multi-head latent attention, :data:`MLA_BACKENDS`; DeepSeek-style models): ``H`` is 1
  and ``C`` is the latent's size (``kv_lora_rank + qk_rope_head_dim``, e.g. 576): per (block,
  token) one latent vector, no separate keys and values. Pages of the MLA layout
  (:func:`~raykv.integrations.vllm.layout.mla_layout`) take it, and only it.

``cpu`` and ``packed`` share the logical shape, so the shape cannot tell them apart; the strides can only rule
``cpu`` out (an interior that is not ``[N, C]``-contiguous). :func:`resolve_layout` picks the
format from the connector's ``kv_cache_layout`` setting and the attention backend vLLM chose.

torch is imported inside functions only; this module never imports vllm or ray.
"""

from __future__ import annotations

from typing import Any

from raykv import ConfigError, InvalidArgumentError


class BlockFormat:
    """One way of reading a block's ``[r, H, N, C]`` cells as keys and values."""

    name = ""
    native_pages = False

    def unfit(self, tensor: Any) -> str | None:
        """Why a layer view cannot be in this format (None when it can)."""
        return None

    def cells(self, head_size: int) -> int:
        """``C`` of a layer view whose pages have heads of ``head_size``."""
        return 2 * head_size

    def kv(self, blocks: Any, head_size: int) -> tuple[Any, ...]:
        """The page parts of ``blocks`` (``[m, r, H, N, C]``) as views ``[m, r, N, H, D]``: keys
        and values (one latent for MLA)."""
        raise NotImplementedError

    def native(self, blocks: Any) -> Any:
        """The engine_native page part of ``blocks``; ConfigError where there is none."""
        raise _no_native(self.name)


class CpuFormat(BlockFormat):
    """``CPU_ATTN``: per (block, head) ``[2 * N, D]``, the keys then the values."""

    name = "cpu"
    native_pages = True

    def unfit(self, tensor: Any) -> str | None:
        if tensor.stride(3) != 1 or (tensor.shape[2] > 1 and tensor.stride(2) != tensor.shape[3]):
            return "its (block, head) interiors are not contiguous [block_size, 2 * head_size]"
        return None

    def kv(self, blocks: Any, head_size: int) -> tuple[Any, Any]:
        m, r, h, n, _ = blocks.shape
        halves = blocks.view(m, r, h, 2 * n, head_size)
        return halves[:, :, :, :n].transpose(2, 3), halves[:, :, :, n:].transpose(2, 3)

    def native(self, blocks: Any) -> Any:
        m, r, h, n, c = blocks.shape
        if r != 1:
            raise ConfigError("page_layout", "engine_native pages need one kernel block per block")
        return blocks.view(m, h, 2 * n, c // 2)


class PackedFormat(BlockFormat):
    """GPU backends: per (block, head, token) the key ``C[:D]``, then the value ``C[D:]``."""

    name = "packed"

    def kv(self, blocks: Any, head_size: int) -> tuple[Any, Any]:
        return blocks[..., :head_size].transpose(2, 3), blocks[..., head_size:].transpose(2, 3)


class MlaFormat(BlockFormat):
    """MLA backends: per (block, token) one latent vector ``C`` (``H`` = 1), one page part."""

    name = "mla"

    def unfit(self, tensor: Any) -> str | None:
        return None if tensor.shape[1] == 1 else "an MLA cache has one latent per token (H = 1)"

    def cells(self, head_size: int) -> int:
        return head_size

    def kv(self, blocks: Any, head_size: int) -> tuple[Any, ...]:
        return (blocks.transpose(2, 3),)


CPU = CpuFormat()
PACKED = PackedFormat()
MLA = MlaFormat()
FORMATS: tuple[BlockFormat, ...] = (CPU, PACKED)  # what strides can tell apart (not MLA: its layout says)

KV_CACHE_LAYOUTS: dict[str, BlockFormat] = {
    "cpu": CPU,
    "flash_attn": PACKED,
    "flashinfer": PACKED,
    "triton_attn": PACKED,
    "flex_attention": PACKED,
    "mla": MLA,
}
"""The connector's ``kv_cache_layout`` values: the attention backend whose KV tensors these are
(vLLM's backend name in lower case; ``"cpu"`` for ``CPU_ATTN``), and the format it stores."""

MLA_BACKENDS = ("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA")
"""vLLM's dense MLA backends: each caches the latents as the logical ``[B, 1, N, C]`` view
(sparse and DeepSeek V4 backends pack other data beside them and are not among these)."""

BACKEND_LAYOUTS = {
    "CPU_ATTN": "cpu",
    **{k.upper(): k for k in KV_CACHE_LAYOUTS if k not in ("cpu", "mla")},
    **{name: "mla" for name in MLA_BACKENDS},
}
"""vLLM attention backend name (``AttentionBackend.get_name()``) -> ``kv_cache_layout`` value."""


def block_format(kv_cache_layout: str) -> BlockFormat:
    """The format of a ``kv_cache_layout`` value; ConfigError naming the choices otherwise."""
    found = KV_CACHE_LAYOUTS.get(kv_cache_layout)
    if found is None:
        raise ConfigError(
            "kv_cache_layout",
            f"unknown value {kv_cache_layout!r}; one of {sorted(KV_CACHE_LAYOUTS)} (the attention "
            "backend; vLLM's physical order, e.g. LBNHC, is read from the tensors)",
        )
    return found


def resolve_layout(explicit: str | None, backend: str | None) -> str | None:
    """The ``kv_cache_layout`` to copy with: ``explicit`` (the connector setting) or the one of
    vLLM's attention ``backend`` name; None when neither is known (the tensors decide, see
    :func:`detect_format`). ConfigError for an unknown value, a backend raykv has not checked
    (unless ``explicit`` names its format), or the two disagreeing."""
    if explicit is not None:
        chosen = block_format(explicit)
        known = BACKEND_LAYOUTS.get(backend or "")
        if known is not None and KV_CACHE_LAYOUTS[known] is not chosen:
            raise ConfigError(
                "kv_cache_layout", f"{explicit!r} does not store blocks like the engine's {backend}"
            )
        return explicit
    if backend is None:
        return None
    if backend not in BACKEND_LAYOUTS:
        raise ConfigError(
            "kv_cache_layout",
            f"attention backend {backend} is not one raykv has checked ({sorted(BACKEND_LAYOUTS)}); "
            f"if it stores blocks like one of them, set kv_cache_layout to {sorted(KV_CACHE_LAYOUTS)}",
        )
    return BACKEND_LAYOUTS[backend]


def check_page_layout(kv_cache_layout: str | None, page_layout: str) -> None:
    """ConfigError when ``page_layout`` is ``engine_native`` and ``kv_cache_layout``'s backend has
    no native pages (any but the CPU one)."""
    if kv_cache_layout is None or page_layout != "engine_native":
        return
    if not block_format(kv_cache_layout).native_pages:
        raise _no_native(kv_cache_layout)


def detect_format(name: str, tensor: Any, kv_cache_layout: str | None) -> BlockFormat:
    """The format of layer ``name``'s view: the one ``kv_cache_layout`` names (InvalidArgumentError
    when the tensor cannot be in it), else the only one its strides allow (ConfigError naming the
    choices when both are possible)."""
    if kv_cache_layout is not None:
        fmt = block_format(kv_cache_layout)
        reason = fmt.unfit(tensor)
        if reason is not None:
            raise InvalidArgumentError(
                "kv_caches", f"{name}: {kv_cache_layout} tensor {_describe(tensor)}, but {reason}"
            )
        return fmt
    fits = [f for f in FORMATS if f.unfit(tensor) is None]
    if len(fits) > 1:
        raise ConfigError(
            "kv_cache_layout",
            f"{name}: {_describe(tensor)} fits the cpu and the GPU backends' formats; set "
            f"kv_connector_extra_config['kv_cache_layout'] to one of {sorted(KV_CACHE_LAYOUTS)}",
        )
    return fits[0]


def engine_blocks(
    name: str, tensor: Any, block_size: int, num_kv_heads: int, head_size: int, cells: int | None = None
) -> Any:
    """Layer ``name``'s view ``[B, H, N, C]`` as manager blocks ``[num_blocks, r, H, N, C]`` (a
    view); InvalidArgumentError naming the layer and shape when it is not one of
    ``num_kv_heads`` x ``cells`` (default ``2 * head_size``: a key and a value) with
    ``block_size``-token blocks."""
    shape = tuple(tensor.shape)
    cells = 2 * head_size if cells is None else cells
    fits = (
        len(shape) == 4
        and shape[1] == num_kv_heads
        and shape[3] == cells
        and 0 < shape[2] <= block_size
        and block_size % shape[2] == 0
        and shape[0] % (block_size // shape[2]) == 0
    )
    if not fits:
        raise InvalidArgumentError(
            "kv_caches",
            f"{name}: {_describe(tensor)} is not [blocks, {num_kv_heads}, {block_size} (or a divisor), "
            f"{cells}]",
        )
    ratio = block_size // shape[2]
    return tensor.unflatten(0, (shape[0] // ratio, ratio))


def _no_native(name: str) -> ConfigError:
    return ConfigError(
        "page_layout",
        f"engine_native pages are the CPU backend's block bytes; {name} blocks need "
        "page_layout='token_major' (the device gathers them into token order at no extra cost)",
    )


def _describe(tensor: Any) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} strides {tuple(tensor.stride())}"

"""Hugging Face transformers adapter: a model's KV cache object <-> raykv pages.

One raykv block is ``tokens_per_block`` consecutive tokens of every layer: buffer ``(layer i,
"k")`` of a page holds ``cache.layers[i].keys[0, :, block tokens, :]`` laid out as
``[tokens_per_block, num_kv_heads, head_dim]`` (and ``"v"`` the values). Build the layout with
:func:`kv_layout`; use dtype ``"float32"`` for exact CPU results.

Two ways to reach pages:

- in process, through a :class:`raykv.KvCache` (:meth:`HFKVAdapter.store` writes page views,
  :meth:`HFKVAdapter.load` reads them; a GPU top tier is written device to device);
- as :class:`raykv.ExportedBlock` records (:meth:`HFKVAdapter.export`,
  :meth:`HFKVAdapter.load_exported`) for a process that talks to a CacheWorker actor.

RoPE: cached keys already carry their rotary positions, so only whole blocks are reused and the
remaining tokens are fed with explicit ``position_ids`` starting at the reused length.

Exactness contract (what the tests check bit for bit): :func:`greedy_generate` prefills in chunks
aligned to ``chunk`` tokens (default ``tokens_per_block``), as a chunked-prefill engine does. A
chunk's computation has the same shapes whether the blocks before it were just computed or loaded
from raykv, so generation over a reused, demoted-and-promoted or transferred prefix equals a full
recompute exactly (float32, CPU, same kernels). A one-shot prefill would not: CPU kernels are not
batch-invariant (a row's result depends on the row count), which moves the last bits. For the same
reason :func:`generate` stores prompt blocks only by default: the KV of generated tokens comes
from one-token decode steps, which differ in the last bits from a prefill of the same tokens.

torch and transformers are imported inside functions only; this module never imports ray.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from raykv.core.config import BufferRegion, KVLayout
from raykv.core.errors import ConfigError, InvalidArgumentError, OutOfPagesError
from raykv.core.keys import ReuseScope, block_keys
from raykv.core.records import ExportedBlock, page_checksum
from raykv.core.types import BlockKey

if TYPE_CHECKING:
    from raykv.core.kvcache import KvCache
    from raykv.core.manager import CacheManager

_TORCH_DTYPES = ("float32", "float16", "bfloat16")


def kv_layout(
    model_config: Any, tokens_per_block: int = 16, dtype: str = "float32", tensor_parallel_size: int = 1
) -> KVLayout:
    """The raykv page layout for a transformers decoder config: every layer has "k" and "v" of
    shape ``(num_key_value_heads, head_dim)``; with ``tensor_parallel_size`` n > 1, one rank's
    share of the KV heads as vLLM splits them (``num_key_value_heads / n``, or 1 when the heads
    are fewer than the ranks and replicated), the layout a deployment serving a tensor-parallel
    vLLM engine needs (those pages are not readable by the HF adapter). Raises
    ConfigError/InvalidArgumentError for a config without the usual attention fields, an
    unsupported dtype, or heads and ranks neither of which divides the other."""
    if dtype not in _TORCH_DTYPES:
        raise InvalidArgumentError("dtype", f"must be one of {_TORCH_DTYPES}, got {dtype!r}")
    if not (isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1):
        raise InvalidArgumentError(
            "tensor_parallel_size", f"must be an int >= 1, got {tensor_parallel_size!r}"
        )
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    _refuse_latent_attention(cfg, tokens_per_block, dtype)
    try:
        layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    except AttributeError as exc:
        raise InvalidArgumentError("model_config", f"not a decoder attention config: {exc}") from None
    ranks = tensor_parallel_size
    if kv_heads % ranks and ranks % kv_heads:
        raise InvalidArgumentError(
            "tensor_parallel_size", f"{kv_heads} KV heads cannot be split over {ranks} ranks"
        )
    return KVLayout.uniform(layers, max(1, kv_heads // ranks), head_dim, tokens_per_block, dtype)


def _refuse_latent_attention(cfg: Any, tokens_per_block: int, dtype: str) -> None:
    """ConfigError for a multi-head latent attention config (``kv_lora_rank``: DeepSeek V2/V3
    style): a vLLM engine caches one latent per token for it, not keys and values, so the
    deployment needs the latent layout, which the message spells out."""
    rank = getattr(cfg, "kv_lora_rank", None)
    if not rank:
        return
    latent = int(rank) + int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
    layers = getattr(cfg, "num_hidden_layers", "?")
    raise ConfigError(
        "model_config",
        "multi-head latent attention caches one latent per token, not keys and values; lay a "
        "vLLM deployment out with raykv.integrations.vllm.layout.mla_layout"
        f"({layers}, {latent}, {tokens_per_block}, {dtype!r})",
    )


@dataclass(frozen=True)
class Generation:
    """A greedy generation: the ``tokens`` generated, the final step's ``logits`` (the vocabulary
    row the last token was picked from, float32), the model cache object holding the KV of the
    prompt and of ``tokens[:-1]``, how many prompt tokens came from raykv, and how many blocks
    this call committed to raykv."""

    tokens: tuple[int, ...]
    logits: npt.NDArray[np.float32]
    cache: Any
    reused_tokens: int = 0
    stored_blocks: int = 0


class HFKVAdapter:
    """Copies KV between a transformers cache object (batch size 1) and raykv pages of one layout.

    The layout's layers, in order, are the model's layers 0..L-1; each must have "k" and "v" of
    the same ``(heads, head_dim)`` shape and a torch-supported dtype (InvalidArgumentError
    otherwise).
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.tokens_per_block = layout.tokens_per_block
        self._regions: list[tuple[BufferRegion, BufferRegion]] = []
        for layer in layout.layers:
            k, v = layout.buffer_region(layer.layer_id, "k"), layout.buffer_region(layer.layer_id, "v")
            if k.spec.shape != v.spec.shape or len(k.spec.shape) != 2:
                raise InvalidArgumentError("layout", f"layer {layer.layer_id}: k/v must be (heads, head_dim)")
            for spec in (k.spec, v.spec):
                if spec.dtype not in _TORCH_DTYPES:
                    raise InvalidArgumentError("layout", f"dtype {spec.dtype} has no torch view here")
            self._regions.append((k, v))

    @classmethod
    def for_model(cls, model: Any, tokens_per_block: int = 16, dtype: str = "float32") -> HFKVAdapter:
        return cls(kv_layout(model.config, tokens_per_block, dtype))

    # ---- raw pages ------------------------------------------------------------------------------
    def write_pages(self, cache: Any, pages: Sequence[Any], first_block: int) -> None:
        """Write blocks ``first_block ..`` of ``cache`` into ``pages`` (uint8 page views, numpy or
        torch; ``pages[i]`` receives block ``first_block + i``). The cache must hold them all."""
        import torch

        tpb = self.tokens_per_block
        need = (first_block + len(pages)) * tpb
        for i, (kr, vr) in enumerate(self._regions):
            keys, values = _layer_kv(cache, i)
            self._check_tensor(keys, need)
            for j, page in enumerate(pages):
                lo = (first_block + j) * tpb
                dst = _as_uint8_tensor(page, torch)
                _region(dst, kr, torch).copy_(keys[0, :, lo : lo + tpb, :].transpose(0, 1))
                _region(dst, vr, torch).copy_(values[0, :, lo : lo + tpb, :].transpose(0, 1))

    def read_pages(self, pages: Sequence[Any], config: Any = None) -> Any:
        """A new DynamicCache holding ``pages`` (blocks 0..len-1, in order). The tensors are
        copies: the pages may be reused as soon as this returns."""
        import torch

        cache = new_cache(config)
        if not pages:
            return cache
        srcs = [_as_uint8_tensor(p, torch) for p in pages]
        for i, (kr, vr) in enumerate(self._regions):
            k = torch.cat([_region(s, kr, torch) for s in srcs]).transpose(0, 1).unsqueeze(0)
            v = torch.cat([_region(s, vr, torch) for s in srcs]).transpose(0, 1).unsqueeze(0)
            cache.update(k.contiguous(), v.contiguous(), i)
        return cache

    def check_model(self, model_config: Any) -> None:
        """Raise InvalidArgumentError unless the layout fits ``model_config`` (layers, KV heads,
        head_dim)."""
        want = kv_layout(model_config, self.tokens_per_block, self._regions[0][0].spec.dtype)
        shapes = [want.buffer_region(layer.layer_id, "k").spec.shape for layer in want.layers]
        if [k.spec.shape for k, _ in self._regions] != shapes:
            raise InvalidArgumentError(
                "layout", f"does not fit the model: {len(shapes)} x {shapes[0]} wanted"
            )

    def _check_tensor(self, keys: Any, need: int) -> None:
        heads, head_dim = self._regions[0][0].spec.shape
        if keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[1] != heads or keys.shape[3] != head_dim:
            raise InvalidArgumentError(
                "cache", f"keys of shape {tuple(keys.shape)}; expected (1, {heads}, seq, {head_dim})"
            )
        if keys.shape[2] < need:
            raise InvalidArgumentError("cache", f"holds {keys.shape[2]} tokens, {need} needed")

    # ---- KvCache (in process) -------------------------------------------------------------------
    def store(self, kv: KvCache, cache: Any, first_block: int, end_block: int) -> None:
        """Write blocks ``first_block .. end_block - 1`` of ``cache`` into an ACTIVE KvCache's
        pages (commit them afterwards with ``kv.commit()``)."""
        self.write_pages(cache, [kv.page(b) for b in range(first_block, end_block)], first_block)

    def load(self, kv: KvCache, num_blocks: int, config: Any = None) -> Any:
        """A DynamicCache with the first ``num_blocks`` blocks of an ACTIVE KvCache."""
        return self.read_pages([kv.page(b) for b in range(num_blocks)], config)

    # ---- exported blocks (across processes) -----------------------------------------------------
    def export(
        self, cache: Any, keys: Sequence[BlockKey], root_key: BlockKey, first_block: int, end_block: int
    ) -> list[ExportedBlock]:
        """Blocks ``first_block .. end_block - 1`` of ``cache`` as ExportedBlock records, ready for
        ``CacheManager.import_blocks`` / ``CacheWorker.import_blocks``. ``keys`` are the prompt's
        block keys (``raykv.block_keys``) and ``root_key`` its scope's root key."""
        if not 0 <= first_block <= end_block <= len(keys):
            raise InvalidArgumentError("end_block", f"blocks {first_block}..{end_block} not in the keys")
        pages = np.zeros((end_block - first_block, self.layout.page_bytes), dtype=np.uint8)
        self.write_pages(cache, list(pages), first_block)
        out = []
        for j, b in enumerate(range(first_block, end_block)):
            data = pages[j].tobytes()
            parent = keys[b - 1] if b else root_key
            tpb = self.tokens_per_block
            out.append(ExportedBlock(keys[b], parent, b == 0, tpb, page_checksum(data), data))
        return out

    def load_exported(self, blocks: Sequence[ExportedBlock], config: Any = None) -> Any:
        """A DynamicCache holding ``blocks`` (a leading run of a prompt's blocks, in order)."""
        if not blocks:
            return new_cache(config)
        raw = np.frombuffer(b"".join(b.data for b in blocks), dtype=np.uint8)
        pages = raw.reshape(len(blocks), self.layout.page_bytes).copy()
        return self.read_pages(list(pages), config)


def leading_blocks(blocks: Sequence[ExportedBlock], keys: Sequence[bytes]) -> list[ExportedBlock]:
    """The leading run of ``keys`` found in ``blocks`` (export skips missing keys, so a hole ends
    the usable prefix)."""
    by_key = {b.key: b for b in blocks}
    out = []
    for key in keys:
        block = by_key.get(BlockKey(key))
        if block is None:
            break
        out.append(block)
    return out


def new_cache(config: Any = None) -> Any:
    """An empty DynamicCache (layer types from ``config`` when given)."""
    from transformers import DynamicCache

    return DynamicCache(config=config) if config is not None else DynamicCache()


def greedy_generate(
    model: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    chunk: int,
    cache: Any = None,
    start: int = 0,
) -> Generation:
    """Greedy decoding of ``max_new_tokens`` (>= 1) tokens after ``prompt``.

    ``cache`` (optional) already holds the KV of ``prompt[:start]``; prefill runs from ``start``
    in chunks ending at multiples of ``chunk`` (see the module docstring), then one token per
    step. Raises InvalidArgumentError for bad lengths.
    """
    import torch

    n = len(prompt)
    if max_new_tokens < 1 or chunk < 1 or not 0 <= start < n:
        raise InvalidArgumentError("start", f"need max_new_tokens >= 1 and 0 <= start < {n}, got {start}")
    cache = new_cache() if cache is None else cache
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out: list[int] = []
    with torch.inference_mode():
        s = start
        while s < n:
            e = min(n, (s // chunk + 1) * chunk)
            logits = _forward(model, ids[:, s:e], cache, s)
            s = e
        for step in range(max_new_tokens):
            out.append(int(logits.argmax()))
            if step + 1 < max_new_tokens:
                logits = _forward(model, torch.tensor([[out[-1]]]), cache, n + step)
    return Generation(tuple(out), logits.float().numpy().copy(), cache)


def generate(
    model: Any,
    manager: CacheManager,
    prompt: Sequence[int],
    max_new_tokens: int,
    scope: ReuseScope | None = None,
    adapter: HFKVAdapter | None = None,
    store_generated: bool = False,
) -> Generation:
    """Greedy generation that reuses and fills ``manager``'s cache.

    Matches the longest cached prefix of ``prompt[:-1]`` (the last prompt token is always
    computed, for its logits), loads it into a model cache, computes the rest, then stores the
    prompt's new full blocks (and the generated tokens' blocks if ``store_generated``) and commits
    them. A cache problem never fails generation: when the prefix cannot be made resident it
    recomputes, and when pages run out it stores nothing (``stored_blocks`` says what was stored).
    """
    adapter = adapter or HFKVAdapter(manager.config.layout)
    adapter.check_model(model.config)
    tpb = adapter.tokens_per_block
    if manager.tokens_per_block != tpb:
        raise InvalidArgumentError("adapter", "adapter and manager disagree on tokens_per_block")
    kv = manager.create(list(prompt[:-1]), scope)
    try:
        if not kv.resume():
            return greedy_generate(model, prompt, max_new_tokens, tpb)
        reused = kv.num_reused_tokens
        cache = adapter.load(kv, reused // tpb)
        gen = greedy_generate(model, prompt, max_new_tokens, tpb, cache, reused)
        keep = list(prompt) + (list(gen.tokens[:-1]) if store_generated else [])
        try:
            kv.extend(keep[reused:])
        except OutOfPagesError:
            return Generation(gen.tokens, gen.logits, gen.cache, reused, 0)
        adapter.store(kv, gen.cache, reused // tpb, len(keep) // tpb)
        stored = kv.commit()
        return Generation(gen.tokens, gen.logits, gen.cache, reused, stored)
    finally:
        kv.close()


def reusable_keys(
    prompt: Sequence[int], tokens_per_block: int, scope: ReuseScope | None = None
) -> list[BlockKey]:
    """Keys of the prompt blocks a request may reuse: the full blocks of ``prompt[:-1]`` (the
    last prompt token is always computed, for its logits)."""
    return block_keys(list(prompt[:-1]), tokens_per_block, scope)


def generate_from_blocks(
    model: Any,
    adapter: HFKVAdapter,
    prompt: Sequence[int],
    max_new_tokens: int,
    blocks: Sequence[ExportedBlock],
    scope: ReuseScope | None = None,
) -> tuple[Generation, list[ExportedBlock]]:
    """Greedy generation over cached ``blocks`` (e.g. fetched from a CacheWorker), for a process
    that does not own the pages. Uses the leading run of ``blocks`` that matches the prompt's
    reusable keys, and returns the generation plus the prompt's remaining full blocks as
    ExportedBlock records to store (their parents are the reused blocks, so they import after
    them)."""
    adapter.check_model(model.config)
    tpb = adapter.tokens_per_block
    scope = scope or ReuseScope()
    keys = block_keys(list(prompt), tpb, scope)
    usable = leading_blocks(blocks, keys[: (len(prompt) - 1) // tpb])
    reused = len(usable) * tpb
    gen = greedy_generate(model, prompt, max_new_tokens, tpb, adapter.load_exported(usable), reused)
    new = adapter.export(gen.cache, keys, scope.root_key(), len(usable), len(keys))
    return Generation(gen.tokens, gen.logits, gen.cache, reused, 0), new


def tiny_llama_config(**overrides: Any) -> Any:
    """The LlamaConfig of :func:`tiny_llama`: vocab 256, hidden 64, 2 layers, 4 heads, 2 KV
    heads (head_dim 16), up to 1024 positions; ``overrides`` replace fields."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A random-weight LlamaForCausalLM (:func:`tiny_llama_config`) in eval mode, identical for a
    given seed in every process (no download; the global torch RNG is left untouched)."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


# ---- helpers ------------------------------------------------------------------------------------
def _layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]  # transformers < 4.56


def _as_uint8_tensor(page: Any, torch: Any) -> Any:
    return torch.from_numpy(page) if isinstance(page, np.ndarray) else page


def _region(page: Any, region: BufferRegion, torch: Any) -> Any:
    raw = page[region.offset : region.offset + region.nbytes]
    return raw.view(getattr(torch, region.spec.dtype)).view(region.view_shape)


_CACHE_KWARG: dict[type, str] = {}


def _forward(model: Any, ids: Any, cache: Any, start: int) -> Any:
    """One forward of ``ids`` at positions ``start ..``; returns the last position's logits."""
    import torch

    kind = type(model)
    name = _CACHE_KWARG.get(kind)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = _CACHE_KWARG[kind] = "cache" if "cache" in params else "past_key_values"
    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **{name: cache})
    return out.logits[0, -1]


__all__ = [
    "Generation",
    "HFKVAdapter",
    "generate",
    "greedy_generate",
    "kv_layout",
    "leading_blocks",
    "new_cache",
    "reusable_keys",
    "generate_from_blocks",
    "tiny_llama_config",
    "tiny_llama",
]

"""Helpers shared by the vLLM connector's tests, benchmark and example: a tiny random-weight
Llama on disk, engine settings that give bit-exact CPU results, the connector config, one
greedy request with its logprobs, and KV tensors laid out as vLLM's attention backends get them
(:func:`vllm_kv_caches`, for copies without an engine).

Exactness: CPU kernels are not batch-invariant (a row's result depends on the row count), so the
engines here prefill in chunks of one block (``max_num_batched_tokens = block_size``), run one
request at a time, and use one torch thread each (:func:`pin_engine_threads`). A chunk then has
the same shapes whether the blocks before it were computed or loaded, and generation over
loaded blocks equals a full recompute bit for bit (as in
:mod:`raykv.integrations.hf`).

torch, transformers and vllm are imported inside functions only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raykv import CacheConfig, KVLayout, TierConfig
from raykv.integrations.vllm.layout import mla_layout, native_layout

BLOCK_SIZE = 32
MODEL_FIELDS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # the CPU attention backend's smallest common head size
    max_position_embeddings=1024,
)


MLA_BLOCK_SIZE = 16  # vLLM's CPU platform runs MLA models with 16-token blocks
MLA_FIELDS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    q_lora_rank=None,
    kv_lora_rank=512,  # latent 512 + 64 = 576: the size CPU_MLA's decode kernel takes
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    max_position_embeddings=1024,
)
"""A tiny DeepSeek-V2 (multi-head latent attention) for :func:`save_tiny_mla`."""


def save_tiny_llama(path: str, seed: int = 0, **fields: Any) -> str:
    """Write a random-weight LlamaForCausalLM (:data:`MODEL_FIELDS` updated with ``fields``,
    float32) to ``path`` (created) unless one is already there; returns ``path``. Same weights
    for a given seed and fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_random(
        path, seed, LlamaConfig(**{**MODEL_FIELDS, **fields, "torch_dtype": "float32"}), LlamaForCausalLM
    )


def save_tiny_mla(path: str, seed: int = 0, **fields: Any) -> str:
    """Write a random-weight DeepseekV2ForCausalLM (:data:`MLA_FIELDS` updated with ``fields``,
    float32) to ``path`` unless one is already there; returns ``path``. Every layer's MLP is
    dense unless ``first_k_dense_replace`` is given (vLLM's CPU MoE router needs expert groups
    these configs do not set). Its engine caches one latent of ``kv_lora_rank +
    qk_rope_head_dim`` (576) values per token and layer (:func:`tiny_mla_layout`)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    merged = {**MLA_FIELDS, **fields}
    merged.setdefault("first_k_dense_replace", merged["num_hidden_layers"])
    config = DeepseekV2Config(**{**merged, "torch_dtype": "float32"})
    return _save_random(path, seed, config, DeepseekV2ForCausalLM)


def _save_random(path: str, seed: int, config: Any, model_class: Any) -> str:
    """``model_class(config)`` with weights drawn from ``seed``, saved to ``path`` unless a model
    is already there."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
    model.save_pretrained(path)
    return path


def tiny_layout(block_size: int = BLOCK_SIZE, page_layout: str = "token_major", **changes: Any) -> KVLayout:
    """The raykv page layout of :func:`save_tiny_llama`'s model with ``changes`` to its fields
    (what the engine derives for the connector's ``page_layout``)."""
    fields = {**MODEL_FIELDS, **changes}
    build = native_layout if page_layout == "engine_native" else KVLayout.uniform
    return build(
        fields["num_hidden_layers"], fields["num_key_value_heads"], fields["head_dim"], block_size, "float32"
    )


def tiny_mla_layout(block_size: int = MLA_BLOCK_SIZE, **changes: Any) -> KVLayout:
    """The raykv page layout of :func:`save_tiny_mla`'s model with ``changes`` to its fields
    (what its engine derives)."""
    fields = {**MLA_FIELDS, **changes}
    latent = fields["kv_lora_rank"] + fields["qk_rope_head_dim"]
    return mla_layout(fields["num_hidden_layers"], latent, block_size, "float32")


def deployment_config(layout: KVLayout, host_pages: int = 256, disk_pages: int = 1024) -> CacheConfig:
    """A deployment config for engines of ``layout``: a shared host tier (one-sided reads by
    the engines) of ``host_pages`` pages over a disk tier of ``disk_pages``."""
    page = layout.page_bytes
    host = TierConfig.host(host_pages * page, pin_memory=False, shared=True)
    return CacheConfig(layout, (host, TierConfig.disk(disk_pages * page)))


KV_CACHE_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM 0.32's ``KVCacheLayout`` members: the physical order of the logical ``[L, B, H, N, C]``
(``vllm/v1/kv_cache_layout.py``). ``NHD`` and ``HND`` are aliases of ``LBNHC`` and ``LBHNC``."""


def vllm_kv_caches(
    names: Sequence[str],
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: str = "float32",
    device: str = "cpu",
    order: str = "LBNHC",
    kernel_block_size: int | None = None,
    cells: int | None = None,
) -> dict[str, Any]:
    """Per-layer KV tensors as vLLM 0.32 registers them with a connector (``allocate_kv_cache``,
    ``create_kv_cache_views``, no page padding): one zeroed buffer holding every layer as
    ``[L, B, H, N, C]`` in the physical ``order`` (:data:`KV_CACHE_ORDERS`), viewed per layer as
    the logical ``[B, H, N, C]`` of ``dtype``, ``C = cells`` (default ``2 * head_size``: a key and
    a value; an MLA engine's is its latent size, with one head). ``kernel_block_size`` (a divisor of
    ``block_size``) splits each block into kernel blocks as vLLM does when the attention
    kernels want smaller ones: ``B = num_blocks * r``, ``N = block_size / r``."""
    import torch

    dtype_t = getattr(torch, dtype)
    kernel = kernel_block_size or block_size
    itemsize = torch.empty((), dtype=dtype_t).element_size()
    shape = (
        len(names),
        num_blocks * (block_size // kernel),
        num_kv_heads,
        kernel,
        (cells or 2 * head_size) * itemsize,
    )
    strides = [0] * 5
    size = 1
    for dim in reversed(KV_CACHE_ORDERS[{"NHD": "LBNHC", "HND": "LBHNC"}.get(order, order)]):
        strides[dim] = size
        size *= shape[dim]
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    view = torch.as_strided(raw, shape, strides)
    return {name: view[i].view(dtype_t) for i, name in enumerate(names)}


THREAD_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""One torch thread in every engine process. vLLM's CPU worker otherwise sets OMP_NUM_THREADS
to the cores it binds, which can differ between engines started at different times, and CPU
GEMMs differ in the last bits between thread counts."""


def backend_kv(kind: str, tensor: Any, head_size: int, block_tokens: int) -> tuple[Any, ...]:
    """K and V of one layer's KV view as ``[blocks, block_tokens, heads, head_size]`` views,
    read the way the backend's own code reads them, independently of
    :mod:`raykv.integrations.vllm.kv_blocks` (cpu_attn.py: per (block, head) the keys, then the
    values; flash_attn.py / flashinfer.py / triton_attn.py / flex_attention.py: per token the key,
    then the value). ``kind`` ``"mla"``: the one latent per token (cpu_mla.py writes token t of
    block b at ``kv_cache[b, 0, t]``), a 1-tuple of ``[blocks, block_tokens, 1, C]``. Kernel-block
    splits (``tensor.shape[2] < block_tokens``) are joined back."""
    b, h, n, _ = tensor.shape
    parts: tuple[Any, ...]
    if kind == "cpu":
        k, v = tensor.view(b, h, 2 * n, -1).chunk(2, dim=2)
        parts = (k.transpose(1, 2), v.transpose(1, 2))
    elif kind == "mla":
        parts = (tensor.transpose(1, 2),)
    else:
        parts = tuple(tensor.transpose(1, 2).split(head_size, dim=-1))
    r = block_tokens // n  # kernel blocks per block: block i's tokens are kernel blocks i*r .. i*r + r - 1
    return tuple(p.unflatten(0, (b // r, r)).flatten(1, 2) for p in parts)


def fill_backend(
    kind: str,
    caches: Mapping[str, Any],
    names: Sequence[str],
    ref: tuple[Any, ...],
    head_size: int,
    block_tokens: int,
) -> None:
    """Write reference K and V (``[layers, blocks, block_tokens, heads, head_size]`` each; for
    ``"mla"`` one reference latent ``[layers, blocks, block_tokens, 1, C]``) into the layers
    ``names`` of ``caches`` through :func:`backend_kv`."""
    for i, name in enumerate(names):
        for part, values in zip(backend_kv(kind, caches[name], head_size, block_tokens), ref, strict=True):
            part.copy_(values[i])


def reference_rows(layout: KVLayout, ref: tuple[Any, ...], ids: Sequence[int]) -> np.ndarray:
    """Token-major page rows of blocks ``ids`` built straight from reference K and V (what the HF
    adapter reads), or from one reference latent for an MLA layout: the bytes every backend's
    save must produce."""
    import torch

    rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
    for i in layout.layer_ids:
        for role, values in zip(layout.roles(i), ref, strict=True):
            region = layout.buffer_region(i, role)
            raw = values[i][list(ids)].contiguous().view(torch.uint8).reshape(len(ids), -1).cpu().numpy()
            rows[:, region.offset : region.offset + region.nbytes] = raw
    return rows


def pin_engine_threads() -> dict[str, str | None]:
    """Set :data:`THREAD_ENV` in this process (engines started afterwards inherit it); returns
    the previous values for :func:`restore_env`."""
    saved = {k: os.environ.get(k) for k in THREAD_ENV}
    os.environ.update(THREAD_ENV)
    return saved


def restore_env(saved: Mapping[str, str | None]) -> None:
    """Undo :func:`pin_engine_threads`."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


KV_CACHE_BYTES = 512 << 20
"""The KV cache of a test engine (:func:`engine_kwargs`)."""


def engine_kwargs(model: str, block_size: int = BLOCK_SIZE, **changes: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a small exact CPU engine (float32, eager, one-block chunks,
    vLLM's own prefix cache off so every reuse comes from raykv). The KV cache is sized
    explicitly (``kv_cache_memory_bytes``, 512 MiB: the benchmark's 4,096-token prompt of its
    8-layer model fits, and so do the tests' 6 engines at once): vLLM's CPU worker otherwise
    reserves ``gpu_memory_utilization`` times the memory of one NUMA node minus its own
    resident size, which is negative on machines whose nodes are small."""
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype="float32",
        block_size=block_size,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        enable_prefix_caching=False,
        max_num_batched_tokens=block_size,
        max_num_seqs=4,
        seed=0,
    )
    kwargs.update(changes)
    return kwargs


def connector_config(
    namespace: str, ray_address: str, worker: int | str = 0, role: str = "kv_both", **extra: Any
) -> Any:
    """A ``vllm.config.KVTransferConfig`` for :class:`RaykvConnector` (recompute on load errors)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="RaykvConnector",
        kv_connector_module_path="raykv.integrations.vllm",
        kv_role=role,  # type: ignore[arg-type]
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "namespace": namespace,
            "ray_address": ray_address,
            "worker": worker,
            **extra,
        },
    )


def example_connector_config(path: str) -> Any:
    """A ``KVTransferConfig`` for vLLM's own ExampleConnector (``kv_both``, blocks saved as files
    under ``path``): a reference for what loading a prefix into an engine should give."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",  # type: ignore[arg-type]
        kv_connector_extra_config={"shared_storage_path": path},
    )


@dataclass(frozen=True)
class Result:
    """One greedy request: generated tokens, per step the top logprobs ({token: logprob}),
    the connector's ``kv_transfer_params["raykv"]`` (empty without the connector) and vLLM's
    ``num_cached_tokens`` (prompt tokens not computed: its prefix cache plus connector loads)."""

    tokens: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float], ...], ...]
    raykv: Mapping[str, Any]
    cached_tokens: int = 0


def generate(
    llm: Any,
    prompt: Sequence[int],
    max_tokens: int = 6,
    cache_salt: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> Result:
    """Run ``prompt`` alone through ``llm`` greedily with 5 logprobs per step. ``params``:
    the request's ``kv_transfer_params``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": dict(params)} if params else None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, extra_args=extra)
    prompt_in = TokensPrompt(prompt_token_ids=list(prompt))
    if cache_salt is not None:
        prompt_in["cache_salt"] = cache_salt
    out = llm.generate([prompt_in], sampling, use_tqdm=False)[0]
    done = out.outputs[0]
    steps = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in done.logprobs or ())
    raykv = (out.kv_transfer_params or {}).get("raykv", {})
    return Result(tuple(done.token_ids), steps, raykv, int(out.num_cached_tokens or 0))


def shutdown_engine(llm: Any) -> None:
    """Stop an ``LLM``'s engine processes now."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()

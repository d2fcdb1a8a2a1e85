"""What a vLLM engine's KV bytes depend on besides the tokens: the model fingerprint and the
LoRA adapter identity that enter every block key's scope (:class:`raykv.ReuseScope`).

Model fingerprint (:func:`model_fingerprint`, 32 bytes, computed once per engine)
    SHA-256 over a domain tag and a canonical JSON record of:

    - ``weights``: which weights the engine runs. ``kv_connector_extra_config["model_id"]`` when
      given (a user's name for the weights: two copies of the same weights under different
      paths, or on nodes that downloaded them separately, share when given the same
      ``model_id``); else, for a model that is a local directory, :func:`weights_digest` of its
      files (``config.json`` and every weight file's content); else the model name and its
      ``revision`` (a hub model vLLM downloads itself).
    - ``dtype`` (the model's), ``cache_dtype`` (the KV cache's: ``auto``, ``fp8``...),
      ``kv_cache_dtype_skip_layers``, ``quantization``, ``hf_overrides``, ``load_format`` (random
      ``dummy`` weights are not a checkpoint's).
    - ``layout``: the raykv page layout of one rank (layers, per-layer buffers with heads per
      rank, head size and dtype, tokens per block: ``engine_native`` or MLA pages differ from
      token-major ones) and ``ranks``, the tensor-parallel degree (rank r's pages are keyed in
      its own scope, :func:`~raykv.integrations.vllm.plan.rank_scope`).

    Equal records give equal fingerprints in every process on every node, so engines of one model
    share KV across processes and nodes; engines of two models never match each other's blocks,
    whatever the index, a pull or a router sees.

Weights digest (:func:`weights_digest`)
    Per file, in name order: its name relative to the model directory, its size, and its content
    identity. A file that resolves into a Hugging Face cache blob (``.../blobs/<sha256>``, where
    the hub names blobs by the SHA-256 of their content) contributes that name; any other file
    up to ``full_hash_bytes`` (default 4 GiB over all files) is hashed whole (SHA-256); past
    that budget a file contributes ``SAMPLES`` evenly spaced 64 KiB samples and a warning is
    logged (a fine-tune that changed only weights between samples would then look the same:
    name such models with ``model_id``).

LoRA identity (:func:`lora_identity`)
    A LoRA adapter is named by what it is, not by the engine-local ``lora_int_id`` (each engine,
    each Serve replica, numbers its adapters itself): the low 8 bytes of SHA-256 over a domain
    tag and the :func:`weights_digest` of its directory (``adapter_config.json`` and its weight
    files) when ``lora_path`` is a local directory, else its ``lora_name`` and ``lora_path``.

No vllm, torch or ray import: vLLM's config objects are read by attribute.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Final

from raykv import ConfigError, KVLayout

log = logging.getLogger(__name__)

MODEL_DOMAIN: Final = b"raykv-model-v1\x00"
LORA_DOMAIN: Final = b"raykv-lora-v1\x00"
WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")
CONFIG_FILES: Final = ("config.json", "adapter_config.json", "params.json")
FULL_HASH_BYTES: Final = 4 << 30
SAMPLES: Final = 256
SAMPLE_BYTES: Final = 64 << 10
_CHUNK: Final = 8 << 20


def _hub_blob(path: str) -> str | None:
    """The content SHA-256 a Hugging Face cache blob is named by, if ``path`` resolves to one."""
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if os.path.basename(os.path.dirname(real)) == "blobs" and len(name) == 64:
        try:
            bytes.fromhex(name)
        except ValueError:
            return None
        return name
    return None


def _file_digest(path: str, size: int, whole: bool) -> str:
    """SHA-256 of the file's content (``whole``) or of ``SAMPLES`` evenly spaced samples."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        if whole or size <= SAMPLES * SAMPLE_BYTES:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
            return "sha256:" + sha.hexdigest()
        for i in range(SAMPLES):  # the first and last SAMPLE_BYTES among them
            f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
            sha.update(f.read(SAMPLE_BYTES))
    return "sampled:" + sha.hexdigest()


def _model_files(root: str) -> list[str]:
    """Config and weight files under ``root`` (relative paths, sorted)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name in CONFIG_FILES or name.endswith(WEIGHT_SUFFIXES):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


@functools.lru_cache(maxsize=32)
def weights_digest(root: str, full_hash_bytes: int = FULL_HASH_BYTES) -> str:
    """The hex content identity of the model (or adapter) directory ``root`` (module docstring).
    Cached per process by path. ConfigError when ``root`` holds no config or weight file."""
    files = _model_files(root)
    if not files:
        raise ConfigError("model", f"{root} holds no config or weight files to fingerprint")
    sha = hashlib.sha256()
    budget = full_hash_bytes
    sampled = []
    for rel in files:
        path = os.path.join(root, rel)
        size = os.path.getsize(path)
        ident = _hub_blob(path)
        if ident is None:
            whole = size <= budget
            budget -= size if whole else 0
            ident = _file_digest(path, size, whole)
            if not whole and ident.startswith("sampled:"):
                sampled.append(rel)
        sha.update(json.dumps([rel, size, ident]).encode() + b"\n")
    if sampled:
        log.warning(
            "raykv: %s: %d weight files past %d GiB are fingerprinted by samples; name the model with "
            "kv_connector_extra_config['model_id'] if two checkpoints could differ between samples",
            root,
            len(sampled),
            full_hash_bytes >> 30,
        )
    return sha.hexdigest()


def _layout_record(layout: KVLayout) -> list[Any]:
    """The page layout as plain values: tokens per block, then per layer its buffers."""
    layers = [
        [layer.layer_id, [[b.role, list(b.shape), b.dtype] for b in layer.buffers]] for layer in layout.layers
    ]
    return [layout.tokens_per_block, layers]


def model_record(vllm_config: Any, layout: KVLayout, ranks: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the model fingerprint (module docstring), as JSON-ready values."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    load = getattr(vllm_config, "load_config", None)
    named = extra.get("model_id")
    if named is not None and (not isinstance(named, str) or not named):
        raise ConfigError("model_id", f"must be a non-empty str, got {named!r}")
    source = str(getattr(model, "model", "") or "")
    if named is not None:
        weights = ["model_id", named]
    elif source and os.path.isdir(source):
        weights = ["files", weights_digest(os.path.realpath(source))]
    else:
        weights = ["hub", source, str(getattr(model, "revision", None))]
    return {
        "weights": weights,
        "dtype": str(getattr(model, "dtype", None)),
        "cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "kv_cache_dtype_skip_layers": repr(getattr(cache, "kv_cache_dtype_skip_layers", None)),
        "quantization": str(getattr(model, "quantization", None)),
        "hf_overrides": repr(getattr(model, "hf_overrides", None)),
        "load_format": str(getattr(load, "load_format", None)),
        "layout": _layout_record(layout),
        "ranks": int(ranks),
    }


def model_name(vllm_config: Any, extra: Mapping[str, Any]) -> str:
    """A short name of the engine's model for messages and worker claims: ``model_name`` (a
    Serve replica sets its model id), else ``model_id``, else the served name, else the model;
    the last component of a path."""
    model = getattr(vllm_config, "model_config", None)
    named = extra.get("model_name") or extra.get("model_id") or getattr(model, "served_model_name", None)
    if isinstance(named, (list, tuple)):
        named = named[0] if named else None
    name = str(named or getattr(model, "model", "") or "model").rstrip("/")
    return (os.path.basename(name) or name)[:60]


def fingerprint(record: Mapping[str, Any]) -> bytes:
    """SHA-256 of the domain tag and ``record`` as canonical JSON (sorted keys): 32 bytes."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(MODEL_DOMAIN + text.encode("utf-8")).digest()


def model_fingerprint(vllm_config: Any, layout: KVLayout, ranks: int, extra: Mapping[str, Any]) -> bytes:
    """The engine's model fingerprint (module docstring): 32 bytes, the same in every process
    of every engine of this model, dtypes and page layout. ConfigError for a bad ``model_id``
    or a model directory with nothing to fingerprint."""
    return fingerprint(model_record(vllm_config, layout, ranks, extra))


def lora_identity(lora_request: Any) -> int:
    """A LoRA adapter's unsigned 64-bit id from its content (module docstring), the same for
    the same adapter in every engine whatever ``lora_int_id`` each gave it. Computed once per
    process for each (name, path)."""
    path = str(getattr(lora_request, "lora_path", "") or "")
    return _lora_identity(str(getattr(lora_request, "lora_name", "")), path)


@functools.lru_cache(maxsize=1024)
def _lora_identity(name: str, path: str) -> int:
    sha = hashlib.sha256(LORA_DOMAIN)
    if path and os.path.isdir(path):
        sha.update(b"files\x00" + weights_digest(os.path.realpath(path)).encode())
    else:
        sha.update(json.dumps(["named", name, path]).encode())
    return int.from_bytes(sha.digest()[:8], "little")

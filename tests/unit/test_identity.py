"""Keys that name the model: the scope's model fingerprint, the vLLM engine fingerprint and LoRA
identity (no vLLM needed: its config objects are read by attribute), and worker engine bindings."""

from __future__ import annotations

import hashlib
import os
import shutil
from types import SimpleNamespace
from typing import Any

import pytest

from actors.cache.engines import EngineBindings
from raykv import ConfigError, InvalidArgumentError, KVLayout, MultimodalItem, ReuseScope, block_keys
from raykv.core.config import layout_difference
from raykv.core.keys import clip_mm_items
from raykv.integrations.vllm import identity
from raykv.integrations.vllm.layout import mla_layout
from raykv.integrations.vllm.plan import rank_scope

LAYOUT = KVLayout.uniform(2, 2, 64, 32, "float32")
FP = hashlib.sha256(b"a model").digest()


def test_a_scope_without_a_model_keeps_the_tensorrt_llm_bytes() -> None:
    assert ReuseScope().to_bytes() == b"\x00"
    assert ReuseScope(1, 2).to_bytes() == b"\x03" + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    assert ReuseScope(None, 2, FP).to_bytes() == b"\x06" + (2).to_bytes(8, "little") + FP
    assert ReuseScope(model=FP).to_bytes() == b"\x04" + FP


def test_the_model_fingerprint_separates_every_key() -> None:
    tokens = list(range(96))
    plain = block_keys(tokens, 32)
    other = hashlib.sha256(b"another model").digest()
    a = block_keys(tokens, 32, ReuseScope(model=FP))
    b = block_keys(tokens, 32, ReuseScope(model=other))
    assert len({*plain, *a, *b}) == 9
    assert a == block_keys(tokens, 32, ReuseScope().with_model(FP))
    assert rank_scope(ReuseScope(None, 5, FP), 1, 2).model == FP


@pytest.mark.parametrize("bad", [b"short", b"x" * 33, "a" * 32, bytearray(32)])
def test_a_model_fingerprint_is_32_bytes(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        ReuseScope(model=bad)


def test_clipped_multimodal_items_keep_the_keys_of_the_blocks_they_reach() -> None:
    tokens = list(range(100))
    items = (MultimodalItem.from_content(b"img", 40, 50),)
    whole = block_keys(tokens, 16, None, items)  # 6 full blocks
    clipped = clip_mm_items(items, 64)
    assert clipped == (MultimodalItem(items[0].digest, 40, 24),)
    assert block_keys(tokens[:64], 16, None, clipped) == whole[:4]
    assert clip_mm_items(items, 40) == ()


def _model_dir(path: str, weights: bytes, config: bytes = b'{"hidden_size": 8}') -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.write(config)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(weights)
    with open(os.path.join(path, "tokenizer.json"), "wb") as f:
        f.write(os.urandom(16))  # not part of the model's identity
    return path


def _vllm_config(model: str, **changes: Any) -> Any:
    fields = {
        "model": model,
        "revision": None,
        "dtype": "torch.float32",
        "quantization": None,
        "hf_overrides": {},
    }
    cache = {"cache_dtype": "auto", "kv_cache_dtype_skip_layers": []}
    return SimpleNamespace(
        model_config=SimpleNamespace(**{**fields, **changes}),
        cache_config=SimpleNamespace(**{k: changes.get(k, v) for k, v in cache.items()}),
        load_config=SimpleNamespace(load_format=changes.get("load_format", "auto")),
    )


def _fp(config: Any, layout: KVLayout = LAYOUT, ranks: int = 1, **extra: Any) -> bytes:
    identity.weights_digest.cache_clear()
    return identity.model_fingerprint(config, layout, ranks, extra)


def test_copies_of_the_same_weights_share_and_other_weights_do_not(tmp_path: Any) -> None:
    a = _model_dir(str(tmp_path / "a"), b"weights-A" * 1000)
    copy = str(tmp_path / "copy")
    shutil.copytree(a, copy)
    with open(os.path.join(copy, "tokenizer.json"), "wb") as f:
        f.write(b"changed")
    b = _model_dir(str(tmp_path / "b"), b"weights-B" * 1000)
    fa = _fp(_vllm_config(a))
    assert len(fa) == 32
    assert _fp(_vllm_config(copy)) == fa
    assert _fp(_vllm_config(b)) != fa
    assert _fp(_vllm_config(b), model_id="llama-ft") == _fp(_vllm_config(a), model_id="llama-ft")


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "torch.bfloat16"},
        {"cache_dtype": "fp8"},
        {"quantization": "fp8"},
        {"load_format": "dummy"},
        {"hf_overrides": {"rope_theta": 1.0}},
    ],
)
def test_every_field_that_decides_the_bytes_changes_the_fingerprint(tmp_path: Any, change: Any) -> None:
    a = _model_dir(str(tmp_path / "a"), b"w" * 100)
    assert _fp(_vllm_config(a, **change)) != _fp(_vllm_config(a))


def test_the_page_layout_and_tensor_parallel_degree_change_the_fingerprint(tmp_path: Any) -> None:
    config = _vllm_config(_model_dir(str(tmp_path / "a"), b"w" * 100))
    base = _fp(config)
    assert _fp(config, KVLayout.uniform(2, 2, 64, 16, "float32")) != base
    assert _fp(config, KVLayout.uniform(2, 1, 64, 32, "float32"), ranks=2) != base
    assert _fp(config, mla_layout(2, 576, 32, "float32")) != base
    assert _fp(config) == base


def test_a_hub_model_is_named_by_name_and_revision() -> None:
    hub = _fp(_vllm_config("org/model", revision="abc"))
    assert hub == _fp(_vllm_config("org/model", revision="abc"))
    assert hub != _fp(_vllm_config("org/model", revision="def"))
    with pytest.raises(ConfigError):
        _fp(_vllm_config("org/model"), model_id="")


def test_hub_cache_blobs_are_named_by_their_content_hash(tmp_path: Any) -> None:
    """A weight file in a Hugging Face cache snapshot is a link to a blob named by its SHA-256:
    that name is its identity (no read), so two snapshots of one blob share."""
    sha = hashlib.sha256(b"blob").hexdigest()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / sha).write_bytes(b"blob")
    snaps = []
    for name in ("s1", "s2"):
        snap = tmp_path / name
        snap.mkdir()
        (snap / "config.json").write_bytes(b"{}")
        os.symlink(blobs / sha, snap / "model.safetensors")
        snaps.append(str(snap))
    identity.weights_digest.cache_clear()
    assert identity.weights_digest(snaps[0]) == identity.weights_digest(snaps[1])


def test_weights_past_the_budget_are_sampled_and_still_told_apart(tmp_path: Any) -> None:
    size = identity.SAMPLES * identity.SAMPLE_BYTES * 2
    a = _model_dir(str(tmp_path / "a"), bytes(size))
    b = _model_dir(str(tmp_path / "b"), bytes(size - 1) + b"\x01")  # the last sample differs
    identity.weights_digest.cache_clear()
    da, db = identity.weights_digest(a, 0), identity.weights_digest(b, 0)
    assert da != db and da == identity.weights_digest(a + "/", 0)  # a path is a path
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError):
        identity.weights_digest(str(tmp_path / "empty"))


def test_lora_adapters_are_named_by_content_not_by_engine_number(tmp_path: Any) -> None:
    one = _model_dir(str(tmp_path / "one"), b"adapter-1")
    two = _model_dir(str(tmp_path / "two"), b"adapter-2")
    lora = identity.lora_identity
    assert lora(SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=one)) == lora(
        SimpleNamespace(lora_name="y", lora_int_id=7, lora_path=one)
    )
    assert lora(SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=one)) != lora(
        SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=two)
    )
    remote = lora(SimpleNamespace(lora_name="x", lora_int_id=1, lora_path="s3://bucket/x"))
    assert remote != lora(SimpleNamespace(lora_name="z", lora_int_id=1, lora_path="s3://bucket/x"))
    assert 0 <= remote < 2**64


def test_a_worker_takes_the_first_engines_layout_and_refuses_a_second_one_briefly() -> None:
    bindings = EngineBindings(engine_layouts=True)
    default = KVLayout.uniform(8, 8, 128, 16)
    mla = mla_layout(2, 576, 16, "float32")
    assert bindings.needs_relayout("e1", LAYOUT, default, "llama")
    bindings.bind("e1", "llama", "ab")
    assert not bindings.needs_relayout("e2", LAYOUT, LAYOUT, "llama")
    with pytest.raises(ConfigError) as err:
        bindings.needs_relayout("e3", mla, LAYOUT, "deepseek")
    text = str(err.value)
    assert len(text) < 300 and "pool=" in text and "llama" in text and "kv_latent" in text
    assert bindings.needs_relayout("e1", mla, LAYOUT, "deepseek")  # e1 itself may move on
    bindings.unbind("e1")
    assert bindings.needs_relayout("e3", mla, LAYOUT, "deepseek")
    fixed = EngineBindings(engine_layouts=False)
    with pytest.raises(ConfigError) as err:
        fixed.needs_relayout("e1", LAYOUT, default, "llama")
    assert len(str(err.value)) < 300 and "without a layout" in str(err.value)


def test_layout_difference_names_only_the_fields_that_differ() -> None:
    default = KVLayout.uniform(8, 8, 128, 16)
    assert layout_difference(default, default) == ""
    assert layout_difference(default, KVLayout.uniform(8, 8, 128, 32)) == "tokens_per_block 16 -> 32"
    assert layout_difference(default, KVLayout.uniform(8, 2, 128, 16)) == "k per token [8, 128] -> [2, 128]"
    assert (
        layout_difference(default, KVLayout.uniform(8, 8, 128, 16, "bfloat16")) == "dtype float16 -> bfloat16"
    )

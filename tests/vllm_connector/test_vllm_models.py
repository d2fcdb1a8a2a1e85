"""Keys that name the model: engines of two models on one deployment never load each other's KV,
each still shares its own across engine processes, and a deployment started without a layout
serves engines of any model (each worker takes its engine's layout).

Engines start in ~30-45 s each on 2 cores, so each test starts only the engines it needs and shuts
them down before the next one starts.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

import ray  # noqa: E402

from actors.cache.cluster import RayKVCluster  # noqa: E402
from actors.vllm.link import RayDeploymentLink  # noqa: E402
from raykv import ConfigError, ReuseScope  # noqa: E402

from .helpers import TPB, held, prompt, wait_held, worker  # noqa: E402

# Among the longest engine tests (eight engines, ~3.5 min on 2 cores): deselected by default,
# run by CI with `pytest -m ci_only` (pyproject.toml, .ci/run).
pytestmark = pytest.mark.ci_only


@contextlib.contextmanager
def _llm(
    model: str, namespace: str | None, ray_address: str, worker: int = 0, **engine: Any
) -> Iterator[Any]:
    """An engine of ``model`` (``engine`` settings), with RaykvConnector paired with ``worker``
    of the deployment in ``namespace`` (None: no connector); shut down on exit."""
    from vllm import LLM

    from raykv.integrations.vllm import testing

    kwargs = testing.engine_kwargs(model, **engine)
    if namespace is not None:
        kwargs["kv_transfer_config"] = testing.connector_config(namespace, ray_address, worker=worker)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        testing.shutdown_engine(llm)


def _scope(result: Any) -> ReuseScope:
    """The scope of a request's keys: its engine's model fingerprint, as the connector reports it."""
    return ReuseScope(model=bytes.fromhex(result.raykv["model"]))


@pytest.mark.timeout(900)
def test_two_models_of_one_architecture_never_load_each_others_blocks(
    model_dir: str,
    deployment: RayKVCluster,
    ray_address: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Model A (the session's tiny Llama) and model B (the same architecture, other random
    weights) paired with the same worker of one deployment laid out for that architecture.
    A stores two prompts; B, given them, loads none of A's blocks and generates what B does
    without a connector (before model fingerprints, B loaded A's KV and generated other tokens);
    B's repeat loads B's own blocks; a second engine process of B loads what the first stored,
    exactly; and a second engine process of A still loads A's."""
    from raykv.integrations.vllm import testing
    from raykv.integrations.vllm.testing import generate

    for key, value in testing.THREAD_ENV.items():
        monkeypatch.setenv(key, value)
    model_b = testing.save_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-b")), seed=1)
    prompts = [prompt(71, 10 * TPB + 3), prompt(72, 6 * TPB + 9)]
    ns = deployment.namespace
    with _llm(model_b, None, ray_address) as baseline_b:
        want_b = [generate(baseline_b, p) for p in prompts]
    with _llm(model_dir, None, ray_address) as baseline_a:
        want_a = [generate(baseline_a, p) for p in prompts]
    with _llm(model_dir, ns, ray_address, worker=0) as engine_a:
        stored = [generate(engine_a, p) for p in prompts]
        scope_a = _scope(stored[0])
        for p, got in zip(prompts, stored, strict=True):  # held before the engine's staging goes
            assert got.tokens == want_a[prompts.index(p)].tokens
            wait_held(deployment, 0, p, len(p) // TPB, scope_a)
    with _llm(model_b, ns, ray_address, worker=0) as engine_b:
        first_b = [generate(engine_b, p) for p in prompts]
        scope_b = _scope(first_b[0])
        assert scope_b != scope_a
        for got, want in zip(first_b, want_b, strict=True):
            assert got.raykv.get("hit_blocks", 0) == 0 and got.cached_tokens == 0  # none of A's
            assert got.tokens == want.tokens and got.logprobs == want.logprobs
        for p in prompts:
            wait_held(deployment, 0, p, len(p) // TPB, scope_b)
        again_b = generate(engine_b, prompts[0])
        assert again_b.raykv["loaded_blocks_ok"] == 10
        assert again_b.tokens == want_b[0].tokens
    with _llm(model_b, ns, ray_address, worker=0) as second_b:  # another engine process of B
        other_b = generate(second_b, prompts[1])
        assert other_b.raykv["loaded_blocks_ok"] == 6 and other_b.raykv.get("load_errors", 0) == 0
        assert other_b.tokens == want_b[1].tokens and other_b.logprobs == want_b[1].logprobs
    with _llm(model_dir, ns, ray_address, worker=1) as second_a:  # A's blocks, pulled from worker 0
        other_a = generate(second_a, prompts[0])
        assert other_a.raykv["hit_blocks"] == 10 and other_a.raykv["loaded_blocks_ok"] == 10
        assert other_a.tokens == want_a[0].tokens and other_a.logprobs == want_a[0].logprobs
    assert held(deployment, 0, prompts[0], scope_a).num_blocks == 10  # A's blocks never moved


@pytest.fixture()
def default_deployment(ray_address: str) -> Iterator[RayKVCluster]:
    """``raykv.start(num_workers=2)``: no config, no layout."""
    import raykv

    dep = raykv.start(num_workers=2, namespace=f"raykv-default-{uuid.uuid4().hex[:8]}")
    try:
        yield dep
    finally:
        dep.shutdown()


@pytest.mark.timeout(900)
def test_a_default_deployment_serves_a_llama_and_an_mla_engine_at_once(
    default_deployment: RayKVCluster,
    model_dir: str,
    ray_address: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``raykv.start(num_workers=2)``, then an engine of the tiny Llama (worker 0) and one of
    the tiny DeepSeek-V2 MLA model (worker 1), both running: each worker takes its engine's
    layout, each engine's repeat loads its own blocks and generates what its first run did;
    the MLA layout offered to the Llama's worker is one short ConfigError naming the fields."""
    from raykv.integrations.vllm import testing
    from raykv.integrations.vllm.testing import generate

    for key, value in testing.THREAD_ENV.items():
        monkeypatch.setenv(key, value)
    dep, ns = default_deployment, default_deployment.namespace
    mla = testing.save_tiny_mla(str(tmp_path_factory.mktemp("tiny-mla")))
    block = testing.MLA_BLOCK_SIZE
    llama_prompt, mla_prompt = prompt(81, 5 * TPB + 7), prompt(82, 6 * block + 5)
    with (
        _llm(model_dir, ns, ray_address, worker=0) as llama,
        _llm(mla, ns, ray_address, worker=1, block_size=block) as deepseek,
    ):
        bindings = ray.get([worker(dep, i).binding.remote() for i in (0, 1)], timeout=30)
        assert bindings[0]["layout"] == testing.tiny_layout()
        assert bindings[1]["layout"] == testing.tiny_mla_layout()
        first_llama, first_mla = generate(llama, llama_prompt), generate(deepseek, mla_prompt)
        wait_held(dep, 0, llama_prompt, 5, _scope(first_llama), timeout=30)
        wait_held(dep, 1, mla_prompt, 6, _scope(first_mla), timeout=30)
        again_llama, again_mla = generate(llama, llama_prompt), generate(deepseek, mla_prompt)
        link = RayDeploymentLink({"namespace": ns, "ray_address": ray_address, "worker": 0})
        with pytest.raises(ConfigError) as err:  # the MLA layout on the Llama's worker, as its engine would
            link.bind(testing.tiny_mla_layout(), "tiny-mla", bytes(32))
        link.close()
    assert again_llama.raykv["loaded_blocks_ok"] == 5 and again_llama.raykv.get("load_errors", 0) == 0
    assert again_llama.tokens == first_llama.tokens and again_llama.logprobs == first_llama.logprobs
    assert again_mla.raykv["loaded_blocks_ok"] == 6 and again_mla.raykv.get("load_errors", 0) == 0
    assert again_mla.tokens == first_mla.tokens  # CPU_MLA: tokens equal (engines tests)
    message = str(err.value)
    assert len(message) < 300 and "kv_latent" in message and "pool=" in message, message
    assert "tiny-llama" in message and "/" not in message.split("serves")[-1], message

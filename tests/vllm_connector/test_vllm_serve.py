"""examples/vllm_serve.py on the tests' local Ray: Ray Serve LLM (``build_openai_app`` and
``build_pd_openai_app``) running vLLM engines with RaykvConnector, routed by raykv's
CacheAwareRouter, over HTTP on 127.0.0.1.

Checks content: every repeat of a system prompt lands on the replica whose worker holds it and
loads at least the system prompt's blocks through the connector, and no engine asks the index
where a request's blocks are (the router's answer came with the request); in the PD app the decode engine
(worker 1) loads the blocks the prefill engine (worker 0) stored and generates the same tokens
and logprobs as the routed app did for the same prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")
require("ray.serve.llm")

from ray_helpers import load_example  # noqa: E402

from actors.cache.cluster import RayKVCluster  # noqa: E402
from raykv.integrations.vllm.testing import BLOCK_SIZE  # noqa: E402

# Among the longest engine tests (eight Serve LLM engines, ~6 min on 2 cores): deselected by default,
# run by CI with `pytest -m ci_only` (pyproject.toml, .ci/run).
pytestmark = pytest.mark.ci_only


@pytest.fixture(scope="module")
def http_port(deployment: RayKVCluster) -> Iterator[int]:
    from ray import serve

    example = load_example("vllm_serve.py")
    port = int(example.free_port())
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


# four vLLM engines start inside Serve replicas (routed, then PD): 176 s on an idle 2-core VM;
# on a slow or loaded one the routed half alone took 8 minutes and the test ran past 900 s
@pytest.mark.timeout(1800)
def test_serve_llm_routes_repeats_to_their_holder_then_pd_matches_it(
    deployment: RayKVCluster, model_dir: str, http_port: int
) -> None:
    from ray import serve

    example = load_example("vllm_serve.py")
    serve.run(example.build_app(model_dir, deployment.namespace), name="routed", route_prefix="/")
    asked = _engine_index_queries(deployment)
    workers = example.verify(http_port, deployment)  # asserts holder and hits per request
    # the router's index answer came with each request: no engine asked the index again
    assert _engine_index_queries(deployment) == asked
    assert sorted(len(ws) for ws in workers.values()) == [3, 3]
    assert all(len(set(ws)) == 1 for ws in workers.values())
    reference = example.complete(http_port, example.pd_prompt(), cache_salt="reference")
    before = _prefilled(deployment, settle_s=1.0)  # the reference's report has landed
    assert _streamed(http_port, example.pd_prompt(), "reference") == example.output(reference)[0]
    _until(lambda: _prefilled(deployment) > before)  # a streamed response's prefill reaches the worker
    serve.delete("routed")

    serve.run(example.build_pd_app(model_dir, deployment.namespace), name="pd", route_prefix="/")
    stats = example.verify_pd(http_port, deployment, reference)  # worker 1 loaded, same output
    assert stats["hit_blocks"] == stats["loaded_blocks_ok"]
    assert stats["pulled_tokens"] == stats["hit_blocks"] * BLOCK_SIZE and stats["fetch_us"] > 0  # a pull
    serve.delete("pd")


def _engine_index_queries(deployment: RayKVCluster) -> int:
    """Queries the index shards answered in batches (``IndexClient.route_many``: the connector's
    lookups; a router and the test's own checks route one query per call)."""
    return sum(int(info["counters"].get("batched_queries", 0)) for info in deployment.index_info())


def _prefilled(deployment: RayKVCluster, settle_s: float = 0.0) -> int:
    """Prompt tokens the engines prefilled, by the timing totals they handed their workers
    (``CacheWorker.engine_timing``), after waiting ``settle_s``."""
    import time

    import ray

    time.sleep(settle_s)
    totals = ray.get([h.engine_timing.remote() for h in deployment.workers.values()], timeout=60)
    return sum(int(t[2]) for t in totals)


def _until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def _streamed(port: int, tokens: list[int], cache_salt: str) -> list[int]:
    """The token ids of a streamed greedy ``/v1/completions`` response (server-sent events,
    through RaykvLLMServer's load counting), checked to end with ``[DONE]``."""
    import json
    import urllib.request

    body = {
        "model": "tiny-llama",
        "prompt": tokens,
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
        "cache_salt": cache_salt,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    ids: list[int] = []
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            ids.extend(choice.get("token_ids") or [])
    return ids


@pytest.mark.timeout(1200)
def test_one_default_deployment_serves_an_app_of_two_models(
    deployment: RayKVCluster, model_dir: str, http_port: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``build_openai_app`` with two ``llm_configs`` (a Llama and a DeepSeek-V2-style MLA model)
    over one ``raykv.start(num_workers=2)`` (no layout): each replica claims its own worker, which
    takes its engine's layout; each model reuses its own blocks and never the other's."""
    import uuid

    import ray
    from ray import serve

    import raykv
    from raykv.integrations.vllm import testing

    example = load_example("vllm_serve.py")
    mla_dir = testing.save_tiny_mla(str(tmp_path_factory.mktemp("serve-mla")))
    shared = raykv.start(num_workers=2, namespace=f"raykv-two-{uuid.uuid4().hex[:8]}")
    try:
        app = example.build_two_model_app(model_dir, mla_dir, shared.namespace)
        serve.run(app, name="two", route_prefix="/")
        workers = example.verify_two_models(http_port, shared)
        layouts = {
            str(w): ray.get(h.binding.remote(), timeout=30)["layout"] for w, h in shared.workers.items()
        }
        assert layouts[workers[example.MODEL_ID]] == testing.tiny_layout()
        assert layouts[workers[example.MLA_ID]] == testing.tiny_mla_layout()
        serve.delete("two")
    finally:
        shared.shutdown()


@pytest.mark.timeout(1200)
def test_chat_and_text_are_routed_by_their_rendered_tokens(
    deployment: RayKVCluster, model_dir: str, http_port: int
) -> None:
    """Chat and text requests through Ray Serve LLM: the router renders them to the engine's
    prompt ids (equal to vLLM's, checked per turn), a conversation's later turns land on its
    holder and load the previous turn's blocks, a repeated text prompt too; a batch of text
    prompts (which the router does not render) is served, routed by load and counted."""
    from ray import serve

    from actors.serve.router import router_counters
    from raykv.routing.local_tokenizer import save_chat_tokenizer

    save_chat_tokenizer(model_dir)
    example = load_example("vllm_serve.py")
    serve.run(example.build_chat_app(model_dir, deployment.namespace), name="chat", route_prefix="/")
    served = example.verify_chat(http_port, model_dir)
    assert all(len(set(ws)) == 1 for ws in served.values()), served

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    name = next(d for d in serve.status().applications["chat"].deployments if "LLMServer" in d)
    handle = serve.get_deployment_handle(name, "chat").options(stream=True)
    batch = CompletionRequest(model="tiny-llama", prompt=["w1 w2 w3", "w4 w5"], max_tokens=2)
    chunks = list(handle.completions.remote(batch))  # served by the router in this process
    assert chunks and not any(getattr(c, "error", None) for c in chunks), chunks[:2]
    counts = router_counters()[next(d for d in router_counters() if "LLMServer" in d)]
    assert counts["unrendered_batch"] == 1 and counts["fallback"] >= 1, counts
    serve.delete("chat")

"""Ray Serve LLM (``ray.serve.llm``) with vLLM engines that use RaykvConnector, routed by raykv.

Two ``LLMServer`` replicas (a tiny random-weight Llama made locally, vLLM on CPU), each paired
with one raykv CacheWorker: :func:`actors.serve.llm.with_raykv` adds the connector to the
engine, the pairing server class and raykv's CacheAwareRouter to an ordinary ``LLMConfig``, and
Ray's own ``build_openai_app`` builds the OpenAI-compatible app.

The example sends ``/v1/completions`` requests (prompts as token ids) that share system prompts,
over HTTP on 127.0.0.1, and checks that every repeat of a system prompt went to the replica whose
worker holds it and loaded at least the system prompt's blocks through the connector (the
response's ``kv_transfer_params["raykv"]``).

Run: python examples/vllm_serve.py      (needs the ``vllm`` extra, see the README)
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import ray
from ray import serve

import raykv
from actors.serve.llm import with_raykv
from actors.serve.router import router_counters
from raykv import ReuseScope, block_keys
from raykv.integrations.vllm import testing

NAMESPACE = "raykv-vllm-serve"
MODEL_ID = "tiny-llama"
PREFIX_BLOCKS = 3
ROUTER: dict[str, Any] = {"time_budget_s": 2.0}
THINK_S = 1.0
"""The client's pause between requests. Serve tells the router a request finished from a
done-callback that can run after the client has read the response; a repeat sent at once could
find its holder still counted busy with the request before it (and rightly go elsewhere)."""


def llm_config(
    model_dir: str,
    namespace: str = NAMESPACE,
    replicas: int = 2,
    model_id: str = MODEL_ID,
    **engine_changes: Any,
) -> Any:
    """The ``LLMConfig`` of the example: CPU settings for vLLM (one CPU bundle per replica,
    float32, eager, one-block prefill chunks so outputs are exact), served with raykv."""
    from ray.serve.llm import LLMConfig

    engine = testing.engine_kwargs(model_dir, **engine_changes)
    engine.pop("model")
    config = LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_dir},
        engine_kwargs=engine,
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={"num_replicas": replicas, "max_ongoing_requests": 4},
        runtime_env={"env_vars": dict(testing.THREAD_ENV)},
    )
    return with_raykv(config, namespace, router=ROUTER)


def build_app(model_dir: str, namespace: str = NAMESPACE) -> Any:
    """The OpenAI app (``ray.serve.llm.build_openai_app``) over the raykv-served config."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(model_dir, namespace)]})


def build_pd_app(model_dir: str, namespace: str = NAMESPACE) -> Any:
    """Prefill/decode (``ray.serve.llm.build_pd_openai_app``): one prefill replica paired with
    worker 0 (``kv_producer``), one decode replica paired with worker 1 (``kv_consumer``); the
    decode engine loads the prompt's blocks that the prefill engine stored, pulled from worker 0
    into worker 1 by raykv."""
    from ray.serve.llm import build_pd_openai_app

    def config(role: str, worker: int) -> Any:
        plain = llm_config(model_dir, namespace, replicas=1)
        return with_raykv(plain, namespace, role=role, pool=[worker], router=ROUTER)

    return build_pd_openai_app(
        {"prefill_config": config("kv_producer", 0), "decode_config": config("kv_consumer", 1)}
    )


MLA_ID = "tiny-mla"


def build_two_model_app(llama_dir: str, mla_dir: str, namespace: str) -> Any:
    """One OpenAI app serving two models, a Llama and a DeepSeek-V2-style MLA model (one replica
    each), over one raykv deployment started without a layout: each replica claims a worker of
    its own node for its model, and that worker takes the engine's page layout."""
    from ray.serve.llm import build_openai_app

    llama = llm_config(llama_dir, namespace, replicas=1)
    mla = llm_config(mla_dir, namespace, replicas=1, model_id=MLA_ID, block_size=testing.MLA_BLOCK_SIZE)
    return build_openai_app({"llm_configs": [llama, mla]})


def verify_two_models(port: int, deployment: Any) -> dict[str, str]:
    """Each model's repeat of a prompt loads its own blocks through raykv on its own worker,
    exactly (same tokens as its first run); the MLA model, given the Llama's prompt, loads
    nothing of it. Returns the worker of each model."""
    rng = random.Random(13)
    tokens = [rng.randrange(1, 500) for _ in range(4 * testing.BLOCK_SIZE + 3)]
    workers = {}
    for model, block in ((MODEL_ID, testing.BLOCK_SIZE), (MLA_ID, testing.MLA_BLOCK_SIZE)):
        prompt = tokens if model == MODEL_ID else [t + 1 for t in tokens]
        first = complete(port, prompt, model=model)
        stats = raykv_stats(first)
        blocks = len(prompt) // block
        workers[model] = holder(deployment, prompt, blocks, stats["model"], block)
        again = complete(port, prompt, model=model)
        loaded = raykv_stats(again)
        assert loaded.get("loaded_blocks_ok", 0) == (len(prompt) - 1) // block, loaded
        assert loaded["worker"] == workers[model] and loaded["model"] == stats["model"], loaded
        assert output(again)[0] == output(first)[0], f"{model}: a repeat over loaded blocks differs"
    crossed = raykv_stats(complete(port, tokens, model=MLA_ID))  # the Llama's prompt, MLA's keys
    assert crossed.get("hit_blocks", 0) == 0, crossed
    assert workers[MODEL_ID] != workers[MLA_ID], workers
    return workers


def workload(num_prefixes: int = 2, repeats: int = 3) -> list[tuple[int, list[int]]]:
    """Interleaved requests: ``repeats`` per system prompt (PREFIX_BLOCKS blocks), own tails."""
    rng = random.Random(7)
    size = PREFIX_BLOCKS * testing.BLOCK_SIZE
    prefixes = [[rng.randrange(1, 500) for _ in range(size)] for _ in range(num_prefixes)]
    return [
        (p, prefix + [rng.randrange(1, 500) for _ in range(5 + 3 * r + p)])
        for r in range(repeats)
        for p, prefix in enumerate(prefixes)
    ]


def holder(
    deployment: Any, tokens: list[int], blocks: int, model: str, block_size: int = testing.BLOCK_SIZE
) -> str:
    """The worker holding ``blocks`` leading blocks of ``tokens`` of the model whose fingerprint
    is ``model`` (hex, as the connector reports it) and block size ``block_size`` once the index
    knows it (stores are pulled by the CacheWorker shortly after the engine computed them)."""
    deadline = time.monotonic() + 60.0
    keys = block_keys(tokens, block_size, ReuseScope(model=bytes.fromhex(model)))
    while True:
        deployment.flush()
        held = [str(w) for w, m in deployment.route_keys(keys).items() if m.blocks >= blocks]
        if held:
            return held[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker holds {blocks} blocks of the prompt")
        time.sleep(0.1)


def verify(port: int, deployment: Any) -> dict[int, list[str]]:
    """Send the workload one request at a time (THINK_S apart) and assert the example's claims;
    per system prompt, the workers that held each of its requests' blocks afterwards."""
    workers: dict[int, list[str]] = {}
    for prefix, tokens in workload():
        out = complete(port, tokens)
        stats = raykv_stats(out)
        served_by = str(stats.get("worker"))
        assert stats.get("prefilled_tokens", 0) > 0 and stats.get("prefill_us", 0) > 0, stats  # timed
        if prefix in workers:
            first = workers[prefix][0]
            assert served_by == first, f"prefix {prefix} left {first}: router {router_counters()}"
            assert stats.get("hit_blocks", 0) >= PREFIX_BLOCKS, stats
        assert holder(deployment, tokens, len(tokens) // testing.BLOCK_SIZE, stats["model"]) is not None
        workers.setdefault(prefix, []).append(served_by)
        time.sleep(THINK_S)
    return workers


def raykv_stats(response: dict[str, Any]) -> dict[str, Any]:
    """The connector's per-request results in a completion response (empty when none)."""
    return dict((response.get("kv_transfer_params") or {}).get("raykv") or {})


def output(response: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """Generated token ids and per-step top logprobs of a completion response."""
    choice = response["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["top_logprobs"])


PD_PROMPT_SEED = 11


def pd_prompt() -> list[int]:
    """A prompt of 3 blocks and a tail that the routed workload does not use."""
    rng = random.Random(PD_PROMPT_SEED)
    return [rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * testing.BLOCK_SIZE + 9)]


def complete(
    port: int, tokens: list[int], max_tokens: int = 4, cache_salt: str | None = None, model: str = MODEL_ID
) -> dict[str, Any]:
    """POST one greedy ``/v1/completions`` request with token ids (5 logprobs per step) to
    ``model``; the JSON response."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,  # logprobs keyed "token_id:N" (no tokenizer here)
        "return_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return post(port, "/v1/completions", body)


def verify_pd(port: int, deployment: Any, reference: dict[str, Any]) -> dict[str, Any]:
    """:func:`pd_prompt` through the PD app: the decode engine (worker 1) loaded the prompt's
    blocks that the prefill engine (worker 0) stored, and generated the same tokens and logprobs
    as ``reference`` (the routed app's response to the same prompt under another cache_salt, so
    nothing of it was cached for the PD run). Returns the decode side's connector results."""
    tokens = pd_prompt()
    out = complete(port, tokens)
    stats = raykv_stats(out)
    blocks = (len(tokens) - 1) // testing.BLOCK_SIZE
    assert stats.get("worker") == str(deployment.worker_ids[1]), stats
    assert stats.get("loaded_blocks_ok", 0) >= blocks and not stats.get("load_errors"), stats
    assert output(out) == output(reference), "PD output differs from one engine's"
    return stats


CHAT_TURNS = 3


def build_chat_app(model_dir: str, namespace: str = NAMESPACE) -> Any:
    """The routed app over engines that read chat and text (the model directory holds a
    tokenizer with a chat template; the router renders requests with it)."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(model_dir, namespace, skip_tokenizer_init=False)]})


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to ``path`` on the app; the JSON response (RuntimeError for an HTTP error)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            result: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None
    return result


def chat(port: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One greedy ``/v1/chat/completions`` request; the response carries the engine's prompt ids."""
    body = {
        "model": MODEL_ID,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    return post(port, "/v1/chat/completions", body)


def conversations(count: int = 2) -> list[list[str]]:
    """``count`` conversations' user turns (word text of the local tokenizer), each opened by its
    own 2-block system prompt."""
    from raykv.routing.local_tokenizer import FIRST_WORD, words

    rng = random.Random(17)
    out = []
    for _ in range(count):
        system = words(rng.randrange(FIRST_WORD, 500) for _ in range(2 * testing.BLOCK_SIZE))
        turns = [words(rng.randrange(FIRST_WORD, 500) for _ in range(20)) for _ in range(CHAT_TURNS)]
        out.append([system, *turns])
    return out


def verify_chat(port: int, model_dir: str) -> dict[int, list[str]]:
    """Multi-turn chats, the turns of both conversations interleaved, each turn re-sending the
    history with the replies: the engine's prompt ids equal the router's rendering (checked with
    the same tokenizer here), every later turn lands on the worker that served the first and
    loads at least the previous turn's full prompt blocks. Then a text prompt and its repeat:
    the repeat lands on its holder and loads. Returns the workers that served each conversation."""
    from raykv.routing.prompts import PromptRenderer

    renderer = PromptRenderer.from_pretrained(model_dir)
    talks = conversations()
    histories: list[list[dict[str, str]]] = [[{"role": "system", "content": t[0]}] for t in talks]
    previous = [0] * len(talks)
    served: dict[int, list[str]] = {}
    for turn in range(CHAT_TURNS):
        for c, talk in enumerate(talks):
            histories[c].append({"role": "user", "content": talk[turn + 1]})
            out = chat(port, histories[c])
            stats = raykv_stats(out)
            assert out["prompt_token_ids"] == renderer.chat(histories[c]), (
                "the router's ids differ from vLLM's"
            )
            if turn:
                assert stats.get("worker") == served[c][0], f"chat {c} left {served[c][0]}: {stats}"
                assert stats.get("hit_blocks", 0) >= previous[c] // testing.BLOCK_SIZE, stats
            served.setdefault(c, []).append(str(stats.get("worker")))
            previous[c] = len(out["prompt_token_ids"])
            histories[c].append(
                {"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""}
            )
            time.sleep(THINK_S)
    text = talks[0][1] + " " + talks[1][1] * 3
    body = {"model": MODEL_ID, "prompt": text, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    first = raykv_stats(post(port, "/v1/completions", body))
    time.sleep(THINK_S)
    again = raykv_stats(post(port, "/v1/completions", body))
    assert again.get("worker") == first.get("worker") and again.get("hit_blocks", 0) >= 1, (first, again)
    return served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    config = testing.deployment_config(testing.tiny_layout())
    deployment = raykv.start(num_workers=2, config=config, namespace=NAMESPACE)
    port = free_port()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            model_dir = testing.save_tiny_llama(os.path.join(workdir, "model"))
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            t0 = time.monotonic()
            serve.run(build_app(model_dir), name="raykv-vllm", route_prefix="/")
            print(f"Ray Serve LLM app up in {time.monotonic() - t0:.1f}s on 127.0.0.1:{port}")
            for prefix, ws in sorted(verify(port, deployment).items()):
                print(f"system prompt {prefix}: served by {ws}")
            print("repeated prefixes stayed on their holder and loaded their blocks through raykv. OK")
            reference = complete(port, pd_prompt(), cache_salt="reference")
            serve.delete("raykv-vllm")
            t0 = time.monotonic()
            serve.run(build_pd_app(model_dir), name="raykv-vllm-pd", route_prefix="/")
            print(f"PD app up in {time.monotonic() - t0:.1f}s")
            stats = verify_pd(port, deployment, reference)
            print(
                f"PD: decode on {stats['worker']} loaded {stats['loaded_blocks_ok']} blocks; same output. OK"
            )
            serve.shutdown()
    finally:
        deployment.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

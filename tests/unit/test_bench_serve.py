"""The pure parts of ``raykv bench serve``: the chat workload, the statistics and the report
(raykv.bench.serve_workload, serve_report, serve_timings). The run itself is
tests/vllm_connector/test_bench_serve.py."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
from deps import require

from raykv.bench.serve_client import RequestRecord
from raykv.bench.serve_report import ConfigResult, goal_lines, percentile, summarize, table
from raykv.bench.serve_timings import RouterTimings, phase_salt, policy_of, salt_phase
from raykv.bench.serve_workload import (
    Conversation,
    WorkloadConfig,
    active_sessions,
    auto_sessions,
    build_workload,
    conversations,
)

QUICK = WorkloadConfig(rate=3.5, duration_s=10.0, turns=(3, 5), min_think_s=1.0, think_s=1.0)
LONG = WorkloadConfig(rate=4.0, duration_s=300.0, turns=(4, 9), min_think_s=2.0, think_s=2.0)


def test_workload_is_a_function_of_its_config() -> None:
    assert build_workload(QUICK) == build_workload(QUICK)
    other = build_workload(QUICK.with_changes(seed=1))
    assert other.requests != build_workload(QUICK).requests


@pytest.mark.parametrize("config", [QUICK, LONG, LONG.with_changes(seed=3)])
def test_schedule_keeps_order_think_times_and_the_rate(config: WorkloadConfig) -> None:
    w = build_workload(config)
    times = [r.at_s for r in w.requests]
    assert times == sorted(times) and times[-1] <= config.duration_s
    assert [r.index for r in w.requests] == list(range(len(w.requests)))
    by_session: dict[int, list] = defaultdict(list)
    for r in w.requests:
        by_session[r.session].append(r)
    for sid, turns in by_session.items():
        assert [t.turn for t in turns] == list(range(len(turns)))  # no turn skipped
        assert len(turns) <= w.sessions[sid].turns
        assert sum(t.last for t in turns) == 1 and turns[-1].last
        for a, b in itertools.pairwise(turns):
            assert b.at_s - a.at_s >= config.min_think_s - 1e-9  # a session thinks between turns
    if config.duration_s >= 300:  # a Poisson stream of the configured rate
        assert w.offered_rate == pytest.approx(config.rate, rel=0.12)
        # sessions arrive through the run and the number talking stays about level
        firsts = sorted(turns[0].at_s for turns in by_session.values())
        assert firsts[-1] > 0.8 * config.duration_s
        mid = [
            active_sessions(w, t)
            for t in (0.3 * config.duration_s, 0.5 * config.duration_s, 0.7 * config.duration_s)
        ]
        assert max(mid) <= 3 * min(mid)
        assert max(r.turn for r in w.requests) >= config.turns[1] - 2  # histories grow long
        total = sum(len(r.user.split()) + config.max_tokens + 6 for r in w.requests)
        assert 0 < w.working_set_tokens(config.duration_s / 2) < total
        assert 0 < w.mean_working_set() < total


def test_auto_sessions_and_explicit_sessions() -> None:
    assert len(build_workload(QUICK).sessions) == auto_sessions(QUICK)
    few = build_workload(LONG.with_changes(sessions=10))
    assert len(few.sessions) == 10
    assert few.offered_rate < LONG.rate  # too few sessions for the rate: the offered rate says so


def test_conversation_resends_the_whole_history() -> None:
    w = build_workload(QUICK)
    talk = conversations(w)[w.requests[0].session]
    first = talk.ask("w1 w2")
    assert first[0] == {"role": "system", "content": w.system_texts[w.sessions[w.requests[0].session].system]}
    talk.answer("w9 w8")
    second = talk.ask("w3")
    assert second[: len(first)] == first  # a prefix: the engine's cache can serve it
    assert second[len(first) :] == [
        {"role": "assistant", "content": "w9 w8"},
        {"role": "user", "content": "w3"},
    ]
    assert Conversation("s").ask("u") == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
    ]


def test_max_prompt_tokens_bounds_the_rendered_prompts() -> None:
    require("transformers")
    from raykv.routing.local_tokenizer import build_chat_tokenizer

    tok = build_chat_tokenizer(QUICK.vocab_size)
    w = build_workload(QUICK)
    talks = conversations(w)
    reply = " ".join(["w7"] * QUICK.max_tokens)
    longest = 0
    for r in w.requests:
        messages = talks[r.session].ask(r.user)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        longest = max(longest, len(ids))
        talks[r.session].answer(reply)
    assert 0 < longest <= w.max_prompt_tokens()


def test_phase_salts() -> None:
    salt = phase_salt("prefix-affinity", "abc123")
    assert "/" not in salt and len(salt) <= 128  # vLLM refuses '/' in a cache_salt
    assert salt_phase(salt) == "prefix-affinity" and salt_phase("other") is None and salt_phase(None) is None
    assert policy_of("warmup-raykv") == "raykv" and policy_of("raykv-pow2") == "raykv-pow2"


def _record(i: int, ttft: float, cached: int = 10, error: str | None = None) -> RequestRecord:
    r = RequestRecord(i, i % 3, i // 3, planned_s=i * 0.25, sent_s=i * 0.25)
    if error is None:
        r.first_s, r.last_s, r.end_s = r.sent_s + ttft, r.sent_s + ttft + 0.11, r.sent_s + ttft + 0.12
        r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.usage = 100, cached, 12, True
    else:
        r.error = error
    return r


def test_summarize_and_report() -> None:
    assert math.isnan(percentile([], 50)) and percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    records = [_record(i, 0.1 + 0.01 * i) for i in range(20)] + [_record(20, 0.0, error="Boom: x")]
    timings = RouterTimings()
    for i in range(21):
        timings.add("raykv", 0.002, f"r{i}")
    timings.add("raykv", 0.004, "r0")  # a second call for one request (Serve retried it)
    timings.add_routed("raykv", 0.001, "a")
    timings.add_routed("raykv", 0.001, "b")
    timings.add_routed("raykv", 0.001, "b")
    timings.set_counters("raykv", {"cache_routed": 20})
    res = summarize("raykv", records, 4.0, timings.get("raykv"))
    assert (res.requests, res.completed, res.errors) == (21, 20, 1)
    assert res.ttft_p50_s == pytest.approx(0.195) and res.ttft_p90_s > res.ttft_p50_s
    assert res.itl_p50_s == pytest.approx(0.01)
    assert res.cached_tokens == 200 and res.cached_fraction == pytest.approx(0.1)
    assert res.decision_calls == 22 and res.decision_requests == 21
    assert res.decision_per_request_s == pytest.approx(0.046 / 21)
    assert res.router_counters == {"cache_routed": 20} and res.error_samples == ["Boom: x"]
    assert res.replica_split == [2, 1] and res.routed_callback_total_s == pytest.approx(0.003)
    assert res.throughput_rps == pytest.approx(19 / (19 * 0.25 + 0.19))  # first to last completion
    assert res.kept_up  # 4.3 req/s completed of 4 offered, nothing late, TTFT not growing
    assert res.to_json()["records"][20]["error"] == "Boom: x"
    slow = summarize("pow2", [_record(i, 0.1 * 2**i) for i in range(9)], 4.0)
    assert slow.ttft_growth > 2 and slow.drain_s > 5 and not slow.kept_up  # a backlog at the end
    text = table([res, slow])
    assert "| raykv | 20/21 | 1 |" in text and "| pow2 |" in text and "| 2/1 | yes |" in text
    affinity = ConfigResult(**{**res.__dict__, "name": "prefix-affinity", "ttft_p90_s": 2 * res.ttft_p90_s})
    goals = goal_lines([slow, affinity, res])
    assert goals[0].startswith("goal: raykv TTFT p90 / prefix-affinity TTFT p90 = 0.50") and "met" in goals[0]
    assert "= 1.00" in goals[1] and goals[2].startswith("pow2 kept up with the offered rate: NO")


@pytest.mark.parametrize("engines", ["shared", "separate"])
def test_app_configs_route_each_config_as_named(engines: str) -> None:
    """The LLMConfigs of the bench's app (no Ray needed): engines with prefix caching, the
    engine's cached-token counts and the chat tokenizer; the routers by import path with their
    settings; raykv's router renders chats with the model's tokenizer."""
    require("ray.llm")
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

    from actors.bench import serve_routers as routers
    from actors.bench.serve_app import (
        PREFIX_AFFINITY,
        deployments_of,
        llm_config,
        model_of,
        settings_for,
    )

    s = settings_for(quick=True, engines=engines)
    models = deployments_of(s)
    if engines == "shared":
        assert models == {"bench-plain": ("pow2", "prefix-affinity"), "bench-raykv": ("raykv", "raykv-pow2")}
    else:
        assert models == {f"bench-{n}": (n,) for n in ("pow2", "prefix-affinity", "raykv", "raykv-pow2")}
    assert model_of(s, "raykv-pow2") == ("bench-raykv" if engines == "shared" else "bench-raykv-pow2")
    paths = {}
    for model in models:
        cfg = llm_config(s, model, "/models/m", 1024, "bench-ns", "raykv-ns" if "raykv" in model else "")
        engine = cfg.engine_kwargs
        assert engine["enable_prefix_caching"] and engine["enable_prompt_tokens_details"]
        assert not engine["skip_tokenizer_init"] and engine["num_gpu_blocks_override"] == s.engine_blocks
        assert cfg.placement_group_config == {"bundles": [{"CPU": s.cpu_per_replica}]}
        assert cfg.deployment_config["num_replicas"] == s.replicas
        assert cfg.callback_config.callback_class.endswith(":LocalModelCallback")
        router = cfg.deployment_config["request_router_config"]
        kwargs = router.request_router_kwargs
        assert kwargs["bench_namespace"] == "bench-ns"
        paths[model] = router.request_router_class
        if "raykv" in model:
            assert engine["kv_transfer_config"]["kv_connector"] == "RaykvConnector"
        if model == "bench-raykv":  # raykv's router, on the shared raykv engines or its own
            assert kwargs["namespace"] == "raykv-ns" and kwargs["tokenizer"] == "/models/m"
        if model in ("bench-plain", "bench-prefix-affinity"):
            assert kwargs["imbalanced_threshold"] == PREFIX_AFFINITY["imbalanced_threshold"]
    classes = {m: getattr(routers, p.split(":")[1]) for m, p in paths.items()}
    if engines == "shared":
        assert classes == {"bench-plain": routers.PlainPhaseRouter, "bench-raykv": routers.RaykvPhaseRouter}
        # Serve's power of two choices runs on the raykv router: it has the state that reads
        assert hasattr(routers.RaykvPhaseRouter, "apply_locality_routing")
    else:
        assert classes["bench-pow2"] is classes["bench-raykv-pow2"] is routers.TimedPow2Router
        assert issubclass(routers.TimedPow2Router, PowerOfTwoChoicesRequestRouter)

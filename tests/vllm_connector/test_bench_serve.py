"""``raykv bench serve --quick`` on the tests' local Ray: Ray Serve LLM over HTTP (127.0.0.1),
multi-turn chat through every compared config (pow2, prefix-affinity, raykv, raykv-pow2), via
the function the CLI calls.

Checks content, never timing: every config served every request with usage reported, the
figures are positive and ordered, every router was timed for every request, raykv's router
rendered the chats and routed by cache, raykv reused prefix tokens, and no config started with
blocks another had computed (each config's first request, a cold system prompt, reused nothing).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")
require("ray.serve.llm")
pytest.importorskip("openai")

# Among the longest engine tests (four Serve LLM engines, ~4 min on 2 cores): deselected by default,
# run by CI with `pytest -m ci_only` (pyproject.toml, .ci/run).
pytestmark = pytest.mark.ci_only


# 4 vLLM engines start in Serve replicas (~2-2.5 min on an idle 2-core VM), then 4 phases of ~10 s
@pytest.mark.timeout(1200)
def test_quick_bench_serves_every_request_and_raykv_reuses_prefixes(ray_address: str, tmp_path: Path) -> None:
    from actors.bench.serve import CONFIGS, run_serve_bench, settings_for
    from raykv.bench.serve_report import plot

    out = run_serve_bench(settings_for(quick=True), progress=False)
    results = {r["name"]: r for r in out["results"]}
    assert list(results) == list(CONFIGS)
    n = out["settings"]["requests"]
    assert n >= 10 and out["settings"]["deployments"] == {
        "bench-plain": ["pow2", "prefix-affinity"],
        "bench-raykv": ["raykv", "raykv-pow2"],
    }
    for name, r in results.items():
        assert (r["requests"], r["completed"], r["errors"]) == (n, n, 0), (name, r["error_samples"])
        assert r["no_usage"] == 0, name  # every stream ended with its usage
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"] < 120, name
        assert r["itl_p50_s"] > 0 and r["throughput_rps"] > 0 and r["offered_rps"] > 0, name
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"] and r["prompt_tokens"] > n * 300, name
        # the router was timed for every request it routed (a retried request may take more calls)
        assert r["decision_requests"] >= n and r["decision_calls"] >= r["decision_requests"], name
        assert r["decision_total_s"] > 0 and not math.isnan(r["decision_p50_s"]), name
        records = r["records"]
        assert [(x["session"], x["turn"]) for x in records] == [
            (x["session"], x["turn"]) for x in results["pow2"]["records"]
        ]  # the same workload for every config
        # nothing shared across configs: the first request (a cold system prompt) reused nothing
        assert records[0]["turn"] == 0 and records[0]["cached_tokens"] == 0, name
    assert results["raykv"]["cached_tokens"] > 0  # the engines' own count: prefix cache plus raykv loads
    counters = results["raykv"]["router_counters"]
    assert counters.get("rendered", 0) >= n and counters.get("cache_routed", 0) > 0, counters
    assert results["prefix-affinity"]["routed_callback_total_s"] > 0  # its prefix tree took the prompts
    assert "| raykv |" in out["table"] and len(out["goals"]) == 3
    png = plot(out["_results"], str(tmp_path / "bench_serve.png"), "test")
    assert Path(png).stat().st_size > 10_000

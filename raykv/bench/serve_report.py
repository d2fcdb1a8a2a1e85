"""Statistics, table, goal lines and plot of ``raykv bench serve`` (pure: no Ray; matplotlib is
imported by :func:`plot` only).

:func:`summarize` turns one config's request records (:class:`raykv.bench.serve_client.
RequestRecord`) and its router's timings into a :class:`ConfigResult`:

- TTFT p50/p90/p99 (send to first streamed content) and inter-token latency p50 (per request,
  first to last content over its output tokens after the first), over completed requests;
- throughput: completions per second from the first completion to the last, next to the offered
  rate (planned sends per second from the first send to the last): the two match when the
  server keeps pace, however long the requests take;
- prefix tokens reused: the engines' ``cached_tokens`` summed, and as a fraction of prompt tokens;
- router decision time: every ``choose_replicas`` call of the config's router, timed in the
  router (:mod:`actors.bench.serve_routers`), per request (all calls for it) and per call; plus
  its ``on_request_routed`` callbacks;
- keeping up: completed rate >= 0.9 x offered, and queueing not growing: late sends (a turn that
  waited for its previous reply past its planned time: the server answered slower than the user
  thinks) p90 at most ``LATE_LIMIT_S``, and the last reply within ``DRAIN_LIMIT_S`` of the last
  planned send (no backlog). ``ttft_growth`` (median TTFT of the last third of requests over the
  middle third's) is reported, not judged: histories grow through the run, and so does prefill.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from raykv.bench.serve_client import RequestRecord

KEEP_UP_RATIO = 0.9
LATE_LIMIT_S = 1.0
DRAIN_LIMIT_S = 5.0
GOAL_TTFT_P90 = 0.7  # raykv / prefix-affinity, at most
GOAL_THROUGHPUT = 1.0  # raykv / prefix-affinity, at least


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class ConfigResult:
    name: str
    requests: int
    completed: int
    errors: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p50_s: float
    throughput_rps: float
    offered_rps: float
    prompt_tokens: int
    cached_tokens: int
    decision_requests: int
    decision_calls: int
    decision_total_s: float
    decision_p50_s: float
    decision_p99_s: float
    routed_callback_total_s: float
    late_p90_s: float
    ttft_growth: float
    no_usage: int
    replica_split: list[int] = field(default_factory=list)  # requests per replica, most first
    drain_s: float = math.nan  # last completion after the last planned send
    router_counters: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)  # every completed request's, in request order
    records: list[dict[str, Any]] = field(default_factory=list)  # per request (record_json)

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decision_per_request_s(self) -> float:
        n = self.decision_requests or self.completed
        return self.decision_total_s / n if n else math.nan

    @property
    def kept_up(self) -> bool:
        return (
            self.throughput_rps >= KEEP_UP_RATIO * self.offered_rps
            and self.late_p90_s <= LATE_LIMIT_S
            and not self.drain_s > DRAIN_LIMIT_S
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            cached_fraction=self.cached_fraction,
            decision_per_request_s=self.decision_per_request_s,
            kept_up=self.kept_up,
        )
        return out


def summarize(
    name: str, records: Sequence[RequestRecord], offered_rps: float, timings: Mapping[str, Any] | None = None
) -> ConfigResult:
    """One config's result (module docstring). ``timings``: the router's, as
    :meth:`actors.bench.serve_routers.RouterTimings.get` returns them."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for x in (r.itl_s for r in ok) if x is not None]
    ends = sorted(r.end_s or 0.0 for r in ok)
    # completions per second between the first and the last, as the offered rate is sends per
    # second between the first and the last: equal when the server keeps pace
    throughput = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0
    third = len(ttfts) // 3
    middle, late = ttfts[third : 2 * third], ttfts[2 * third :]
    growth = percentile(late, 50) / percentile(middle, 50) if middle and late else math.nan
    t = dict(timings or {})
    choose = [float(x) for x in t.get("choose_s", ())]
    errors = [r.error for r in records if r.error]
    return ConfigResult(
        name=name,
        requests=len(records),
        completed=len(ok),
        errors=len(records) - len(ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        throughput_rps=throughput,
        offered_rps=offered_rps,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        decision_requests=int(t.get("requests", 0)),
        decision_calls=len(choose),
        decision_total_s=sum(choose),
        decision_p50_s=percentile(choose, 50),
        decision_p99_s=percentile(choose, 99),
        routed_callback_total_s=sum(float(x) for x in t.get("routed_s", ())),
        late_p90_s=max(0.0, percentile([r.sent_s - r.planned_s for r in records if r.sent_s], 90)),
        ttft_growth=growth,
        no_usage=sum(1 for r in ok if not r.usage),
        replica_split=[int(x) for x in t.get("replicas", ())],
        drain_s=(max(r.end_s or 0.0 for r in ok) - max(r.planned_s for r in records)) if ok else math.nan,
        router_counters=dict(t.get("counters", {})),
        error_samples=sorted(set(e for e in errors if e))[:5],
        ttfts_s=ttfts,
        records=[record_json(r) for r in records],
    )


def record_json(r: RequestRecord) -> dict[str, Any]:
    """One request's outcome, compact."""
    return {
        "session": r.session,
        "turn": r.turn,
        "planned_s": round(r.planned_s, 4),
        "sent_s": round(r.sent_s, 4),
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 5),
        "itl_s": None if r.itl_s is None else round(r.itl_s, 5),
        "end_s": None if r.end_s is None else round(r.end_s, 4),
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "error": r.error,
    }


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}"


def _us(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e6:.0f}"


def table(results: Sequence[ConfigResult]) -> str:
    """A markdown table, one row per config."""
    head = (
        "| config | done/sent | errors | TTFT p50 ms | p90 ms | p99 ms | ITL p50 ms | req/s (offered) "
        "| cached tokens (of prompt) | decision us/req (p50, p99 per call) | split | kept up |"
    )
    rule = "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"
    lines = [head, rule]
    for r in results:
        lines.append(
            f"| {r.name} | {r.completed}/{r.requests} | {r.errors} "
            f"| {_ms(r.ttft_p50_s)} | {_ms(r.ttft_p90_s)} | {_ms(r.ttft_p99_s)} | {_ms(r.itl_p50_s)} "
            f"| {r.throughput_rps:.2f} ({r.offered_rps:.2f}) "
            f"| {r.cached_tokens} ({r.cached_fraction:.0%}) "
            f"| {_us(r.decision_per_request_s)} ({_us(r.decision_p50_s)}, {_us(r.decision_p99_s)}) "
            f"| {'/'.join(str(x) for x in r.replica_split) or '-'} | {'yes' if r.kept_up else 'NO'} |"
        )
    return "\n".join(lines)


def goal_lines(results: Sequence[ConfigResult]) -> list[str]:
    """The goal lines: raykv vs prefix-affinity TTFT p90 and throughput; whether pow2 kept up."""
    by = {r.name: r for r in results}
    out: list[str] = []
    ours, theirs = by.get("raykv"), by.get("prefix-affinity")
    if ours is not None and theirs is not None:
        ttft = ours.ttft_p90_s / theirs.ttft_p90_s if theirs.ttft_p90_s > 0 else math.nan
        tput = ours.throughput_rps / theirs.throughput_rps if theirs.throughput_rps > 0 else math.nan
        out.append(
            f"goal: raykv TTFT p90 / prefix-affinity TTFT p90 = {ttft:.2f} (goal <= {GOAL_TTFT_P90}: "
            f"{'met' if ttft <= GOAL_TTFT_P90 else 'NOT met'})"
        )
        out.append(
            f"goal: raykv throughput / prefix-affinity throughput = {tput:.2f} (goal >= {GOAL_THROUGHPUT}: "
            f"{'met' if tput >= GOAL_THROUGHPUT else 'NOT met'})"
        )
    pow2 = by.get("pow2")
    if pow2 is not None:
        out.append(
            f"pow2 kept up with the offered rate: {'yes' if pow2.kept_up else 'NO'} "
            f"(completed {pow2.throughput_rps:.2f} req/s of {pow2.offered_rps:.2f} offered, "
            f">= {KEEP_UP_RATIO:.0%} needed; late sends p90 {pow2.late_p90_s:.2f} s, <= {LATE_LIMIT_S:g} s; "
            f"last reply {pow2.drain_s:.1f} s after the last send, <= {DRAIN_LIMIT_S:g} s)"
        )
    return out


def plot(results: Sequence[ConfigResult], path: str, title: str = "") -> str:
    """The TTFT CDF per config and one bar chart per figure (TTFT p90, throughput, cached
    fraction, decision time per request) to ``path`` (PNG); returns ``path``."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(13, 6.2))
    grid = fig.add_gridspec(2, 3, width_ratios=[1.6, 1, 1])
    cdf = fig.add_subplot(grid[:, 0])
    colors = {r.name: f"C{i}" for i, r in enumerate(results)}
    for r in results:
        xs = sorted(t * 1e3 for t in r.ttfts_s)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            cdf.step(xs, ys, where="post", label=r.name, color=colors[r.name])
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("time to first token, CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    metrics = [
        ("TTFT p90 (ms)", [r.ttft_p90_s * 1e3 for r in results], "{:.0f}"),
        ("completed req/s", [r.throughput_rps for r in results], "{:.2f}"),
        ("prompt tokens from cache", [r.cached_fraction for r in results], "{:.0%}"),
        ("router decision (ms/request)", [r.decision_per_request_s * 1e3 for r in results], "{:.2f}"),
    ]
    names = [r.name for r in results]
    for i, (label, values, fmt) in enumerate(metrics):
        ax = fig.add_subplot(grid[i // 2, 1 + i % 2])
        vals = [0.0 if math.isnan(v) else v for v in values]
        ax.bar(range(len(names)), vals, color=[colors[n] for n in names])
        for x, v in enumerate(vals):
            ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=7, rotation=20)
        ax.set_title(label, fontsize=9)
        ax.margins(y=0.15)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Replay reports: per-run summaries, the stdout table, JSON, a PNG plot and the goal checks.

Definitions (per run = one router at one capacity):

- block hit % = reused blocks / prompt blocks (hash ids, the partial last block included; raykv
  only shares full blocks, so a partial block never hits); token hit % likewise in tokens. For
  ``raykv_pull`` blocks pulled from another worker count as reused (they were not recomputed).
- TTFT p50/p90/p99 in simulated seconds (:mod:`raykv.replay.timing`).
- imbalance = max / mean over servers of the work each was given during the whole run.
- moved = bytes pulled between workers, in the modelled engine's KV bytes
  (``kv_bytes_per_token``); ``page_bytes`` counts what the replay's tiny pages really moved.
- decide us = wall-clock of the router's ``choose`` per request (p50 and mean), in-process unless
  the run went through Ray (then it includes the index RPC); update us = its ``routed`` step.
  keys us (p50, JSON and the goal line) = computing a request's block keys from its tokens
  (SHA-256), done before the replay loop and not part of decide us; raykv's Serve router does it
  before it routes.
- util % = work served / (servers x speed x trace span).
- tokenize (chat requests only, one line per workload: :func:`tokenize_line`) = rendering each
  request's messages to ids with one PromptRenderer before keying them, done once for every run
  (wall clock: render us p50 / p99 per rendered request; reused = characters the renderer's
  prefix reuse did not tokenize again / characters rendered); requests it could not render are
  routed by load by raykv and raykv_pull (the notes column: ``N unrendered by load``).

The PNG (matplotlib, Agg backend, imported lazily) has two panels, block hit % and TTFT p90 vs
per-worker capacity, one line per router.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from raykv.replay.engine import RunResult
from raykv.replay.timing import TimingConfig
from raykv.replay.trace import BLOCK_TOKENS


@dataclass(frozen=True)
class Summary:
    """The figures of one run (see the module docstring)."""

    router: str
    capacity_pct: float
    blocks_per_worker: int
    requests: int
    total_requests: int
    block_hit_pct: float
    token_hit_pct: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    imbalance: float
    pulled_blocks: int
    moved_bytes: int
    moved_page_bytes: int
    decide_p50_us: float
    decide_mean_us: float
    keys_p50_us: float
    update_mean_us: float
    util_pct: float
    throughput_rps: float
    interrupted: bool
    wall_s: float
    notes: dict[str, Any]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


def summarize(
    res: RunResult,
    capacity_pct: float,
    blocks_per_worker: int,
    timing: TimingConfig,
    span_s: float,
    page_bytes: int,
) -> Summary:
    """Summary of one run; ``span_s`` is the trace's span (for utilisation)."""
    mean_work = sum(res.work) / len(res.work) if res.work else 0.0
    decide = res.decide_ns[: res.done] or [0]
    update = res.update_ns[: res.done] or [0]
    return Summary(
        router=res.router,
        capacity_pct=capacity_pct,
        blocks_per_worker=blocks_per_worker,
        requests=res.done,
        total_requests=res.total_requests,
        block_hit_pct=100.0 * res.hit_blocks / max(1, res.blocks),
        token_hit_pct=100.0 * res.hit_tokens / max(1, res.input_tokens),
        ttft_p50_s=_pct(res.ttft, 50),
        ttft_p90_s=_pct(res.ttft, 90),
        ttft_p99_s=_pct(res.ttft, 99),
        imbalance=max(res.work) / mean_work if mean_work > 0 else 1.0,
        pulled_blocks=res.pulled_blocks,
        moved_bytes=res.pulled_blocks * BLOCK_TOKENS * timing.kv_bytes_per_token,
        moved_page_bytes=res.pulled_blocks * page_bytes,
        decide_p50_us=float(np.median(decide)) / 1000.0,
        decide_mean_us=float(np.mean(decide)) / 1000.0,
        keys_p50_us=float(np.median(res.keys_ns[: res.done] or [0])) / 1000.0,
        update_mean_us=float(np.mean(update)) / 1000.0,
        util_pct=100.0 * sum(res.work) / (res.servers * res.speed * span_s),
        throughput_rps=res.done / res.makespan_s if res.makespan_s > 0 else 0.0,
        interrupted=res.interrupted,
        wall_s=res.wall_s,
        notes=dict(res.notes),
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}" if n else "0"


COLUMNS = (
    "cap %",
    "C/worker",
    "router",
    "block hit %",
    "token hit %",
    "TTFT p50 s",
    "p90 s",
    "p99 s",
    "imbalance",
    "moved GB",
    "decide p50 us",
    "notes",
)


def _row(s: Summary) -> tuple[str, ...]:
    notes = []
    if s.interrupted:
        notes.append(f"interrupted after {s.requests}/{s.total_requests}")
    if s.pulled_blocks:
        paths = s.notes.get("pull_paths")
        via = f" ({', '.join(f'{k} {v}' for k, v in paths.items())})" if isinstance(paths, dict) else ""
        notes.append(f"{s.pulled_blocks} blocks pulled{via}")
    for key in ("pull_failures",):
        if s.notes.get(key):
            notes.append(f"{key} {s.notes[key]}")
    if s.notes.get("routed_unrendered"):
        notes.append(f"{s.notes['routed_unrendered']} unrendered by load")
    return (
        f"{s.capacity_pct:g}",
        str(s.blocks_per_worker),
        s.router,
        f"{s.block_hit_pct:.1f}",
        f"{s.token_hit_pct:.1f}",
        f"{s.ttft_p50_s:.2f}",
        f"{s.ttft_p90_s:.2f}",
        f"{s.ttft_p99_s:.2f}",
        f"{s.imbalance:.2f}",
        _gb(s.moved_bytes),
        f"{s.decide_p50_us:.1f}",
        "; ".join(notes),
    )


def format_table(summaries: Sequence[Summary], markdown: bool = False) -> str:
    """The comparison table (aligned text, or a Markdown table for the README)."""
    rows = [COLUMNS, *(_row(s) for s in summaries)]
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) if i in (2, 11) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def tokenize_line(tokenize: Mapping[str, Any]) -> str:
    """One line on the tokenize cost of a workload's chat requests (``GridResult.meta
    ["tokenize"]``, :meth:`~raykv.replay.chat_text.ChatPrompts.summary`)."""
    reasons = [
        f"{k.removeprefix('unrendered_')} {v}" for k, v in tokenize.items() if k.startswith("unrendered_")
    ]
    why = f" ({', '.join(reasons)})" if reasons else ""
    line = (
        f"tokenize: {tokenize['rendered']} chat requests rendered by one PromptRenderer, render "
        f"p50 {tokenize['render_p50_us']:.1f} us, p99 {tokenize['render_p99_us']:.1f} us, mean "
        f"{tokenize['render_mean_us']:.1f} us (wall clock); {tokenize['reused_pct']:.1f}% of "
        f"characters reused; {tokenize['unrendered']} unrenderable{why}, routed by load"
    )
    if tokenize.get("engine_mismatch"):
        line += f"; {tokenize['engine_mismatch']} rendered differently from the engine's ids"
    return line


class Goal(NamedTuple):
    """One routing goal evaluated on one workload: its line, and whether it was met."""

    line: str
    met: bool


GOAL_HIT_PP = 1.5
"""raykv block hit % may be at most this many points below pooled's."""
GOAL_PULL_VS_POOLED = 1.15
"""raykv_pull TTFT p90 may be at most this multiple of pooled's."""
GOAL_VS_PEERS = 0.9
"""raykv TTFT p90 may be at most this multiple of the better of pow2 and ray_prefix."""
GOAL_IMBALANCE = 1.25
"""raykv's and raykv_pull's load imbalance may be at most this."""
GOAL_DECIDE_US = (20.0, 60.0)
"""Decision p50 from block keys, and including the prompt's hashing (keys p50 + decide p50)."""


def _bound_note(pooled: Summary | None, best: Summary) -> str:
    """For the TTFT goal against the peers: a note when the pooled ideal itself misses it (its p90
    above ``GOAL_VS_PEERS`` x the best peer's), else ""."""
    if pooled is None or best.ttft_p90_s <= 0:
        return ""
    bound = pooled.ttft_p90_s / best.ttft_p90_s
    return f"; pooled itself {bound:.2f}x" if bound > GOAL_VS_PEERS else ""


def _cap_goals(cap: float, by: dict[tuple[float, str], Summary]) -> list[Goal]:
    kv, pooled, pull, pow2, ray = (
        by.get((cap, r)) for r in ("raykv", "pooled", "raykv_pull", "pow2", "ray_prefix")
    )
    out = []
    if kv and pooled:
        gap = pooled.block_hit_pct - kv.block_hit_pct
        out.append(
            Goal(
                f"cap {cap:g}%: raykv block hit >= pooled - {GOAL_HIT_PP:g} pp: {kv.block_hit_pct:.1f} vs "
                f"{pooled.block_hit_pct:.1f} % ({-gap:+.2f} pp)",
                gap <= GOAL_HIT_PP,
            )
        )
    if pull and pooled:
        ratio = pull.ttft_p90_s / pooled.ttft_p90_s if pooled.ttft_p90_s > 0 else math.inf
        out.append(
            Goal(
                f"cap {cap:g}%: raykv_pull TTFT p90 <= {GOAL_PULL_VS_POOLED:g}x pooled: "
                f"{pull.ttft_p90_s:.3f} vs {pooled.ttft_p90_s:.3f} s ({ratio:.2f}x)",
                ratio <= GOAL_PULL_VS_POOLED,
            )
        )
    peers = [s for s in (pow2, ray) if s is not None]
    if kv and peers:
        best = min(peers, key=lambda s: s.ttft_p90_s)
        ratio = kv.ttft_p90_s / best.ttft_p90_s if best.ttft_p90_s > 0 else math.inf
        out.append(
            Goal(
                f"cap {cap:g}%: raykv TTFT p90 <= {GOAL_VS_PEERS:g}x best of pow2/ray_prefix: "
                f"{kv.ttft_p90_s:.3f} vs {best.router} {best.ttft_p90_s:.3f} s ({ratio:.2f}x)"
                + _bound_note(pooled, best),
                ratio <= GOAL_VS_PEERS,
            )
        )
    for s in (kv, pull):
        if s is not None:
            out.append(
                Goal(
                    f"cap {cap:g}%: {s.router} load imbalance <= {GOAL_IMBALANCE:g}: {s.imbalance:.2f}",
                    s.imbalance <= GOAL_IMBALANCE,
                )
            )
    return out


def goal_checks(summaries: Sequence[Summary], in_process: bool = True) -> list[Goal]:
    """The routing goals, evaluated per capacity on one workload's results (one Goal each):
    raykv's hits against pooled, raykv_pull's TTFT p90 against pooled, raykv's TTFT p90 against
    the better of pow2 and ray_prefix, both raykv routers' load imbalance, and (in-process runs
    only: through Ray the decision includes an RPC) the worst decision p50 from block keys and
    including the prompt's hashing."""
    by = {(s.capacity_pct, s.router): s for s in summaries}
    goals: list[Goal] = []
    for cap in sorted({s.capacity_pct for s in summaries}):
        goals += _cap_goals(cap, by)
    kv_runs = [s for s in summaries if s.router in ("raykv", "raykv_pull")]
    if kv_runs and in_process:
        worst = max(s.decide_p50_us for s in kv_runs)
        total = max(s.decide_p50_us + s.keys_p50_us for s in kv_runs)
        keys_goal, total_goal = GOAL_DECIDE_US
        goals.append(
            Goal(
                f"raykv decision p50 <= {keys_goal:g} us from block keys: worst {worst:.1f} us (wall clock)",
                worst <= keys_goal,
            )
        )
        goals.append(
            Goal(
                f"raykv decision p50 <= {total_goal:g} us including hashing the prompt: worst {total:.1f} us "
                "(keys of blocks keyed before reused; wall clock)",
                total <= total_goal,
            )
        )
    return goals


def goal_summary(results: Sequence[tuple[str, Sequence[Goal]]]) -> str:
    """One line over every workload's goals: how many were met, and which workloads missed."""
    total = sum(len(g) for _, g in results)
    met = sum(g.met for _, goals in results for g in goals)
    missed = [
        f"{name} {sum(not g.met for g in goals)}" for name, goals in results if not all(g.met for g in goals)
    ]
    tail = f"; missed: {', '.join(missed)}" if missed else ""
    return f"goals: {met}/{total} met over {len(results)} workload(s){tail}"


def write_json(path: Path, summaries: Sequence[Summary], meta: dict[str, Any]) -> Path:
    """``{"meta": ..., "results": [summary, ...]}`` (NaN written as null)."""

    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    rows = [{k: clean(v) for k, v in asdict(s).items()} for s in summaries]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str) + "\n")
    return path


def write_plot(path: Path, summaries: Sequence[Summary], title: str) -> Path | None:
    """The two-panel PNG; returns None (writing nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    routers = list(dict.fromkeys(s.router for s in summaries))
    for router in routers:
        pts = sorted((s.blocks_per_worker, s) for s in summaries if s.router == router)
        xs = [x for x, _ in pts]
        axes[0].plot(xs, [s.block_hit_pct for _, s in pts], marker="o", label=router)
        axes[1].plot(xs, [s.ttft_p90_s for _, s in pts], marker="o", label=router)
    for ax, ylabel in zip(axes, ("block hit ratio (%)", "TTFT p90 (s, simulated)")):
        ax.set_xlabel("per-worker capacity (blocks of 512 tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        caps = sorted({s.blocks_per_worker for s in summaries})
        if len(caps) > 2:
            ax.set_xscale("log")
        ax.set_xticks(caps, [str(c) for c in caps])
        ax.minorticks_off()
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

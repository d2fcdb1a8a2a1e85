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

The PNG (matplotlib, Agg backend, imported lazily) has two panels, block hit % and TTFT p90 vs
per-worker capacity, one line per router.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


def goal_checks(summaries: Sequence[Summary], in_process: bool = True) -> list[str]:
    """The issue's goals, evaluated per capacity on these results (one line each, met or not)."""
    by = {(s.capacity_pct, s.router): s for s in summaries}
    lines = []
    for cap in sorted({s.capacity_pct for s in summaries}):
        kv, pooled, ray, pull, oracle = (
            by.get((cap, r)) for r in ("raykv", "pooled", "ray_prefix", "raykv_pull", "pooled_oracle")
        )
        if kv and pooled:
            gap = pooled.block_hit_pct - kv.block_hit_pct
            lines.append(
                f"cap {cap:g}%: raykv hit within 1 pp of pooled: {gap:+.2f} pp below -> "
                f"{'met' if gap <= 1.0 else 'NOT met'}"
            )
        if kv and ray and cap <= 10:
            ratio = kv.ttft_p90_s / ray.ttft_p90_s if ray.ttft_p90_s > 0 else math.inf
            lines.append(
                f"cap {cap:g}%: raykv TTFT p90 <= 0.5x ray_prefix: {ratio:.2f}x -> "
                f"{'met' if ratio <= 0.5 else 'NOT met'}"
            )
        if pull and pooled:
            ok = pull.ttft_p90_s <= pooled.ttft_p90_s
            lines.append(
                f"cap {cap:g}%: raykv_pull TTFT p90 <= pooled (same load information): "
                f"{pull.ttft_p90_s:.2f} vs {pooled.ttft_p90_s:.2f} s -> {'met' if ok else 'NOT met'}"
            )
        if pull and oracle:
            rel = (
                f" ({100 * (pull.ttft_p90_s / oracle.ttft_p90_s - 1):+.1f}%)" if oracle.ttft_p90_s > 0 else ""
            )
            lines.append(
                f"cap {cap:g}%: for information, raykv_pull TTFT p90 vs pooled_oracle (exact outstanding "
                f"work): {pull.ttft_p90_s:.2f} vs {oracle.ttft_p90_s:.2f} s{rel}"
            )
    kv_runs = [s for s in summaries if s.router in ("raykv", "raykv_pull")]
    if kv_runs and in_process:
        worst = max(s.decide_p50_us for s in kv_runs)
        keys = max(s.keys_p50_us for s in kv_runs)
        lines.append(
            f"raykv routing decision p50 <= 20 us in-process: worst {worst:.1f} us -> "
            f"{'met' if worst <= 20 else 'NOT met'} (from block keys; hashing the prompt into "
            f"them, which raykv's Serve router also does, takes {keys:.1f} us p50 more)"
        )
    return lines


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

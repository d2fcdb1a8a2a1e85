"""``raykv replay``: compare routers on Mooncake traces and generated workload families.

    raykv replay --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \\
        --workers 8 --capacity-pct 2,10,30 --out raykv-results
    raykv replay --workload agentic --requests 6000 --seed 1  # a family (raykv.replay.families)
    raykv replay --workload chat_text   # chat messages the routers render with the chat template
    raykv replay --workload all --trace A.jsonl --trace B.jsonl  # every family, then both traces
    raykv replay --requests 400 --tenants 3 --seed 1          # the demo's built-in workload
    raykv replay --ray --workers 4 --requests 200              # through a Ray deployment
    raykv replay --workload agentic --routing hot_price=2.5    # an experiment off the default
    raykv replay --workload agentic --shape tenants=12,fanout_p=0.6  # agentic of another shape

For each workload (families first, in the order named, then traces) prints the comparison table
and the goal lines on stdout (progress on stderr) and writes ``<out>/<name>.json`` and
``<out>/<name>.png``; then one summary line over every workload's goals. Every run uses the one
default routing configuration (:data:`raykv.routing.policy.DEFAULT_ROUTING`) unless ``--routing``
overrides some of its fields for an experiment (then said on stdout and in the JSON). Ctrl-C stops the
replay cleanly: what was measured so far is still printed and written, and the exit code is 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, TextIO

from raykv.core.errors import InvalidArgumentError
from raykv.core.overrides import replace_fields
from raykv.replay.families import DEFAULT_REQUESTS, FAMILIES, AgenticShape, FamilySpec, generate_family
from raykv.replay.grid import GridResult, GridSpec, run_grid
from raykv.replay.report import (
    Goal,
    format_table,
    goal_checks,
    goal_summary,
    tokenize_line,
    write_json,
    write_plot,
)
from raykv.replay.routers import ROUTERS, parse_routers
from raykv.replay.trace import Request, load_mooncake
from raykv.replay.workload import WorkloadSpec, generate
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig


def _pcts(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,10,30, got {text!r}") from None


def routing_overrides(text: str) -> RoutingConfig:
    """:data:`DEFAULT_ROUTING` with the fields ``text`` names replaced (``name=value`` pairs,
    comma-separated; numbers, or true/false for a flag; :func:`replace_fields`); "" is the
    default itself. InvalidArgumentError for an unknown field, a value of the wrong kind or one
    the config rejects."""
    return replace_fields(DEFAULT_ROUTING, text, "routing")


def add_replay_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``raykv replay`` on the CLI's subparsers."""
    p = sub.add_parser("replay", help="replay a trace or the built-in workload through every router")
    p.add_argument(
        "--trace", type=Path, action="append", default=[], help="Mooncake-format JSONL file (repeatable)"
    )
    p.add_argument(
        "--workload",
        help=f"generated families, comma-separated, or all: {', '.join(FAMILIES)} (default without "
        "--trace: the demo's built-in workload)",
    )
    p.add_argument(
        "--requests", type=int, help="generated workloads: number of requests (default per family)"
    )
    p.add_argument("--tenants", type=int, default=3, help="built-in workload: tenants (one salt each)")
    p.add_argument("--limit", type=int, help="replay only the first N requests of each trace")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument(
        "--capacity-pct",
        type=_pcts,
        default=(2.0, 10.0, 30.0),
        help="total capacity W*C as %% of the trace's unique blocks, comma-separated",
    )
    p.add_argument("--routers", default="all", help=f"comma-separated subset of: {', '.join(ROUTERS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("raykv-results"), help="directory for the JSON and PNG")
    p.add_argument("--ray", action="store_true", help="run through a Ray deployment (embedded local Ray)")
    p.add_argument("--address", help="with --ray: an existing Ray cluster's address")
    p.add_argument("--verify", type=int, default=16, help="oracle-check this many cached pages per worker")
    p.add_argument(
        "--routing",
        default="",
        help="experiments: override DEFAULT_ROUTING fields, e.g. hot_price=2.5,recent_weight=0.35 "
        "(the goal lines then judge that configuration, not the shipped default)",
    )
    p.add_argument(
        "--shape",
        default="",
        help="--workload agentic of another shape: AgenticShape fields, e.g. tenants=12,fanout_p=0.6,"
        "step_gap_s=0.2:1.5 (ranges as low:high)",
    )
    p.set_defaults(func=replay_main)
    return p


def _families(text: str | None) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    out: list[str] = []
    for name in names:
        for one in FAMILIES if name == "all" else (name,):
            if one not in FAMILIES:
                raise InvalidArgumentError(
                    "workload", f"unknown workload {one!r}; known: {', '.join(FAMILIES)}"
                )
            if one not in out:
                out.append(one)
    return out


def workloads(args: argparse.Namespace) -> list[tuple[str, list[Request]]]:
    """``(name, requests)`` for every workload the arguments name: families, then traces; the
    demo's built-in workload when none is named."""
    out = []
    names = _families(args.workload)
    shape = AgenticShape.parse(args.shape) if args.shape else None
    if shape is not None and "agentic" not in names:
        raise InvalidArgumentError("shape", "--shape shapes the agentic family: add --workload agentic")
    for name in names:
        n = args.requests or DEFAULT_REQUESTS[name]
        spec = FamilySpec(name, n, args.seed, shape if name == "agentic" else None)
        out.append((name, generate_family(spec)))
    for trace in args.trace:
        out.append((trace.stem, load_mooncake(trace, args.limit)))
    if not out:
        n = args.limit or args.requests or 400
        out.append(("builtin", generate(WorkloadSpec(requests=n, seed=args.seed, tenants=args.tenants))))
    return out


def emit(
    grid: GridResult, name: str, out_dir: Path, in_process: bool | None, out: TextIO, command: str
) -> list[Goal]:
    """Print the table, the tokenize line (a workload of chat requests) and the goal lines (not
    when ``in_process`` is None), write the JSON and PNG, say where they went, and return the
    goals."""
    out.write(f"\n== {name}\n" + format_table(grid.summaries) + "\n\n")
    if "tokenize" in grid.meta:
        out.write(f"  {tokenize_line(grid.meta['tokenize'])}\n")
    goals = goal_checks(grid.summaries, in_process) if in_process is not None else []
    for goal in goals:
        out.write(f"  goal: {goal.line} -> {'met' if goal.met else 'NOT met'}\n")
    meta = dict(grid.meta, name=name, command=command, interrupted=grid.interrupted)
    json_path = write_json(out_dir / f"{name}.json", grid.summaries, meta)
    png = write_plot(
        out_dir / f"{name}.png",
        grid.summaries,
        f"{name}: {meta['requests']} requests, {meta['workers']} workers",
    )
    out.write(f"\nresults: {json_path}\n")
    out.write(f"plot:    {png}\n" if png else "plot:    skipped (pip install matplotlib)\n")
    if grid.interrupted:
        out.write("interrupted: the table covers the runs finished before Ctrl-C\n")
    out.flush()
    return goals


def replay_main(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The ``raykv replay`` command; returns the exit code (130 after Ctrl-C)."""
    spec = GridSpec(
        workers=args.workers,
        capacity_pcts=tuple(args.capacity_pct),
        routers=tuple(parse_routers(args.routers)),
        seed=args.seed,
        verify=args.verify,
        routing=routing_overrides(args.routing),
    )
    if spec.routing != DEFAULT_ROUTING:
        changed = {
            k: v for k, v in dataclasses.asdict(spec.routing).items() if getattr(DEFAULT_ROUTING, k) != v
        }
        out.write(f"routing: DEFAULT_ROUTING with {changed} (an experiment, not the shipped default)\n")
    command = "raykv " + " ".join(sys.argv[1:])
    results: list[tuple[str, list[Goal]]] = []
    for name, requests in workloads(args):
        err.write(
            f"raykv replay: {name}, {len(requests)} requests, {spec.workers} workers, capacities "
            f"{list(spec.capacity_pcts)}% of unique blocks, {'Ray' if args.ray else 'in-process'}\n"
        )
        grid = _grid(requests, spec, args, err)
        results.append((name, emit(grid, name, args.out, not args.ray, out, command)))
        if grid.interrupted:
            return 130
    out.write("\n" + goal_summary(results) + "\n")
    return 0


def _grid(requests: list[Request], spec: GridSpec, args: argparse.Namespace, err: TextIO) -> GridResult:
    if args.ray:
        from actors.replay.backends import RayBackends

        start = {"address": args.address} if args.address else {}
        with RayBackends(args.workers, **start) as backends:
            return run_grid(requests, spec, backends, err)
    from actors.replay.backends import in_process

    return run_grid(requests, spec, in_process, err)

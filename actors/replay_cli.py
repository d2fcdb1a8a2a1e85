"""``raykv replay``: compare routers on a Mooncake trace or the built-in workload.

    raykv replay --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \\
        --workers 8 --capacity-pct 2,10,30 --out raykv-results
    raykv replay --requests 400 --tenants 3 --seed 1          # built-in workload
    raykv replay --ray --workers 4 --requests 200              # through a Ray deployment

Prints the comparison table and the goal checks on stdout (progress on stderr), and writes
``<out>/<name>.json`` and ``<out>/<name>.png``. Ctrl-C stops the replay cleanly: what was measured
so far is still printed and written, and the exit code is 130.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from raykv.replay.grid import GridResult, GridSpec, run_grid
from raykv.replay.report import format_table, goal_checks, write_json, write_plot
from raykv.replay.routers import ROUTERS, RaykvTuning, parse_routers
from raykv.replay.trace import Request, load_mooncake
from raykv.replay.workload import WorkloadSpec, generate


def _pcts(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,10,30, got {text!r}") from None


def add_replay_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``raykv replay`` on the CLI's subparsers."""
    p = sub.add_parser("replay", help="replay a trace or the built-in workload through every router")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="Mooncake-format JSONL file (default: built-in workload)")
    src.add_argument("--requests", type=int, default=400, help="built-in workload: number of requests")
    p.add_argument("--tenants", type=int, default=3, help="built-in workload: tenants (one salt each)")
    p.add_argument("--limit", type=int, help="replay only the first N requests of the trace")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument(
        "--capacity-pct",
        type=_pcts,
        default=(2.0, 10.0, 30.0),
        help="total capacity W*C as %% of the trace's unique blocks, comma-separated",
    )
    p.add_argument("--routers", default="all", help=f"comma-separated subset of: {', '.join(ROUTERS)}")
    p.add_argument("--load-cost", type=float, default=RaykvTuning.load_cost, help="raykv: weight of load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("raykv-results"), help="directory for the JSON and PNG")
    p.add_argument("--ray", action="store_true", help="run through a Ray deployment (embedded local Ray)")
    p.add_argument("--address", help="with --ray: an existing Ray cluster's address")
    p.add_argument("--verify", type=int, default=16, help="oracle-check this many cached pages per worker")
    p.set_defaults(func=replay_main)
    return p


def _requests(args: argparse.Namespace) -> tuple[list[Request], str]:
    if args.trace is not None:
        return load_mooncake(args.trace, args.limit), args.trace.stem
    n = args.limit or args.requests
    return generate(WorkloadSpec(requests=n, seed=args.seed, tenants=args.tenants)), "builtin"


def emit(
    grid: GridResult, name: str, out_dir: Path, in_process: bool | None, out: TextIO, command: str
) -> None:
    """Print the table and the goal checks (the issue's goals for 8-worker Mooncake grids; not
    printed when ``in_process`` is None), write the JSON and PNG, and say where they went."""
    out.write("\n" + format_table(grid.summaries) + "\n\n")
    for line in goal_checks(grid.summaries, in_process) if in_process is not None else ():
        out.write(f"  goal: {line}\n")
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


def replay_main(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The ``raykv replay`` command; returns the exit code (130 after Ctrl-C)."""
    requests, name = _requests(args)
    spec = GridSpec(
        workers=args.workers,
        capacity_pcts=tuple(args.capacity_pct),
        routers=tuple(parse_routers(args.routers)),
        seed=args.seed,
        tuning=RaykvTuning(load_cost=args.load_cost),
        verify=args.verify,
    )
    err.write(
        f"raykv replay: {name}, {len(requests)} requests, {spec.workers} workers, "
        f"capacities {list(spec.capacity_pcts)}% of unique blocks, {'Ray' if args.ray else 'in-process'}\n"
    )
    if args.ray:
        from actors.replay import RayBackends

        start = {"address": args.address} if args.address else {}
        with RayBackends(args.workers, **start) as backends:
            grid = run_grid(requests, spec, backends, err)
    else:
        from actors.replay import in_process

        grid = run_grid(requests, spec, in_process, err)
    emit(grid, name, args.out, not args.ray, out, "raykv " + " ".join(sys.argv[1:]))
    return 130 if grid.interrupted else 0

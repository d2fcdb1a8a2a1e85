"""``raykv demo``: the main job, on an embedded local Ray (``raykv demo --core``: the core demo).

Starts a raykv deployment (4 CPU TestingCacheWorker actors, whose content oracle stands in for
the engine, and an index shard) on an embedded local Ray (or the cluster at ``--address`` /
RAY_ADDRESS), replays the built-in workload (multi-turn chat, agent fan-out, three tenants with
different cache salts) through every router, prints the comparison table and where the JSON and
plot went, verifies cached pages against the content oracle (every committed page of every worker
actor after each run, plus a sample of the pooled ideal's), and shuts everything down. Each
capacity gets a fresh deployment; between routers the workers are cleared. The demo's decision
times include the index RPC (the 20 us goal is for the in-process index).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from raykv.replay.grid import GridSpec, run_grid
from raykv.replay.routers import ROUTERS, parse_routers
from raykv.replay.workload import WorkloadSpec, generate

DEFAULT_REQUESTS = 400
DEFAULT_CAPACITIES = (10.0, 30.0)


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    """The demo's options (all optional: ``raykv demo`` runs with none)."""
    demo.add_argument("--core", action="store_true", help="run the in-process core demo instead")
    demo.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="built-in workload size")
    demo.add_argument("--workers", type=int, default=4)
    demo.add_argument(
        "--capacity-pct",
        default=",".join(f"{c:g}" for c in DEFAULT_CAPACITIES),
        help="total capacity as %% of unique blocks, comma-separated",
    )
    demo.add_argument("--routers", default="all", help=f"comma-separated subset of: {', '.join(ROUTERS)}")
    demo.add_argument("--out", type=Path, default=Path("raykv-results"))
    demo.add_argument("--address", help="an existing Ray cluster (default: embedded local Ray)")
    demo.add_argument("--conversations", type=int, default=12, help="--core: conversations")
    demo.add_argument("--turns", type=int, default=4, help="--core: turns per conversation")
    demo.add_argument("--seed", type=int, default=0)


def demo_main(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The ``raykv demo`` command; returns the exit code (130 after Ctrl-C)."""
    if args.core:
        from raykv.demo import run_demo

        result = run_demo(conversations=args.conversations, turns=args.turns, seed=args.seed, out=out)
        out.write(f"demo finished in {result.seconds:.1f}s\n")
        return 0
    caps = tuple(float(x) for x in str(args.capacity_pct).split(",") if x.strip())
    return run_ray_demo(
        args.requests,
        args.workers,
        caps,
        parse_routers(args.routers),
        args.seed,
        args.out,
        args.address,
        out,
        err,
    )


def _verified(summaries: Any) -> int:
    return sum(int(s.notes.get("verified_pages", 0)) for s in summaries)


def run_ray_demo(
    requests: int = DEFAULT_REQUESTS,
    workers: int = 4,
    capacity_pcts: tuple[float, ...] = DEFAULT_CAPACITIES,
    routers: list[str] | None = None,
    seed: int = 0,
    out_dir: Path = Path("raykv-results"),
    address: str | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Run the Ray demo (module docstring); returns 0, or 130 after Ctrl-C.

    Raises AssertionError if a cached page fails oracle verification. Shuts down the deployment
    and, when this call started it, the embedded Ray.
    """
    import ray

    from actors.cli.replay import emit
    from actors.replay.backends import RayBackends

    t0 = time.perf_counter()
    reqs = generate(WorkloadSpec(requests=requests, seed=seed))
    spec = GridSpec(
        workers=workers, capacity_pcts=capacity_pcts, routers=tuple(routers or ROUTERS), seed=seed, verify=64
    )
    out.write(
        f"raykv demo: {len(reqs)} requests of the built-in workload (chat + agent fan-out, 3 tenants), "
        f"{workers} CPU workers + 1 index shard on {'Ray at ' + address if address else 'embedded Ray'}, "
        f"routers {', '.join(spec.routers)}, capacities {', '.join(f'{c:g}' for c in capacity_pcts)}% "
        "of unique blocks\n"
    )
    out.flush()
    started = not ray.is_initialized()
    if started and address is None:
        # "local" starts a fresh embedded Ray even when another cluster runs on this machine
        ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace="raykv-demo")
    try:
        with RayBackends(workers, address=address) as backends:
            grid = run_grid(reqs, spec, backends, err)
    finally:
        if started and ray.is_initialized():
            from actors.cache.ray_util import shutdown_ray

            shutdown_ray()
    emit(grid, "demo", out_dir, None, out, "raykv demo")
    out.write(f"oracle: verified {_verified(grid.summaries)} cached pages byte-for-byte: OK\n")
    out.write(f"deployment shut down; demo finished in {time.perf_counter() - t0:.1f}s\n")
    out.flush()
    return 130 if grid.interrupted else 0

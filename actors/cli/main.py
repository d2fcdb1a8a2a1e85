"""The ``raykv`` command.

``raykv demo``        the main job: a Ray deployment, the built-in workload through every router
``raykv demo --core`` the in-process core demo (multi-turn workload, oracle-verified)
``raykv replay``      compare routers on a Mooncake trace or the built-in workload
``raykv bench``       every suite, one combined table (``--quick``: CI); the suites and rows that
                      need Ray, vLLM or CUDA where they are missing: one ``skipped: ...`` line each
``raykv bench core``  core micro-benchmarks (block keys, tree ops, host<->disk copies)
``raykv bench index`` prefix index: route latency, event ingest, route calls/s through Ray
                      (``--scale``: 10^6-10^8 memberships in one shard, then 1-8 shards)
``raykv bench routing`` a routing decision (index + cost model) vs Ray Serve LLM's PrefixTree
``raykv bench gpu``   GPU tier page copies vs raw CUDA copies (needs CUDA)
``raykv bench transfer`` page pulls (shared memory, UCX) vs memcpy, raw ucxx, Ray's object store
``raykv bench soak``  fault soak: a live deployment under injected faults, content-checked
                      (``--minutes N --workers W --seed S``; exit 1 on a wrong page or failure)
``raykv bench vllm``  vLLM TTFT with a cached prefix: RaykvConnector vs vLLM's caches (needs vllm)
``raykv bench scheduler`` what RaykvConnector adds to vLLM's scheduler step per new request (needs vllm)
``raykv bench serve`` Ray Serve LLM over HTTP, multi-turn chat at a fixed rate: pow2, prefix-affinity,
                      raykv, raykv-pow2 (``--replicas N --rate R --sessions S --seed K --json P
                      --plot P``; needs vllm; ``--quick`` < 3 min on 2 cores)
``raykv up``          start a deployment on a running Ray cluster (``--config FILE``, ``--address``)
``raykv status``      tables of its workers and index shards (``--json``, ``--watch S``)
``raykv down``        stop every raykv actor of the namespace and remove its disk-tier files
``raykv config``      ``--print-defaults``: a commented configuration file; ``--check FILE``
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from actors.cli.demo import demo_main

    return demo_main(args)


def _bench(args: argparse.Namespace) -> int:
    """Run ``raykv bench [suite]``: every part that can run here; print one ``skipped: ...`` line
    per suite or part left out (a missing Ray, vLLM or CUDA). Returns 0 when everything that ran
    passed, 1 when a benchmark raised or when a named suite could not run at all."""
    from actors.bench.plan import NAMED_ONLY, named_only_missing, plan_suites
    from raykv.bench import run_all_benchmarks, run_benchmarks

    if args.scale:
        return _index_scale(args)
    if args.suite in NAMED_ONLY:  # not part of "all": minutes, and Ray and/or vLLM throughout
        missing = named_only_missing(args.suite)
        if missing is not None:
            print(missing.line(), "- nothing ran", flush=True)
            return 1
        return _named_only(args)
    plan = plan_suites(args.suite)
    if args.suite is None:
        rc = run_all_benchmarks(quick=args.quick, exclude=plan.excluded)
    elif args.suite in plan.excluded:
        rc = 1
    else:
        rc = run_benchmarks(args.suite, quick=args.quick)
    for skip in plan.skipped:
        print(skip.line(), flush=True)
    if args.suite in plan.excluded:
        print(f"raykv bench {args.suite}: nothing ran", flush=True)
    return rc


def _index_scale(args: argparse.Namespace) -> int:
    """``raykv bench index --scale``: one shard at 10^6-10^8 memberships in-process, then 1-8
    shards behind one IndexClient through Ray (skipped, saying so, without Ray)."""
    if args.suite != "index":
        print("--scale is an option of `raykv bench index`", flush=True)
        return 2
    from raykv.bench.index_scale import SIZES, run

    rc = run(SIZES["quick" if args.quick else "full"], [1, 4, 16], args.scale_json)
    try:
        from actors.bench.index_shards import run as run_shards
    except ImportError as exc:
        print(f"skipped: index shards through Ray (needs ray: {exc})", flush=True)
        return rc
    return rc or run_shards(args.quick)


def _named_only(args: argparse.Namespace) -> int:
    """The suites run only when named (their requirements were checked by the caller)."""
    from raykv.bench import run_benchmarks

    if args.suite == "soak":  # a live deployment for minutes
        from actors.bench.soak import soak_main

        return soak_main(args)
    if args.suite == "serve":  # Ray Serve LLM with vLLM engines, minutes
        from actors.bench.serve import serve_bench_main

        return serve_bench_main(args)
    if args.suite == "vllm":  # vLLM engines, minutes
        from actors.bench.vllm import register as register_vllm

        register_vllm()
    else:
        from actors.bench.scheduler import register as register_scheduler

        register_scheduler()
    return run_benchmarks(args.suite, quick=args.quick)


def _add_soak_arguments(parser: Any) -> None:
    """The soak's options (on ``raykv bench``; the other suites ignore them). Kept here, not in
    actors.bench.soak, so building the parser never imports Ray."""
    parser.add_argument("--minutes", type=float, default=1.0, help="soak length (default 1)")
    parser.add_argument("--workers", type=int, default=3, help="cache workers (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="workload and fault seed (default 0)")
    parser.add_argument(
        "--fault-interval", type=float, default=3.0, help="mean seconds between faults (default 3)"
    )


def _add_serve_arguments(parser: Any) -> None:
    """``raykv bench serve``'s options (its seed is the soak's ``--seed``)."""
    parser.add_argument(
        "--replicas", type=int, default=None, help="replicas per deployment (quick 2, full 3)"
    )
    parser.add_argument("--rate", type=float, default=None, help="offered requests/s (quick 3.5, full 4)")
    parser.add_argument(
        "--sessions", type=int, default=None, help="chat sessions (default: enough for the rate)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--plot", default="docs/bench_serve.png", metavar="PATH", help="TTFT CDF and bars (PNG)"
    )
    parser.add_argument(
        "--separate-engines", action="store_true", help="one deployment per config (twice the engines)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raykv", description="raykv: distributed KV cache")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    from actors.cli.demo import add_demo_arguments
    from actors.cli.ops import add_ops_parsers
    from actors.cli.replay import add_replay_parser

    demo = sub.add_parser("demo", help="compare routers on a local Ray deployment (--core: core demo)")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)
    add_replay_parser(sub)
    bench = sub.add_parser("bench", help="micro-benchmarks with same-run baselines")
    bench.add_argument(
        "suite",
        nargs="?",
        default=None,
        choices=[
            "core",
            "index",
            "routing",
            "gpu",
            "host_loads",
            "stores",
            "transfer",
            "vllm",
            "scheduler",
            "soak",
            "serve",
        ],
        help="default: all (soak, vllm, scheduler and serve only when named)",
    )
    bench.add_argument("--quick", action="store_true", help="short run (CI)")
    bench.add_argument(
        "--scale", action="store_true", help="index only: one shard at 1M-100M memberships, then 1-8 shards"
    )
    bench.add_argument("--scale-json", default=None, help="with --scale: write the in-process rows here")
    _add_soak_arguments(bench.add_argument_group("soak"))
    _add_serve_arguments(bench.add_argument_group("serve (--seed too)"))
    bench.set_defaults(func=_bench)
    add_ops_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

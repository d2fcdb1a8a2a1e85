"""The ``raykv`` command.

``raykv demo``        the main job: a Ray deployment, the built-in workload through every router
``raykv demo --core`` the in-process core demo (multi-turn workload, oracle-verified)
``raykv replay``      compare routers on a Mooncake trace or the built-in workload
``raykv bench``       every suite, one combined table (``--quick``: CI)
``raykv bench core``  core micro-benchmarks (block keys, tree ops, host<->disk copies)
``raykv bench index`` prefix index: route latency, event ingest, route calls/s through Ray
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
    from actors.demo import demo_main

    return demo_main(args)


def _bench(args: argparse.Namespace) -> int:
    from raykv.bench import run_all_benchmarks, run_benchmarks

    if args.suite in ("routing", None):
        import actors.ray_tree  # noqa: F401 - the routing suite's baseline is Ray's PrefixTree

    if args.suite in ("index", None):
        from actors.bench import register

        register()
    if args.suite in ("transfer", None):
        from actors.transfer import register_bench

        register_bench()
    if args.suite == "soak":  # not part of "all": a live deployment for minutes
        from actors.soak import soak_main

        return soak_main(args)
    if args.suite == "vllm":  # not part of "all": it needs vllm and takes minutes
        from actors.vllm_bench import register as register_vllm

        register_vllm()
    if args.suite == "serve":  # not part of "all": Ray Serve LLM with vLLM engines, minutes
        from actors.bench_serve import serve_bench_main

        return serve_bench_main(args)
    if args.suite == "scheduler":  # not part of "all": it needs vllm
        from actors.vllm_sched_bench import register as register_scheduler

        register_scheduler()
    if args.suite is None:
        return run_all_benchmarks(quick=args.quick)
    return run_benchmarks(args.suite, quick=args.quick)


def _add_soak_arguments(parser: Any) -> None:
    """The soak's options (on ``raykv bench``; the other suites ignore them). Kept here, not in
    actors.soak, so building the parser never imports Ray."""
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
    from actors.demo import add_demo_arguments
    from actors.ops import add_ops_parsers
    from actors.replay_cli import add_replay_parser

    demo = sub.add_parser("demo", help="compare routers on a local Ray deployment (--core: core demo)")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)
    add_replay_parser(sub)
    bench = sub.add_parser("bench", help="micro-benchmarks with same-run baselines")
    bench.add_argument(
        "suite",
        nargs="?",
        default=None,
        choices=["core", "index", "routing", "gpu", "transfer", "vllm", "scheduler", "soak", "serve"],
        help="default: all (soak, vllm, scheduler and serve only when named)",
    )
    bench.add_argument("--quick", action="store_true", help="short run (CI)")
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

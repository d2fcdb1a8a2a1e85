"""The ``raykv`` command.

``raykv demo``        run the in-process core demo (multi-turn workload, oracle-verified)
``raykv bench core``  core micro-benchmarks (block keys, tree ops, host<->disk copies)
``raykv bench index`` prefix index: route latency, event ingest, route calls/s through Ray
"""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from raykv.demo import run_demo

    result = run_demo(conversations=args.conversations, turns=args.turns, seed=args.seed)
    print(f"demo finished in {result.seconds:.1f}s")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from raykv.bench import run_benchmarks

    if args.suite == "index":
        from actors.bench import register

        register()
    return run_benchmarks(args.suite, quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raykv", description="raykv: distributed KV cache")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo workload and verify every cached block")
    demo.add_argument("--conversations", type=int, default=12)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="micro-benchmarks with same-run baselines")
    bench.add_argument("suite", nargs="?", default="core", choices=["core", "index"])
    bench.add_argument("--quick", action="store_true", help="short run (CI)")
    bench.set_defaults(func=_bench)
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

"""Micro-benchmarks with same-run baselines (``raykv bench <suite> [--quick]``).

Each suite prints one table: benchmark, our figure, a baseline measured in the same run on the same
data, the unit, and ``ratio = ours / baseline`` (every unit is higher-is-better). Ratios, not
absolute figures, are what to compare across machines. Suites:

``core``  block keys vs raw sha256, radix tree ops, host <-> disk copies (:mod:`raykv.bench.core`)
``index`` prefix-index route latency and event ingest, in-process (:mod:`raykv.bench.index`);
          ``actors.bench.index`` adds the through-Ray rows when the CLI runs it
``routing`` a routing decision (index route + cost model) vs Ray Serve LLM's PrefixTree
          (:mod:`raykv.bench.routing`; imports ray.llm lazily)
``gpu``   GPU tier page copies (GPU <-> pinned host, within the pool) vs raw CUDA copies of the
          same bytes (:mod:`raykv.bench.gpu`; needs CUDA)
``transfer`` page pulls (shared memory, UCX) vs memcpy and raw ucxx between two processes
          (:mod:`raykv.bench.transfer`); ``actors.cache.transfer`` adds the Ray object-store row
``host_loads`` the vLLM connector's worker-side loads from a CacheWorker's shared host tier into
          a CUDA engine's blocks vs a raw pinned host-to-device copy
          (:mod:`raykv.bench.vllm_host_loads`; needs CUDA, not vLLM)
``stores`` the vLLM connector's worker-side stores from a CPU engine, one copy (shared KV memory)
          and two (inbox), vs a memcpy (:mod:`raykv.bench.vllm_stores`; needs torch, not vLLM)

The suites of :data:`CUDA_SUITES` are left out of :func:`run_all_benchmarks` without a CUDA device.

Return codes: 0 when every benchmark ran, 1 when one raised (it is reported, the others still run).
A slow figure is never a failure: noise must not break CI. An unknown suite name is a programming
error and raises ValueError (:class:`raykv.core.errors.InvalidArgumentError`) before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from typing import TextIO

from raykv.bench.harness import Benchmark, Row, default_streams, run_suite
from raykv.core.errors import InvalidArgumentError


def _core(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.core import suite

    return suite(quick)


def _index(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.index import suite

    return suite(quick)


def _transfer(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.transfer import transfer_suite

    return transfer_suite(quick)


def _gpu(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.gpu import suite

    return suite(quick)


def _host_loads(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.vllm_host_loads import suite

    return suite(quick)


def _stores(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.vllm_stores import suite

    return suite(quick)


def _routing(quick: bool) -> tuple[list[Benchmark], str]:
    from raykv.bench.routing import suite

    return suite(quick)


SUITES: dict[str, Callable[[bool], tuple[list[Benchmark], str]]] = {
    "core": _core,
    "index": _index,
    "routing": _routing,
    "transfer": _transfer,
    "gpu": _gpu,
    "host_loads": _host_loads,
    "stores": _stores,
}
"""Suite name -> builder of (benchmarks, description line). Later suites register here."""
CUDA_SUITES = frozenset({"gpu", "host_loads"})
"""Suites that need a CUDA device (skipped by :func:`run_all_benchmarks` without one)."""


def run_benchmarks(
    suite: str, quick: bool = False, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run one suite, print its table to ``out`` (stdout) and progress to ``err`` (stderr).

    ``quick`` shortens every benchmark (CI: the core suite takes a few seconds). Returns 0 when
    every benchmark ran, 1 when any raised. Raises ValueError for an unknown suite name.
    """
    builder = SUITES.get(suite)
    if builder is None:
        raise InvalidArgumentError("suite", f"unknown benchmark suite {suite!r}; known: {sorted(SUITES)}")
    benchmarks, description = builder(bool(quick))
    stdout, stderr = default_streams(out, err)
    return run_suite(suite, benchmarks, description, stdout, stderr)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def run_all_benchmarks(
    quick: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    exclude: Collection[str] = (),
) -> int:
    """Run every registered suite (those of :data:`CUDA_SUITES` only when CUDA is present) and
    print one combined table.

    Suites named in ``exclude`` are left out (the caller reports why: e.g. the CLI when Ray is
    missing). Each row's name is prefixed with its suite (``[core] ...``). Returns 0 when every
    benchmark ran, 1 when any raised.
    """
    benchmarks: list[Benchmark] = []
    descriptions: list[str] = []
    for name, builder in SUITES.items():
        if name in exclude or (name in CUDA_SUITES and not _cuda_available()):
            continue
        benches, desc = builder(bool(quick))
        descriptions.append(f"{name}: {desc}")
        benchmarks += [_prefixed(name, b) for b in benches]
    stdout, stderr = default_streams(out, err)
    return run_suite("all", benchmarks, "; ".join(descriptions), stdout, stderr)


def _prefixed(suite: str, bench: Benchmark) -> Benchmark:
    def run() -> list[Row]:
        return [replace(row, name=f"[{suite}] {row.name}") for row in bench.run()]

    return Benchmark(f"[{suite}] {bench.name}", run)


__all__ = ["SUITES", "Benchmark", "Row", "run_all_benchmarks", "run_benchmarks"]

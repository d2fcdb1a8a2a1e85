"""Benchmark plumbing shared by every suite: rows, timing, the table, the suite runner.

A suite is a list of :class:`Benchmark` entries; each one runs and returns :class:`Row` s. Every row
carries our figure and, when there is one, a baseline measured in the same run on the same data, so
the ratio (``ours / baseline``, every unit is higher-is-better) is robust to the machine's speed.

Timing: ``time.perf_counter`` around each sample, a few warmup samples first, the median of the
rest. Ours and the baseline are sampled alternately (and in alternating order) so slow drift of the
machine hits both alike. The cyclic garbage collector is paused while sampling, as ``timeit`` does.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

import numpy as np

Sampler = Callable[[], float]
"""Runs the measured operation once and returns the seconds it took (setup excluded)."""


@dataclass(frozen=True)
class Row:
    """One line of the table. ``baseline`` is None when there is nothing to compare with.

    ``goal`` is the minimum ratio an issue asks for; it is informational only (noise never fails a
    run). ``error`` replaces the figures when the benchmark raised.
    """

    name: str
    ours: float
    baseline: float | None
    unit: str
    goal: float | None = None
    error: str | None = None
    info: str = ""

    @property
    def ratio(self) -> float | None:
        """``ours / baseline`` (higher is better), or None without a usable baseline."""
        if self.baseline is None or self.baseline <= 0 or self.error is not None:
            return None
        return self.ours / self.baseline

    @property
    def note(self) -> str:
        if self.error is not None:
            return self.error
        ratio = self.ratio
        if self.goal is None or ratio is None:
            return self.info
        verdict = "met" if ratio >= self.goal else "BELOW"
        return f"goal >= {self.goal:.2f}x: {verdict}" + (f"; {self.info}" if self.info else "")


@dataclass(frozen=True)
class Benchmark:
    """A named unit of work; ``run`` returns its rows. If it raises, the suite reports an error row."""

    name: str
    run: Callable[[], list[Row]]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit), as ``timeit`` does."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def timed(fn: Callable[[], object]) -> Sampler:
    """A sampler that times one call of ``fn``."""

    def sample() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return sample


def median_seconds(sampler: Sampler, repeats: int, warmup: int) -> float:
    """Median of ``repeats`` samples after ``warmup`` untimed ones."""
    with gc_paused():
        for _ in range(warmup):
            sampler()
        return statistics.median(sampler() for _ in range(repeats))


def paired_seconds(
    ours: Sampler, base: Sampler, repeats: int, warmup: int, warm_s: float = 0.0
) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``base``, sampled alternately (order flips every round),
    after ``warmup`` untimed pairs and, with ``warm_s``, untimed pairs for at least that many
    seconds (a GPU left idle clocks down; a few 50 us samples do not bring it back up, and a
    copy kernel then runs slower than the copy engines' raw copy it is compared with)."""
    mine: list[float] = []
    theirs: list[float] = []
    with gc_paused():
        start, done = time.perf_counter(), 0
        while done < warmup or time.perf_counter() - start < warm_s:
            ours()
            base()
            done += 1
        for i in range(repeats):
            if i % 2:
                theirs.append(base())
                mine.append(ours())
            else:
                mine.append(ours())
                theirs.append(base())
    return statistics.median(mine), statistics.median(theirs)


def fmt_value(value: float | None) -> str:
    """A figure with 3-4 significant digits and no thousands separator ("-" for None)."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_table(rows: list[Row]) -> str:
    """Aligned text table: benchmark, ours, baseline, unit, ratio, note."""
    head = ("benchmark", "ours", "baseline", "unit", "ratio", "note")
    cells = [head]
    for row in rows:
        if row.error is not None:
            cells.append((row.name, "ERROR", "-", "-", "-", row.note))
            continue
        ratio = row.ratio
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        cells.append((row.name, fmt_value(row.ours), fmt_value(row.baseline), row.unit, ratio_text, row.note))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = []
    for n, line in enumerate(cells):
        name, ours, base, unit, ratio_text, note = line
        text = (
            f"{name:<{widths[0]}}  {ours:>{widths[1]}}  {base:>{widths[2]}}  "
            f"{unit:<{widths[3]}}  {ratio_text:>{widths[4]}}  {note}"
        )
        lines.append(text.rstrip())
        if n == 0:
            lines.append("-" * max(len(text.rstrip()), sum(widths) + 10))
    return "\n".join(lines)


def environment() -> str:
    """One line naming the interpreter, numpy and the machine (for reading tables later)."""
    return (
        f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
        f"{platform.machine()} {platform.system()}"
    )


def run_suite(suite: str, benchmarks: list[Benchmark], description: str, out: TextIO, err: TextIO) -> int:
    """Run every benchmark, print one table to ``out`` and progress to ``err``.

    A benchmark that raises is reported (traceback on ``err``, an ERROR row in the table) and the
    others still run. Returns 0 when none raised, 1 otherwise.
    """
    rows: list[Row] = []
    failures = 0
    start = time.perf_counter()
    for i, bench in enumerate(benchmarks, 1):
        err.write(f"bench {suite} [{i}/{len(benchmarks)}] {bench.name} ...")
        err.flush()
        t0 = time.perf_counter()
        try:
            got = bench.run()
        except Exception as exc:
            failures += 1
            err.write(f" FAILED ({type(exc).__name__})\n")
            traceback.print_exc(file=err)
            rows.append(Row(bench.name, math.nan, None, "", error=f"{type(exc).__name__}: {exc}"[:120]))
            continue
        rows.extend(got)
        err.write(f" {time.perf_counter() - t0:.2f}s\n")
        err.flush()
    elapsed = time.perf_counter() - start
    out.write(f"raykv bench {suite}: {description}\n")
    out.write(f"{environment()}\n")
    out.write(
        "ratio = ours / baseline (higher is better); MB = 10^6 bytes; baseline measured in this run\n\n"
    )
    out.write(format_table(rows) + "\n\n")
    status = "OK" if failures == 0 else f"FAILED: {failures} benchmark(s) raised"
    out.write(f"{suite}: {len(rows)} rows, {failures} errors, {elapsed:.1f}s: {status}\n")
    out.flush()
    return 0 if failures == 0 else 1


def default_streams(out: TextIO | None, err: TextIO | None) -> tuple[TextIO, TextIO]:
    """``out`` and ``err``, defaulting to the current ``sys.stdout`` / ``sys.stderr``."""
    return (sys.stdout if out is None else out), (sys.stderr if err is None else err)


def module_main(
    name: str,
    suite: Callable[[bool], tuple[list[Benchmark], str]],
    note: str = "",
    argv: list[str] | None = None,
) -> int:
    """``python -m raykv.bench.<name> [--quick]``: run that suite alone, without Ray (``note``
    names rows that need Ray and the command that adds them). Returns the exit code."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m raykv.bench.{name}")
    parser.add_argument("--quick", action="store_true", help="short run (CI)")
    args = parser.parse_args(argv)
    if note:
        sys.stderr.write(f"without Ray; {note}\n")
    benchmarks, description = suite(bool(args.quick))
    stdout, stderr = default_streams(None, None)
    return run_suite(name, benchmarks, description, stdout, stderr)


def part_of(suite: str) -> int:
    """For ``python -m`` on a module that only serves a suite: say which command runs it."""
    sys.stderr.write(f"this module is part of the {suite} suite: python -m raykv.bench.{suite} [--quick]\n")
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(part_of("core"))

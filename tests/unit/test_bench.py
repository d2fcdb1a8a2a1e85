"""Benchmarks: the core suite runs (quick mode), prints every row with numbers, returns 0; a raising
benchmark is reported and makes the run return 1; an unknown suite raises ValueError."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from actors.cli.main import main as cli_main
from raykv.bench import run_benchmarks
from raykv.bench.core_io import checksum_functions
from raykv.bench.harness import Benchmark, Row, format_table, run_suite

KEY_ROWS = [f"block_keys {kind} tpb={tpb}" for tpb in (16, 32, 64) for kind in ("numpy int32", "list")]
COPY_ROWS = [
    f"{op} {kib}KiB x64"
    for kib in (64, 512)
    for op in ("copy host->host", "demote host->disk", "promote disk->host")
]
WITH_BASELINE = [
    *KEY_ROWS,
    "probe(keys) 100-block prefix",
    "tree.match 100-block prefix",
    *COPY_ROWS,
    *(f"checksum zlib.crc32 {kib}KiB x64" for kib in (64, 512)),
    "manager demotion 64KiB x128 (extend)",
]
WITHOUT_BASELINE = ["commit lifecycle 100 blocks", "create+close 100-block prefix"]


def parse_row(table: str, name: str) -> list[str]:
    """The cells after ``name`` (ours, baseline, unit, ratio, note words) of its one table line."""
    lines = [line for line in table.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"row {name!r} appears {len(lines)} times"
    return lines[0][len(name) :].split()


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str, str]:
    """``raykv bench core --quick`` through the CLI (which calls run_benchmarks with the process's
    streams): its exit code, stdout and stderr. One run serves every test here (~12 s)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["bench", "core", "--quick"])
    return rc, out.getvalue(), err.getvalue()


def test_core_quick_returns_zero_and_prints_every_row(quick_run: tuple[int, str, str]) -> None:
    rc, out, err = quick_run
    assert rc == 0, out + err
    assert "ERROR" not in out
    assert out.rstrip().splitlines()[-1].endswith("OK")
    for name in WITH_BASELINE:
        ours, base, unit, ratio = parse_row(out, name)[:4]
        assert float(ours) > 0 and float(base) > 0, name
        assert unit in ("MB/s", "ops/s"), name
        assert ratio.endswith("x") and math.isclose(
            float(ratio[:-1]), float(ours) / float(base), rel_tol=0.05, abs_tol=0.01
        ), name
    for name in WITHOUT_BASELINE:
        ours, base, _unit, ratio = parse_row(out, name)[:4]
        assert float(ours) > 0 and base == "-" and ratio == "-", name
    assert err.count("bench core [") == 8  # one progress line per benchmark


def test_numpy_block_keys_rows_carry_the_goal(quick_run: tuple[int, str, str]) -> None:
    _rc, out, _err = quick_run
    for tpb in (16, 32, 64):
        assert "goal >= 0.70x" in " ".join(parse_row(out, f"block_keys numpy int32 tpb={tpb}"))


def test_unknown_suite_raises_value_error_and_prints_nothing() -> None:
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(ValueError, match="unknown benchmark suite"):
        run_benchmarks("no-such-suite", out=out, err=err)
    assert out.getvalue() == "" and err.getvalue() == ""


def test_a_raising_benchmark_is_reported_and_the_others_still_run() -> None:
    def boom() -> list[Row]:
        raise RuntimeError("kaput")

    benches = [
        Benchmark("bad", boom),
        Benchmark("good", lambda: [Row("good row", 2.0, 4.0, "MB/s")]),
    ]
    out, err = io.StringIO(), io.StringIO()
    rc = run_suite("test", benches, "unit test", out, err)
    assert rc == 1
    assert parse_row(out.getvalue(), "bad")[0] == "ERROR"
    assert "RuntimeError: kaput" in out.getvalue()
    assert parse_row(out.getvalue(), "good row")[:4] == ["2.00", "4.00", "MB/s", "0.50x"]
    assert "Traceback" in err.getvalue()
    assert "FAILED: 1 benchmark(s) raised" in out.getvalue()


def test_rows_ratio_goal_and_alignment() -> None:
    assert Row("a", 3.0, None, "ops/s").ratio is None
    assert Row("a", 3.0, 0.0, "ops/s").ratio is None
    assert Row("a", 3.0, 4.0, "MB/s", goal=0.7).note == "goal >= 0.70x: met"
    assert Row("a", 1.0, 4.0, "MB/s", goal=0.7).note == "goal >= 0.70x: BELOW"
    table = format_table([Row("short", 1.0, 2.0, "MB/s"), Row("a much longer name", 12345.0, None, "ops/s")])
    header, _rule, first, second = table.splitlines()
    assert header.index("ours") + len("ours") == first.index("1.00") + len("1.00")
    assert first.index("1.00") + len("1.00") == second.index("12345") + len("12345")


def test_cli_bench_core_quick_exit_code(quick_run: tuple[int, str, str]) -> None:
    rc, out, _err = quick_run
    assert rc == 0
    rows = 17 + 2 * len(checksum_functions())  # one checksum row per installed function and page size
    assert f"core: {rows} rows, 0 errors" in out

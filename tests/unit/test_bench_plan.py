"""``raykv bench`` without Ray: the suites and parts that need Ray are skipped with a line naming
them and the import error, everything else runs, and the exit code says whether what ran passed.

The subprocess runs put a ``ray`` package on PYTHONPATH whose import raises ImportError (a broken
or missing install); they run cheap selections (``bench transfer --quick``: its own rows, about
5 s; ``bench routing``/``bench soak``: nothing runs). The default run's selection is
checked in-process through :func:`actors.bench.plan.plan_suites` with an injected import check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.bench.plan import Skip, named_only_missing, plan_suites

REPO_ROOT = Path(__file__).resolve().parents[2]
BROKEN = "simulated broken install"


@pytest.fixture(scope="module")
def no_ray_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PYTHONPATH whose ``ray`` package raises ImportError on import (then the repository)."""
    root = tmp_path_factory.mktemp("no_ray")
    (root / "ray").mkdir()
    (root / "ray" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return os.pathsep.join([str(root), str(REPO_ROOT)])


def _bench(pythonpath: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from actors.cli.main import main; sys.exit(main())",
            "bench",
            *args,
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_transfer_quick_runs_its_own_rows_and_skips_the_ray_row(no_ray_path: str) -> None:
    proc = _bench(no_ray_path, "transfer", "--quick")
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "transfer: " in proc.stdout and " 0 errors" in proc.stdout, proc.stdout
    skip = f"skipped: transfer vs Ray object store (needs ray: {BROKEN})"
    assert skip in proc.stdout.splitlines(), proc.stdout
    assert "object store" not in proc.stdout.replace(skip, ""), proc.stdout


@pytest.mark.parametrize(
    ("suite", "line"),
    [
        ("routing", f"skipped: routing (needs ray.llm: {BROKEN})"),
        ("soak", f"skipped: soak (needs ray: {BROKEN}) - nothing ran"),
    ],
)
def test_a_named_suite_that_needs_ray_says_so_and_exits_1(no_ray_path: str, suite: str, line: str) -> None:
    proc = _bench(no_ray_path, suite, "--quick")
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert line in proc.stdout.splitlines(), proc.stdout


def test_the_default_run_leaves_out_routing_and_the_ray_rows_without_ray() -> None:
    """No part is registered (its module never imported) when its requirement fails."""
    checked: list[str] = []

    def no_ray(module: str) -> str | None:
        checked.append(module)
        return "No module named 'ray'" if module.partition(".")[0] == "ray" else None

    plan = plan_suites(None, check=no_ray, cuda=lambda: False)
    assert plan.excluded == {"routing", "gpu"}
    assert [s.line() for s in plan.skipped] == [
        "skipped: index through Ray (needs ray: No module named 'ray')",
        "skipped: routing (needs ray.llm: No module named 'ray')",
        "skipped: transfer vs Ray object store (needs ray: No module named 'ray')",
        "skipped: gpu (no CUDA device)",
    ]
    assert len(checked) == 3


def test_a_named_suite_checks_only_its_own_parts() -> None:
    plan = plan_suites("core", check=lambda m: "missing", cuda=lambda: False)
    assert plan.skipped == () and plan.excluded == frozenset()
    plan = plan_suites("gpu", check=lambda m: "missing", cuda=lambda: False)
    assert plan.skipped == ()  # a named gpu suite reports its own error row without CUDA


def test_named_only_suites_report_the_first_missing_requirement() -> None:
    missing = {"vllm": "No module named 'vllm'"}
    want = Skip("serve", "needs vllm: No module named 'vllm'")
    assert named_only_missing("serve", check=missing.get) == want
    assert named_only_missing("soak", check=missing.get) is None
    with pytest.raises(KeyError):
        named_only_missing("core", check=missing.get)

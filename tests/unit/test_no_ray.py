"""The pure core never imports ray, and keeps torch lazy.

Each check runs in a fresh interpreter so modules already imported by the test session (or by
other tests) cannot hide an import.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import raykv

REPO_ROOT = Path(__file__).resolve().parents[2]

# Installs a finder that refuses ray (and every ray.* submodule) and records every attempt to
# import ray or torch, then imports raykv and every submodule found by pkgutil.walk_packages.
_NO_RAY_CHILD = r"""
import importlib
import importlib.abc
import json
import pkgutil
import sys

attempts = []


class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in ("ray", "torch"):
            attempts.append(fullname)
        if top == "ray":
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by test)", name=fullname)
        return None


sys.meta_path.insert(0, Guard())
for name in [m for m in sys.modules if m.partition(".")[0] == "ray"]:
    del sys.modules[name]

# the guard works
for blocked in ("ray", "ray.serve", "ray.util.state"):
    try:
        importlib.import_module(blocked)
    except ImportError:
        pass
    else:
        raise SystemExit(f"guard failed to block {blocked}")
attempts.clear()

import raykv

after_root = {
    "attempts": list(attempts),
    "ray": [m for m in sys.modules if m.partition(".")[0] == "ray"],
    "torch": [m for m in sys.modules if m.partition(".")[0] == "torch"],
}

names = sorted(m.name for m in pkgutil.walk_packages(raykv.__path__, "raykv."))
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"

after_all = {
    "attempts": list(attempts),
    "ray": [m for m in sys.modules if m.partition(".")[0] == "ray"],
    "torch": [m for m in sys.modules if m.partition(".")[0] == "torch"],
}

try:
    raykv.start
except AttributeError as exc:
    start = "AttributeError: " + str(exc)
except BaseException as exc:
    start = f"{type(exc).__name__}: {exc}"
else:
    start = "no error"

print(json.dumps({
    "file": raykv.__file__,
    "names": names,
    "failed": failed,
    "after_root": after_root,
    "after_all": after_all,
    "start": start,
    "ray_after_start": [m for m in sys.modules if m.partition(".")[0] == "ray"],
}))
"""

_CLEAN_CHILD = r"""
import json
import sys

import raykv

print(json.dumps({
    "file": raykv.__file__,
    "ray": "ray" in sys.modules,
    "torch": "torch" in sys.modules,
    "ray_any": [m for m in sys.modules if m.partition(".")[0] == "ray"],
    "torch_any": [m for m in sys.modules if m.partition(".")[0] == "torch"],
    "has_manager": hasattr(raykv, "CacheManager"),
}))
"""


def run_child(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_submodules() -> set[str]:
    return {m.name for m in pkgutil.walk_packages(raykv.__path__, "raykv.")}


def test_every_submodule_imports_without_ray():
    out = run_child(_NO_RAY_CHILD)
    assert out["file"] == str(REPO_ROOT / "raykv" / "__init__.py")
    names = set(out["names"])
    assert names == expected_submodules()
    # sanity: walk_packages really found the core modules, including subpackages
    for must in (
        "raykv.core.keys",
        "raykv.core.config",
        "raykv.core.manager",
        "raykv.core.tiers.gpu",
        "raykv.core.tiers.host",
    ):
        assert must in names
    assert out["failed"] == {}
    for stage in ("after_root", "after_all"):
        assert out[stage]["ray"] == [], stage
        assert [a for a in out[stage]["attempts"] if a.partition(".")[0] == "ray"] == [], stage
        # torch is only imported lazily (when a GPU tier or tensor is actually used)
        assert out[stage]["torch"] == [], stage
        assert out[stage]["attempts"] == [], stage


def test_start_is_attribute_error_without_cluster():
    out = run_child(_NO_RAY_CHILD)
    assert out["start"].startswith("AttributeError"), out["start"]
    assert "start" in out["start"]
    assert out["ray_after_start"] == []


def test_clean_import_keeps_ray_and_torch_out():
    out = run_child(_CLEAN_CHILD)
    assert out["file"] == str(REPO_ROOT / "raykv" / "__init__.py")
    assert out["has_manager"] is True
    assert out["ray"] is False and out["ray_any"] == []
    assert out["torch"] is False and out["torch_any"] == []


def test_unknown_attribute_is_attribute_error():
    with pytest.raises(AttributeError):
        raykv.no_such_name  # noqa: B018


def test_no_ray_import_statement_anywhere_in_raykv() -> None:
    """Lazy imports inside functions count too: the Ray layer injects what raykv needs."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "raykv"
    pattern = re.compile(r"^\s*(from\s+ray(\.|\s)|import\s+ray\b)")
    hits = [
        f"{path.relative_to(root.parent)}:{n}"
        for path in root.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.match(line)
    ]
    assert hits == []


_BENCH_WITHOUT_RAY = r"""
import importlib.abc
import sys


class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by test)", name=fullname)
        return None


sys.meta_path.insert(0, Guard())
from actors.cli.main import main

sys.exit(main(sys.argv[1:]))
"""


def test_raykv_bench_gpu_and_core_run_without_ray() -> None:
    """``raykv bench gpu`` builds its parser and runs with Ray unimportable (on a machine without
    CUDA the suite reports one error row and exits 1; it must not fail on an import)."""
    for suite, codes in (("gpu", (0, 1)), ("core", (0,))):
        proc = subprocess.run(
            [sys.executable, "-c", _BENCH_WITHOUT_RAY, "bench", suite, "--quick"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "ModuleNotFoundError" not in proc.stderr, proc.stderr[-2000:]
        assert proc.returncode in codes, proc.stderr[-2000:]
        assert f"{suite}: " in proc.stdout and " rows, " in proc.stdout, proc.stdout[-2000:]


def test_python_m_bench_module_runs_its_suite() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "raykv.bench.core", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "core: " in proc.stdout and " 0 errors" in proc.stdout
    assert "block_keys" in proc.stdout

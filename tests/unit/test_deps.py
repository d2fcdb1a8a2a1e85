"""tests/deps.py: ``require`` skips a missing module by default and fails under RAYKV_REQUIRE_DEPS=1
(with the module's name and the import error in the message); ``require_cuda`` skips only for
the hardware."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from deps import REQUIRE_ENV, deps_required, require, require_cuda

MISSING = "raykv_no_such_module_for_deps_test"
TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture
def broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module on sys.path whose import raises ImportError (a broken install, not a missing one)."""
    name = "raykv_broken_module_for_deps_test"
    (tmp_path / f"{name}.py").write_text('raise ImportError("simulated broken install")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _set_env(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(REQUIRE_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_ENV, value)


@pytest.mark.parametrize("value", [None, "", "0"])
def test_a_missing_module_skips_without_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    _set_env(monkeypatch, value)
    assert not deps_required()
    with pytest.raises(pytest.skip.Exception, match=MISSING):
        require(MISSING)
    with pytest.raises(pytest.skip.Exception, match=f"^my reason \\(could not import '{MISSING}': No module"):
        require(MISSING, reason="my reason")


def test_a_missing_module_fails_under_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    assert deps_required()
    with pytest.raises(pytest.fail.Exception) as info:
        require(MISSING, reason="a skip reason is not used")
    message = str(info.value)
    assert f"{REQUIRE_ENV}=1: cannot import {MISSING!r}: ModuleNotFoundError" in message
    assert f"No module named {MISSING!r}" in message
    assert "a skip reason" not in message


def test_a_broken_module_fails_under_the_variable(
    broken_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    expected = f"'{broken_module}': ImportError: simulated broken install"
    with pytest.raises(pytest.fail.Exception, match=expected):
        require(broken_module)


def test_a_broken_module_raises_without_the_variable(
    broken_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest's own rule: only a ModuleNotFoundError is a skip."""
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(ImportError, match="simulated broken install"):
        require(broken_module)


@pytest.mark.parametrize("value", [None, "1"])
def test_an_importable_module_is_returned(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    _set_env(monkeypatch, value)
    assert require("json.decoder") is sys.modules["json.decoder"]


def _fake_torch(monkeypatch: pytest.MonkeyPatch, available: bool, count: int) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: available, device_count=lambda: count
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_require_cuda_skips_for_the_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    _fake_torch(monkeypatch, False, 0)
    with pytest.raises(pytest.skip.Exception, match=r"^no CUDA device$"):
        require_cuda()
    _fake_torch(monkeypatch, True, 1)
    with pytest.raises(pytest.skip.Exception, match=r"^needs 2 CUDA devices, found 1$"):
        require_cuda(2)
    torch = _fake_torch(monkeypatch, True, 2)
    assert require_cuda(2) is torch


def _pytest_on(test_file: Path, env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    if env_value is not None:
        env[REQUIRE_ENV] = env_value
    env["PYTHONPATH"] = str(TESTS_DIR)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=test_file.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_module_level_require_skips_then_fails_the_run(tmp_path: Path) -> None:
    """At module level: a skipped module without the variable (exit 5), a collection error naming
    the module with it (pytest exits non-zero, so CI goes red)."""
    test_file = tmp_path / "test_needs_missing.py"
    test_file.write_text(
        f"from deps import require\n\nrequire({MISSING!r})\n\n\ndef test_x() -> None:\n    pass\n"
    )
    skipped = _pytest_on(test_file, None)
    assert skipped.returncode == 5, skipped.stdout + skipped.stderr  # 5: no test ran, none failed
    assert "1 skipped" in skipped.stdout, skipped.stdout
    failed = _pytest_on(test_file, "1")
    assert failed.returncode not in (0, 5), failed.stdout + failed.stderr
    assert f"{REQUIRE_ENV}=1: cannot import {MISSING!r}: ModuleNotFoundError" in failed.stdout, failed.stdout
    assert "1 error" in failed.stdout, failed.stdout

"""The quick examples run and verify themselves (each asserts its own result)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUICK = ["core_lifecycle.py"]


@pytest.mark.parametrize("name", QUICK)
def test_example_runs(name: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")


def test_demo_command_verifies_every_block() -> None:
    from raykv.demo import run_demo

    class Sink:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    sink = Sink()
    result = run_demo(conversations=4, turns=3, seed=1, out=sink)  # type: ignore[arg-type]
    assert result.turns == 12
    assert result.verified_blocks > 0
    assert result.reused_tokens > 0
    assert "byte-for-byte" in sink.text and "OK" in sink.text

"""``TransferConfig.ucx_progress``: ucxx's progress mode, chosen before UCX starts (a fresh process
per mode, since UCX starts once per process); a ucx pull verifies its pages in either mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from transfer_support import commit, host_pair, seq
    from raykv import ContentOracle, KVLayout
    from raykv.transfer import TransferConfig

    layout = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4)
    oracle = ContentOracle(layout)
    pair = host_pair(layout, TransferConfig.loopback(timeout_s=20.0, ucx_progress={mode!r}))
    try:
        keys = commit(pair.src, oracle, seq(3, 12))
        for _ in range(3):
            pulled = pair.client.pull_sync(pair.server.address, keys, prefer_shm=False)
            assert pulled.path == "ucx" and pulled.verified and list(pulled.keys) == keys
            assert all(oracle.check(row, key) for key, row in zip(keys, pulled.data))
        import ucxx
        print("mode", ucxx.core._get_ctx().progress_mode, os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE"))
    finally:
        pair.close()
    """
)


@pytest.mark.parametrize(("mode", "expect"), [(None, "thread 1"), ("blocking", "blocking None")])
def test_pull_in_each_progress_mode(mode: str | None, expect: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCXPY_")}
    tests = os.path.dirname(os.path.abspath(__file__))
    code = SCRIPT.format(tests=tests, mode=mode)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"mode {expect}" in done.stdout

"""Two processes, one GPU pool: the owner exports its VMM chunks, an engine process maps them.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deps import require_cuda

torch = require_cuda()

import raykv  # noqa: E402
from raykv.core.errors import StateError, TransferError  # noqa: E402
from raykv.core.tiers.gpu import GpuPool  # noqa: E402
from raykv.gpu_oracle import DeviceOracle  # noqa: E402
from raykv.ipc import PoolExporter, attach  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("engine_proc.py")
LAYOUT = raykv.KVLayout.uniform(4, 4, 128, tokens_per_block=16, dtype="bfloat16")  # 256 KiB pages


def _keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") * 7 + b"kvx" for i in range(n)]


def test_engine_process_reads_and_writes_the_pool_zero_copy() -> None:
    pool = GpuPool(raykv.TierConfig.gpu(48 * LAYOUT.page_bytes), LAYOUT)
    assert pool.arena is not None and pool.arena.exportable, "VMM pool not exportable here"
    dev = DeviceOracle(LAYOUT, pool.device)
    slots = pool.allocate(48)
    owner_slots, engine_slots = slots[:24], slots[24:]
    owner_keys, engine_keys = _keys(24, 1), _keys(24, 2)
    dev.fill(pool, owner_slots, owner_keys)
    pool.tensor[torch.as_tensor(engine_slots, device=pool.device)] = 0
    torch.cuda.synchronize()
    spec = {
        "page_bytes": LAYOUT.page_bytes,
        "owner_slots": [int(s) for s in owner_slots],
        "owner_keys": [k.hex() for k in owner_keys],
        "engine_slots": [int(s) for s in engine_slots],
        "engine_keys": [k.hex() for k in engine_keys],
    }
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with PoolExporter(pool) as exporter:
        assert pool.shared
        proc = subprocess.run(
            [sys.executable, str(ENGINE), exporter.path, json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_slots"] == 48 and summary["k_shape"] == [48, 16, 4, 128]
    assert all(dev.check(pool, engine_slots, engine_keys)), "engine's writes not visible to the owner"
    assert all(dev.check(pool, owner_slots, owner_keys))
    assert not os.path.exists(exporter.path)
    pool.close()


def test_attach_without_a_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TransferError, match="no GPU pool served"):
        attach(str(tmp_path / "nothing.sock"), timeout=1.0)


def test_plain_allocation_pool_cannot_be_shared() -> None:
    pool = GpuPool(raykv.TierConfig.gpu(4 * LAYOUT.page_bytes), LAYOUT, use_vmm=False)
    with pytest.raises(StateError, match="virtual-memory"):
        PoolExporter(pool)
    pool.close()

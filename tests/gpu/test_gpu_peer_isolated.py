"""gpu_peer between processes that each see one GPU (how Ray pins a worker per GPU).

The owner runs with CUDA_VISIBLE_DEVICES=0, the puller with CUDA_VISIBLE_DEVICES=1: the puller
maps memory of a device it cannot see. Either the driver allows it (the pull takes gpu_peer) or
it refuses and ``pull_pages`` falls back to UCX; in both cases every byte must match the oracle.
Skipped without 2 CUDA devices, or without ucxx (a failure instead under RAYKV_REQUIRE_DEPS=1).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

from deps import require, require_cuda

torch = require_cuda(2)
require("ucxx")

from raykv.bench.gpu_transfer import Scenario, ServerProcess  # noqa: E402

SCENARIO = Scenario("32x512KiB", 512, 32)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pull_between_isolated_gpus_is_byte_exact() -> None:
    token = secrets.token_bytes(32)
    server = ServerProcess(token, [SCENARIO], device=0, env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        entry = server.ready["servers"][SCENARIO.name]
        spec = {"keys": entry["keys"], "page_kib": SCENARIO.page_kib, "port": entry["staged"]}
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="1", RAYKV_TRANSFER_TOKEN=token.hex())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        script = os.path.join(ROOT, "tests", "gpu", "peer_client.py")
        done = subprocess.run(
            [sys.executable, script, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print("isolated GPUs:", result, done.stderr[-1500:])
        assert result["ok"] and result["imported"] == SCENARIO.pages
        assert result["path"] in ("gpu_peer", "ucx")
    finally:
        server.close()

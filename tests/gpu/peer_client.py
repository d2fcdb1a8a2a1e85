"""A client process for tests/gpu/test_gpu_peer_isolated.py: pulls every key from a page server
into a GPU tier on its (only visible) device with ``pull_pages``, checks every byte with the device
oracle, and prints one JSON line: the path taken and whether every page matched."""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import torch

    from raykv.bench.gpu_transfer import gpu_manager
    from raykv.gpu_oracle import DeviceOracle
    from raykv.transfer import PageClient, PeerAddress, TransferConfig
    from raykv.transfer.planner import pull_pages

    spec = json.loads(sys.argv[1])
    token = bytes.fromhex(os.environ["RAYKV_TRANSFER_TOKEN"])
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    mgr = gpu_manager(spec["page_kib"], len(keys), device=0)
    client = PageClient(token, TransferConfig(host="127.0.0.1", timeout_s=60.0))
    try:
        outcome = pull_pages(client, PeerAddress("127.0.0.1", spec["port"]), mgr, keys)
        blocks = [mgr.tree.get(k) for k in keys]  # type: ignore[call-overload]
        slots = [int(b.page.slot) for b in blocks if b is not None]
        pool = mgr.top_pool
        ok = len(slots) == len(keys) and all(DeviceOracle(mgr.layout, pool.device).check(pool, slots, keys))
        torch.cuda.synchronize()
        mgr.check_invariants()
        print(json.dumps({"path": outcome.path, "ok": bool(ok), "imported": len(outcome.imported)}))
    finally:
        client.close()
        mgr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine side of tests/gpu/test_gpu_ipc.py, run as a separate process.

``python engine_proc.py SOCKET SPEC_JSON``: attach to the GPU pool served at SOCKET, verify on the
GPU that the owner's pages hold the oracle's bytes, check the K/V views, write new pages through
the device oracle, and print a JSON summary. Exit status 0 on success.
"""

from __future__ import annotations

import json
import sys

import torch

from raykv.gpu_oracle import DeviceOracle
from raykv.ipc import attach


def main() -> int:
    path, spec = sys.argv[1], json.loads(sys.argv[2])
    pool = attach(path)
    if pool.page_bytes != spec["page_bytes"] or pool.layout.page_bytes != spec["page_bytes"]:
        print(f"layout mismatch: {pool.page_bytes} != {spec['page_bytes']}", file=sys.stderr)
        return 2
    dev = DeviceOracle(pool.layout, torch.device("cuda", pool.device))
    owner_keys = [bytes.fromhex(k) for k in spec["owner_keys"]]
    flags = dev.check(pool, spec["owner_slots"], owner_keys)
    if not all(flags):
        print(f"owner pages differ: {flags}", file=sys.stderr)
        return 3
    for layer, (k, v) in enumerate(pool.kv_views()):
        slot = spec["owner_slots"][0]
        if not (
            torch.equal(k[slot], pool.buffer_view(slot, layer, "k"))
            and torch.equal(v[slot], pool.buffer_view(slot, layer, "v"))
        ):
            print(f"K/V view of layer {layer} disagrees with the page", file=sys.stderr)
            return 4
    engine_keys = [bytes.fromhex(k) for k in spec["engine_keys"]]
    dev.fill(pool, spec["engine_slots"], engine_keys)
    torch.cuda.synchronize()
    print(
        json.dumps(
            {"base": pool.base_address, "num_slots": pool.num_slots, "k_shape": list(pool.k_view(0).shape)}
        )
    )
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

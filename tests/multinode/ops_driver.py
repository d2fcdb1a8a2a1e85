"""A separate driver for tests/multinode/test_ops_cli.py: attaches to the deployment that
``raykv up`` started (RAY_ADDRESS, namespace argv[1]), runs one request on worker 0, waits for
the index, routes the prompt, has worker 1 pull its blocks from worker 0 and prints JSON."""

from __future__ import annotations

import json
import sys

import ray

import raykv
from actors.ray_util import shutdown_ray


def main(namespace: str, num_tokens: int) -> None:
    dep = raykv.connect(namespace=namespace)
    w0 = dep.workers[raykv.WorkerId("raykv-worker-0")]
    tokens = list(range(1000, 1000 + num_tokens))
    handle, reused = ray.get(w0.create.remote(tokens), timeout=60)
    assert ray.get(w0.resume.remote(handle), timeout=60)
    ray.get(w0.extend.remote(handle, tokens[reused:]), timeout=60)
    committed = ray.get(w0.commit.remote(handle), timeout=60)
    ray.get(w0.close.remote(handle), timeout=60)
    assert dep.flush() == []
    route = {str(w): m.blocks for w, m in dep.route(tokens).items()}
    pick = str(dep.pick_worker(tokens).worker)
    pull = dep.pull(raykv.WorkerId("raykv-worker-1"), raykv.WorkerId("raykv-worker-0"), dep.keys(tokens))
    out = {"committed": committed, "route": route, "pick": pick, "pull_path": pull.path}
    print(json.dumps({**out, "imported": len(pull.imported), "pulled_bytes": pull.nbytes}))
    dep.close()
    shutdown_ray()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

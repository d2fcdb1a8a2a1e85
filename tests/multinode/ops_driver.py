"""A separate driver for tests/multinode/test_ops_cli.py, attached to the cluster of RAY_ADDRESS;
prints one JSON line.

``request NS N``: on the deployment ``raykv up`` started in namespace NS, run one request of N
tokens on worker 0, wait for the index, route the prompt, pick a worker and have worker 1 pull
the blocks from worker 0. ``kill-registry NS``: kill the deployment's registry actor (as an
operator's mistake would). ``leftovers NS``: the named actors of NS and the placement groups of
the cluster that are not removed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray

import raykv
from actors.cache.ray_util import shutdown_ray


def request(namespace: str, num_tokens: int) -> dict[str, Any]:
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
    dep.close()
    out = {"committed": committed, "route": route, "pick": pick, "pull_path": pull.path}
    return {**out, "imported": len(pull.imported), "pulled_bytes": pull.nbytes}


def main(command: str, namespace: str, *rest: str) -> None:
    ray.init(namespace="raykv-ops-test-driver", log_to_driver=False, logging_level="ERROR")
    if command == "request":
        out = request(namespace, int(rest[0]))
    elif command == "kill-registry":
        ray.kill(ray.get_actor("raykv-registry", namespace=namespace), no_restart=True)
        out = {"killed": "raykv-registry"}
    else:
        named = ray.util.list_named_actors(all_namespaces=True)
        groups = ray.util.placement_group_table().values()
        out = {
            "actors": sorted(a["name"] for a in named if a["namespace"] == namespace),
            "placement_groups": sorted(g["name"] for g in groups if g["state"] != "REMOVED"),
        }
    print(json.dumps(out))
    shutdown_ray()


if __name__ == "__main__":
    main(*sys.argv[1:])

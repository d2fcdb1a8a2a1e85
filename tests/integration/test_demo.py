"""``raykv demo`` on a small workload: a real deployment, every router, oracle-verified pages."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import ray

from actors.cache.cluster import REGISTRY
from actors.cli.demo import run_ray_demo
from actors.replay.backends import RayBackend, RayBackends
from raykv.replay.routers import ROUTERS


def test_demo_prints_the_table_and_verifies_pages(ray_local: None, tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run_ray_demo(requests=60, workers=3, capacity_pcts=(30.0,), out_dir=tmp_path, out=out, err=err)
    text = out.getvalue()
    assert code == 0, text + err.getvalue()
    table = text[text.index("cap %") :]
    for name in ROUTERS:
        assert f" {name} " in table
    assert "oracle: verified" in text and "byte-for-byte: OK" in text
    verified = int(text.split("oracle: verified ")[1].split()[0])
    assert verified > 0
    data = json.loads((tmp_path / "demo.json").read_text())
    assert [r["router"] for r in data["results"]] == list(ROUTERS)
    assert all(r["requests"] == 60 for r in data["results"])
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert ray.is_initialized()  # the test's Ray is left running; the deployment is gone


def test_ray_backend_routes_pulls_and_clears(ray_local: None) -> None:
    from raykv.replay.engine import prepare
    from raykv.replay.trace import Request, tokens_for

    reqs = prepare([Request(0.0, 2048, 1, (0, 1, 2, 3)), Request(1.0, 2560, 1, (0, 1, 2, 3, 4))])
    with RayBackends(2) as backends:
        with backends(2, 16) as backend:
            assert isinstance(backend, RayBackend)
            a, b = backend.worker_ids
            out = backend.run(a, tokens_for(reqs[0].req), None)
            assert out.reused_tokens == 0
            assert backend.route(reqs[1].keys)[a].blocks == 4
            assert backend.pull(a, b, reqs[1].keys[:4]) == 4
            assert sum(backend.pull_paths.values()) == 4  # a real page transfer (shm on one node)
            assert backend.route(reqs[1].keys)[b].blocks == 4
            assert backend.run(b, tokens_for(reqs[1].req), None).reused_tokens == 2048
            assert backend.verify(4) >= 9
        namespace = backends.cluster.namespace
        with backends(2, 16) as backend:  # same capacity: same deployment, caches cleared
            assert backend.route(reqs[1].keys) == {}
    with pytest.raises(ValueError):
        ray.get_actor(REGISTRY, namespace=namespace)

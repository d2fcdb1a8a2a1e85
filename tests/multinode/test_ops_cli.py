"""``raykv up / status / down`` on a 2-node Ray cluster that cluster/local_cluster.py builds on
this machine (two ``ray start`` processes, one logical GPU each), as a user would run them:
every command a separate process. Checks that ``up`` places one worker per (logical) GPU on each
node through its placement group and refuses a second deployment; that ``status`` shows both
workers, their blocks, events and transfer bytes after a request, a route and a cross-node pull;
that Ray's Prometheus endpoints serve the raykv series with those values; and that ``down`` and
the script's ``stop`` leave no process, no placement group and no file behind.

The cluster's GPUs are a scheduling resource only: the cache has host and disk tiers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from actors.cache.metrics import prometheus_names

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cluster" / "local_cluster.py"
TPB = 4
PAGE = 2 * 2 * 2 * 8 * 2 * TPB  # 2 layers x (k, v) x 2 heads x 8 dims x float16 x 4 tokens = 512 B
BLOCKS = 6


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("local_cluster", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _raykv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "actors.cli.main", *args], env)


@pytest.fixture
def local_cluster() -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """The script's 2-node cluster (short directory: Ray's socket paths must stay short), and an
    environment that points RAY_ADDRESS at it; stopped and checked empty afterwards."""
    root = Path(tempfile.mkdtemp(prefix="rkv-", dir="/tmp"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_metrics_report_interval_ms="1000")
    env.pop("RAY_ADDRESS", None)
    started = _run(
        [sys.executable, str(SCRIPT), "start", "--dir", str(root), "--nodes", "2", "--gpus-per-node", "1"],
        env,
    )
    try:
        assert started.returncode == 0, started.stderr
        info = json.loads((root / "cluster.json").read_text())
        yield info, {**env, **info["env"]}
    finally:
        stopped = _run([sys.executable, str(SCRIPT), "stop", "--dir", str(root)], env)
        assert stopped.returncode == 0, stopped.stderr
        assert _script().cluster_pids(root) == []
        assert not root.exists()


Series = dict[str, dict[frozenset[tuple[str, str]], float]]
TAGS = re.compile(r'\b(worker|tier|path|shard|reason)="([^"]*)"')


def _driver(env: dict[str, str], *args: str) -> Any:
    """tests/multinode/ops_driver.py's JSON answer (a separate driver process)."""
    done = _run([sys.executable, str(ROOT / "tests" / "multinode" / "ops_driver.py"), *args], env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _watch(env: dict[str, str], namespace: str, reports: int) -> int:
    """``raykv status --watch 0.3`` until it printed ``reports`` tables, then Ctrl-C; its status."""
    cmd = [sys.executable, "-m", "actors.cli.main", "status", "--namespace", namespace, "--watch", "0.3"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        seen = 0
        while seen < reports:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line, "raykv status --watch ended early"
            seen += line.startswith(f"namespace {namespace}")
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _scrape(ip: str, ports: list[int]) -> Series:
    """The raykv series of every node's Prometheus endpoint: name -> {raykv tags: value}
    (values of equal raykv tags summed over Ray's own labels and the nodes)."""
    out: Series = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            m = re.match(r"^(ray_raykv_\w+)\{(.*)\} (\S+)$", line)
            if m and 'le="' not in m.group(2):
                tags = frozenset(TAGS.findall(m.group(2)))
                values = out.setdefault(m.group(1), {})
                values[tags] = values.get(tags, 0.0) + float(m.group(3))
    return out


def _value(series: Series, name: str, **tags: str) -> float:
    """Sum of ``name`` over the tag sets that include ``tags``."""
    want = set(tags.items())
    return sum(v for key, v in series.get(name, {}).items() if want <= key)


def _wait_metrics(ip: str, ports: list[int], ready: Any, timeout: float = 30.0) -> Series:
    """Scrape until ``ready(series)`` (metrics reach Ray's endpoint every second or so)."""
    deadline = time.monotonic() + timeout
    while True:
        series = _scrape(ip, ports)
        if ready(series) or time.monotonic() > deadline:
            return series
        time.sleep(0.5)


def _write_config(tmp_path: Path, namespace: str, disk: Path) -> Path:
    """2 index shards, the default worker count (one per logical GPU), small host and disk tiers."""
    config = tmp_path / "raykv.toml"
    config.write_text(
        f'[deployment]\nnamespace = "{namespace}"\nindex_shards = 2\n'
        f"[layout]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 8\ntokens_per_block = {TPB}\n"
        '[tiers.host]\ncapacity = "16KiB"\npin_memory = false\n'
        f'[tiers.disk]\ncapacity = "32KiB"\npath = "{disk}"\n'
    )
    return config


def _check_status(env: dict[str, str], namespace: str) -> dict[str, Any]:
    """``raykv status --json`` and the table after one request on worker 0 and its pull into
    worker 1; returns the JSON report."""
    status = _raykv(env, "status", "--json", "--namespace", namespace)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    w0, w1 = report["workers"]
    assert {w0["health"], w1["health"]} == {"up"}
    assert w0["node_id"] != w1["node_id"]  # one worker per node's GPU (placement group)
    assert (w0["blocks"], w0["events_published"], w0["served_bytes"]) == (BLOCKS, BLOCKS, BLOCKS * PAGE)
    assert (w1["blocks"], w1["pulled_bytes"], w1["served_bytes"]) == (BLOCKS, BLOCKS * PAGE, 0)
    assert w0["tiers"] == [["host", BLOCKS * PAGE, 16 << 10], ["disk", 0, 32 << 10]]
    s0, s1 = report["shards"]
    assert s0["node_id"] != s1["node_id"]  # shards spread over the nodes
    assert s0["keys"] + s1["keys"] == BLOCKS and (s0["memberships"], s1["memberships"]) == (2, 2)
    assert s0["event_lag"] == s1["event_lag"] == 0
    table = _raykv(env, "status", "--namespace", namespace)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    for name in ("raykv-worker-0", "raykv-worker-1", "raykv-index-0", "raykv-index-1"):
        assert any(line.startswith(name) and " up " in line for line in lines), table.stdout
    return report  # type: ignore[no-any-return]


def _check_metrics(info: dict[str, Any]) -> None:
    """The same request as Ray's Prometheus endpoints of both nodes report it."""
    series = _wait_metrics(
        info["address"].split(":")[0],
        [n["metrics_port"] for n in info["nodes"]],
        lambda s: (
            _value(s, "ray_raykv_transfer_pulled_bytes_total", worker="raykv-worker-1") == BLOCKS * PAGE
            and sum(s.get("ray_raykv_index_keys", {}).values()) == BLOCKS
            and _value(s, "ray_raykv_bytes_in_use", worker="raykv-worker-0", tier="host") == BLOCKS * PAGE
        ),
    )
    assert set(series) <= prometheus_names(), set(series) - prometheus_names()
    assert _value(series, "ray_raykv_transfer_pulled_bytes_total", worker="raykv-worker-1") == BLOCKS * PAGE
    assert _value(series, "ray_raykv_transfer_served_bytes_total", worker="raykv-worker-0") == BLOCKS * PAGE
    assert sum(series["ray_raykv_index_keys"].values()) == BLOCKS
    assert _value(series, "ray_raykv_bytes_in_use", worker="raykv-worker-0", tier="host") == BLOCKS * PAGE
    assert sum(series["ray_raykv_index_route_seconds_count"].values()) >= 2  # route + pick_worker
    assert _value(series, "ray_raykv_transfer_pull_seconds_count", worker="raykv-worker-1") == 1


def _down(env: dict[str, str], namespace: str, disk: Path, pids: list[int], stopped: str) -> None:
    """``raykv down`` stops ``stopped`` and leaves no actor, placement group, process or file."""
    down = _raykv(env, "down", "--namespace", namespace)
    assert down.returncode == 0, down.stderr
    assert f"raykv down in namespace '{namespace}': stopped {stopped}" in down.stdout
    gone = _raykv(env, "status", "--namespace", namespace)
    assert gone.returncode == 1 and f"no raykv deployment in namespace '{namespace}'" in gone.stderr
    assert list(disk.iterdir()) == []  # the disk tiers' files are removed
    assert _driver(env, "leftovers", namespace) == {"actors": [], "placement_groups": []}
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if psutil.pid_exists(p)] == []


def _pids(env: dict[str, str], namespace: str) -> list[int]:
    report = json.loads(_raykv(env, "status", "--json", "--namespace", namespace).stdout)
    return [w["pid"] for w in report["workers"]] + [s["pid"] for s in report["shards"]]


def test_up_status_route_down_on_two_nodes(
    local_cluster: tuple[dict[str, Any], dict[str, str]], tmp_path: Path
) -> None:
    t0 = time.monotonic()
    info, env = local_cluster
    namespace = f"rkv-ops-{uuid.uuid4().hex[:8]}"
    disk = tmp_path / "disk"
    disk.mkdir()
    config = _write_config(tmp_path, namespace, disk)
    up = _raykv(env, "up", "--config", str(config))
    assert up.returncode == 0, up.stderr
    assert f"raykv up in namespace '{namespace}': 2 workers, 2 index shards" in up.stdout
    again = _raykv(env, "up", "--config", str(config))
    assert again.returncode == 1 and "already runs in namespace" in again.stderr, again.stderr

    result = _driver(env, "request", namespace, str(BLOCKS * TPB))
    assert result["committed"] == BLOCKS and result["route"] == {"raykv-worker-0": BLOCKS}
    assert result["pick"] == "raykv-worker-0"
    assert result["imported"] == BLOCKS and result["pulled_bytes"] == BLOCKS * PAGE
    report = _check_status(env, namespace)
    _check_metrics(info)
    assert _watch(env, namespace, reports=2) == 0
    assert len(list(disk.iterdir())) == 2  # each worker's disk-tier file
    pids = [w["pid"] for w in report["workers"]] + [s["pid"] for s in report["shards"]]
    everything = "raykv-index-0, raykv-index-1, raykv-registry, raykv-worker-0, raykv-worker-1"
    _down(env, namespace, disk, pids, everything)
    print(f"2-node up/status/route/down: {time.monotonic() - t0:.1f}s after the cluster started")

    # again, with the registry gone by mistake: down finds every raykv actor by name
    assert _raykv(env, "up", "--config", str(config)).returncode == 0
    pids = _pids(env, namespace)
    assert _driver(env, "kill-registry", namespace) == {"killed": "raykv-registry"}
    _down(env, namespace, disk, pids, "raykv-index-0, raykv-index-1, raykv-worker-0, raykv-worker-1")
    again = _raykv(env, "down", "--namespace", namespace)
    assert again.returncode == 1 and "no raykv deployment" in again.stderr

#!/usr/bin/env python3
"""A multi-node Ray cluster on one machine, to try ``raykv up`` as on a real cluster.

    python cluster/local_cluster.py start --nodes 2 [--dir /tmp/raykv-local] [--gpus-per-node 1]
    eval "$(python cluster/local_cluster.py env)"     # RAY_ADDRESS and Ray's token settings
    raykv up --config my.toml && raykv status && raykv down
    python cluster/local_cluster.py stop

``start`` runs ``ray start --head`` and then ``ray start --address=...`` once per further node,
all with their session files under ``--dir`` (a directory of this cluster alone). Node i has
``--num-cpus`` CPUs, ``--gpus-per-node`` logical GPUs (a scheduling resource: ``raykv up``
without ``num_workers`` then places one worker per logical GPU through its placement group; give
the cache CPU tiers only, ``[tiers.host]``/``[tiers.disk]``, on a machine without CUDA), the
custom resource ``{"node<i>": 1}`` (pin worker i with ``worker_resources = [{node<i> = 0.01}]``)
and a Prometheus endpoint on a free port. Ray binds this machine's address; its traffic stays on
the machine. The cluster uses Ray's token authentication with a fresh token in ``DIR/auth_token``
(never ``~/.ray/auth_token``): every process that connects needs ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN_PATH=DIR/auth_token``, which ``env`` prints with ``RAY_ADDRESS``.
``DIR/cluster.json`` records the GCS address, that environment and every node's metrics port.

``stop`` ends the processes of this cluster only: those whose command line names ``--dir`` and
their descendants (the actors' worker processes), by process id, SIGTERM and then SIGKILL after
``--grace`` seconds (default 3: Ray's raylet and GCS take 10 s and more to end on SIGTERM, and a
throwaway cluster needs no drain; run ``raykv down`` first); then it removes ``--dir``. It never
runs ``ray stop``, which would end every Ray on the machine. Exit status 0, or 1 with a message
when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = "/tmp/raykv-local"


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ray_cli() -> list[str]:
    """The ``ray`` command of this Python environment."""
    exe = Path(sys.executable).with_name("ray")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _node_args(i: int, args: argparse.Namespace, metrics_port: int) -> list[str]:
    return [
        f"--num-cpus={args.cpus_per_node}",
        f"--num-gpus={args.gpus_per_node}",
        f"--resources={json.dumps({f'node{i}': 1})}",
        f"--object-store-memory={args.object_store_mb << 20}",
        f"--metrics-export-port={metrics_port}",
        "--dashboard-agent-listen-port=0",
        "--disable-usage-stats",
    ]


def _ray_start(cmd: list[str], env: dict[str, str]) -> str:
    """Run one ``ray start``; its output, or RuntimeError with it when it failed."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def start(args: argparse.Namespace) -> dict[str, object]:
    """Start ``args.nodes`` nodes under ``args.dir``; returns what cluster.json records."""
    root = Path(args.dir).resolve()
    if (root / "cluster.json").exists():
        raise RuntimeError(f"{root} already holds a cluster; stop it first")
    root.mkdir(parents=True, exist_ok=True)
    token = root / "auth_token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **auth)
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(var, None)
    ports = [free_port() for _ in range(args.nodes)]
    gcs_port = free_port()
    head = [*ray_cli(), "start", "--head", f"--port={gcs_port}", f"--temp-dir={root}"]
    head += ["--include-dashboard=false", *_node_args(0, args, ports[0])]
    _ray_start(head, env)
    address = f"{_node_ip(root)}:{gcs_port}"
    for i in range(1, args.nodes):
        _ray_start([*ray_cli(), "start", f"--address={address}", *_node_args(i, args, ports[i])], env)
    info: dict[str, object] = {
        "address": address,
        "env": {"RAY_ADDRESS": address, **auth},
        "dir": str(root),
        "nodes": [{"resource": f"node{i}", "metrics_port": ports[i]} for i in range(args.nodes)],
    }
    (root / "cluster.json").write_text(json.dumps(info, indent=2))
    return info


def _node_ip(root: Path) -> str:
    """The IP Ray's head node uses (from its session's node_ip_address.json)."""
    for path in root.glob("session_*/node_ip_address.json"):
        return str(json.loads(path.read_text())["node_ip_address"])
    import ray  # only when the session file is missing

    return str(ray.util.get_node_ip_address())


def cluster_pids(root: Path) -> list[int]:
    """Processes of the cluster under ``root``: command line names it, plus their descendants."""
    import psutil

    key = str(root)
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(key in part for part in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(found)


def stop(root: Path, grace_s: float = 3.0) -> int:
    """End every process of the cluster under ``root`` and remove it; returns how many."""
    import psutil

    pids = cluster_pids(root)
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            procs.append(proc)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=grace_s)
    left = cluster_pids(root)
    if left:
        raise RuntimeError(f"processes of {root} still running: {left}")
    shutil.rmtree(root, ignore_errors=True)
    return len(pids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "env"])
    parser.add_argument(
        "--dir", default=DEFAULT_DIR, help=f"this cluster's directory (default {DEFAULT_DIR})"
    )
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes, head included (default 2)")
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=0, help="logical GPUs per node (default 0)")
    parser.add_argument("--object-store-mb", type=int, default=100)
    parser.add_argument("--grace", type=float, default=3.0, help="seconds from SIGTERM to SIGKILL (stop)")
    args = parser.parse_args(argv)
    root = Path(args.dir).resolve()
    try:
        if args.command == "start":
            if args.nodes < 1:
                raise RuntimeError("--nodes must be >= 1")
            started = time.monotonic()
            start(args)
            print(f"started {args.nodes} Ray nodes in {time.monotonic() - started:.1f}s under {root}")
            print(f'eval "$(python {sys.argv[0]} env --dir {root})"  # to connect')
        elif args.command == "env":
            env = json.loads((root / "cluster.json").read_text())["env"]
            print("\n".join(f"export {k}={v}" for k, v in env.items()))
        else:
            print(f"stopped {stop(root, args.grace)} processes; removed {root}")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"local_cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

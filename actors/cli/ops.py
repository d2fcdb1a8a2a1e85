"""``raykv up``, ``raykv status``, ``raykv down`` and ``raykv config``: operating a deployment on
an existing Ray cluster.

Every command connects to ``--address``, else ``RAY_ADDRESS``, else the Ray cluster running on
this machine (``address="auto"``, as ``ray status`` does); none of them starts a Ray of its own.

- ``up`` loads the configuration (:func:`actors.cache.settings.load_settings`) and starts the
  deployment through :func:`actors.cache.cluster.start`, the code path of ``raykv.start()``; the
  actors are detached and outlive the command. Refused (exit 1, nothing started) when a
  deployment already runs in the namespace.
- ``status`` prints one table of workers and one of index shards (:func:`collect_status`), or
  JSON; ``--watch S`` repeats every S seconds until interrupted.
- ``down`` stops every actor of the deployment and removes its disk-tier files and placement
  group (:meth:`actors.cache.cluster.RayKVCluster.shutdown`), then checks that no raykv actor name of
  the namespace is left.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from actors.cache.settings import Settings, defaults_toml, load_settings
from raykv.core.errors import ConfigError, StateError, UnavailableError

log = logging.getLogger(__name__)


def add_ops_parsers(sub: Any) -> None:
    """The ``up``, ``status``, ``down`` and ``config`` subcommands (no Ray import)."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else this machine's)"
        )
        p.add_argument("--namespace", default=None, help="raykv namespace (default: the config's, 'raykv')")
        p.add_argument(
            "--config", default=None, help="TOML configuration file (raykv config --print-defaults)"
        )

    up = sub.add_parser("up", help="start a deployment on a running Ray cluster")
    common(up)
    up.set_defaults(func=up_main)
    status = sub.add_parser("status", help="tables of the deployment's workers and index shards")
    common(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--watch", type=float, default=None, metavar="S", help="repeat every S seconds")
    status.set_defaults(func=status_main)
    down = sub.add_parser("down", help="stop every raykv actor of the namespace, remove its disk files")
    common(down)
    down.set_defaults(func=down_main)
    config = sub.add_parser("config", help="configuration file: defaults, validation")
    config.add_argument(
        "--print-defaults", action="store_true", help="write a commented file with every default"
    )
    config.add_argument("--check", default=None, metavar="FILE", help="validate FILE (and RAYKV_* overrides)")
    config.set_defaults(func=config_main)


def _settings(args: argparse.Namespace) -> Settings:
    """The configuration of ``--config`` and the environment, with ``--namespace`` applied."""
    settings = load_settings(args.config, os.environ)
    if args.namespace:
        deployment = dataclasses.replace(settings.deployment, namespace=args.namespace)
        settings = dataclasses.replace(settings, deployment=deployment)
    return settings


def _connect_ray(address: str | None, namespace: str) -> None:
    """Attach this process to the cluster (never start one); StateError when there is none."""
    import ray

    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=target, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise StateError(
            f"no Ray cluster at {target!r} ({exc}); start one with `ray start --head` or pass --address"
        ) from None


def _run(args: argparse.Namespace, body: Any) -> int:
    """Load settings, attach to Ray, run ``body(settings)``; raykv errors print as one line."""
    try:
        settings = _settings(args)
        _connect_ray(args.address, settings.deployment.namespace)
    except (ConfigError, StateError) as exc:
        print(f"raykv: {exc}", file=sys.stderr)
        return 1
    from actors.cache.ray_util import shutdown_ray

    try:
        return int(body(settings))
    except (ConfigError, StateError, UnavailableError) as exc:
        print(f"raykv: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_ray()


def up_main(args: argparse.Namespace) -> int:
    def body(s: Settings) -> int:
        from actors.cache.cluster import start

        d = s.deployment
        dep = start(
            num_workers=d.num_workers,
            config=s.cache,
            index_shards=d.index_shards,
            index_capacity=d.index_capacity,
            namespace=d.namespace,
            worker_resources=d.worker_resources or None,
            max_restarts=d.max_restarts,
            transfer=s.transfer,
            routing=s.routing,
            engine_layouts=s.engine_layouts,
        )
        try:
            print(
                f"raykv up in namespace {d.namespace!r}: {len(dep.worker_ids)} workers, "
                f"{len(dep.spec.shards)} index shards"
            )
            print(format_status(collect_status(dep)))
        finally:
            dep.close()
        return 0

    return _run(args, body)


def status_main(args: argparse.Namespace) -> int:
    def body(s: Settings) -> int:
        from actors.cache.cluster import connect

        dep = connect(namespace=s.deployment.namespace)
        stop = threading.Event()
        watching = args.watch is not None and threading.current_thread() is threading.main_thread()
        # Ctrl-C while watching ends the loop between reports, never inside a Ray call
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if watching else None
        try:
            while True:
                report = collect_status(dep)
                print(json.dumps(report, indent=2) if args.json else format_status(report), flush=True)
                if args.watch is None or stop.wait(args.watch):
                    return 0
        except KeyboardInterrupt:
            return 0
        finally:
            if watching:
                signal.signal(signal.SIGINT, previous)
            dep.close()

    return _run(args, body)


def down_main(args: argparse.Namespace) -> int:
    def body(s: Settings) -> int:
        ns = s.deployment.namespace
        stopped = stop_namespace(ns)
        if not stopped:
            raise StateError(f"no raykv deployment in namespace {ns!r}")
        print(f"raykv down in namespace {ns!r}: stopped {', '.join(stopped)}")
        return 0

    return _run(args, body)


def _raykv_actors(namespace: str) -> list[str]:
    """Names of the live named actors of ``namespace`` that raykv made (``raykv-*``)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith("raykv-"))


def stop_namespace(namespace: str) -> list[str]:
    """Stop every raykv actor of ``namespace``; returns their names ([]: there were none).

    Through the registry when it answers (``RayKVCluster.shutdown``: workers release their tiers
    and remove their disk-tier files, then every actor and the placement group go). Actors the
    registry does not know (it is gone, or they outlived a failed start) are found by name: a
    worker is asked to shut down first, then each is killed; the deployment's named placement
    group is removed. StateError when an actor is still alive 10 s later.
    """
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    from actors.cache.cluster import connect, placement_group_name
    from actors.cache.liveness import START_TIMEOUT_S

    names = _raykv_actors(namespace)
    try:
        connect(namespace=namespace).shutdown()
    except (StateError, UnavailableError):
        pass
    for name in _raykv_actors(namespace):
        handle = ray.get_actor(name, namespace=namespace)
        if name.startswith("raykv-worker-"):
            try:
                ray.get(handle.shutdown.remote(), timeout=START_TIMEOUT_S)
            except Exception:
                log.warning("raykv: worker %s did not shut down; killing it", name)
        ray.kill(handle, no_restart=True)
    try:
        remove_placement_group(get_placement_group(placement_group_name(namespace)))
    except ValueError:
        pass  # none: CPU workers, removed with the registry, or made from another namespace
    deadline = time.monotonic() + 10.0
    while (left := _raykv_actors(namespace)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        raise StateError(f"still running in {namespace!r}: {', '.join(left)}")
    return names


def config_main(args: argparse.Namespace) -> int:
    if args.print_defaults:
        sys.stdout.write(defaults_toml())
        return 0
    if args.check:
        try:
            settings = load_settings(args.check, os.environ)
        except ConfigError as exc:
            print(f"raykv: {exc}", file=sys.stderr)
            return 1
        print(f"{args.check}: valid ({settings.deployment})")
        return 0
    print("raykv config: give --print-defaults or --check FILE", file=sys.stderr)
    return 2


def collect_status(dep: Any) -> dict[str, Any]:
    """``{"namespace", "workers": [...], "shards": [...]}`` of a deployment handle: per worker
    its health and ``CacheWorker.status()`` (absent when it did not answer in time); per shard
    its health, keys, registered workers (memberships), event lag (events its workers emitted
    that it has not applied, summed over them) and resyncs (snapshots loaded)."""
    from actors.cache.liveness import wait

    health = dep.health()
    refs = {w: h.status.remote() for w, h in dep.workers.items()}
    workers = []
    for name in dep.worker_ids:
        row: dict[str, Any] = {"worker": str(name), "health": health["workers"].get(name, "dead")}
        if name in refs:
            try:
                row.update(wait(refs[name], name, dep.call_timeout_s))
            except UnavailableError:
                pass
        workers.append(row)
    last = {r["worker"]: r["last_event_id"] for r in workers if "last_event_id" in r}
    shards = []
    for name, handle in zip(dep.spec.shards, dep.shards):
        row = {"shard": name, "health": health["shards"].get(name, "dead")}
        if handle is not None:
            try:
                info = wait(handle.info.remote(), name, dep.call_timeout_s)
                row.update(_shard_row(info, last))
            except UnavailableError:
                pass
        shards.append(row)
    return {"namespace": dep.namespace, "workers": workers, "shards": shards}


def _shard_row(info: dict[str, Any], last: dict[str, int]) -> dict[str, Any]:
    applied = info.get("last_event_ids", {})
    lag = {w: max(0, last[w] - applied[w]) if w in last else info["lag"].get(w, 0) for w in applied}
    return {
        "node_id": info["node_id"],
        "pid": info["pid"],
        "keys": info["entries"],
        "memberships": len(info["workers"]),
        "event_lag": sum(lag.values()),
        "resyncs": info["counters"].get("snapshots", 0),
        "restarted": info["restarted"],
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _per_token(worker: dict[str, Any]) -> str:
    """The microseconds per token of the pulls and prefills its engines reported (``-`` for
    none; a worker of an older version reports no totals)."""
    totals = worker.get("engine_timing") or (0, 0, 0, 0)
    pulled, pull_us, prefilled, prefill_us = totals
    pull = f"{pull_us / pulled:.1f}" if pulled else "-"
    prefill = f"{prefill_us / prefilled:.1f}" if prefilled else "-"
    return f"{pull}, {prefill}"


def _inboxes(worker: dict[str, Any]) -> str:
    """Engines with a store inbox at the worker, and their inbox slots held/all (``-`` for a
    worker of an older version)."""
    inboxes = worker.get("inboxes")
    if not inboxes:
        return "-"
    engines = inboxes.get("engines", {})
    held = sum(e["held"] for e in engines.values())
    slots = sum(e["slots"] for e in engines.values())
    return f"{len(engines)}, {held}/{slots}"


def format_status(report: dict[str, Any]) -> str:
    """The two tables of :func:`collect_status`'s report ("-" where a worker did not answer)."""
    wrows = []
    for w in report["workers"]:
        if "tiers" not in w:
            wrows.append([w["worker"], w["health"], *["-"] * 9])
            continue
        node = f"{w['node_ip']} {str(w['node_id'])[:8]}" if w.get("node_id") else "-"
        tiers = ", ".join(f"{k} {_size(u)}/{_size(c)}" for k, u, c in w["tiers"])
        moved = f"{_size(w['pulled_bytes'])} in, {_size(w['served_bytes'])} out"
        wrows.append(
            [w["worker"], w["health"], node, tiers, f"{w['hit_ratio']:.3f}", str(w["blocks"]),
             str(w["pinned_pages"]), str(w["events_published"]), moved, _per_token(w), _inboxes(w)]
        )  # fmt: skip
    wheader = [
        "worker",
        "health",
        "node",
        "tiers used/capacity",
        "hit ratio",
        "blocks",
        "pins",
        "events",
        "transfer",
        "engine us/token pull, prefill",
        "engines, inbox held/slots",
    ]
    srows = [
        [s["shard"], s["health"], str(s.get("node_id", "-"))[:8]]
        + [str(s.get(k, "-")) for k in ("keys", "memberships", "event_lag", "resyncs")]
        for s in report["shards"]
    ]
    sheader = ["shard", "health", "node", "keys", "memberships", "event lag", "resyncs"]
    return f"namespace {report['namespace']}\n{_table(wheader, wrows)}\n\n{_table(sheader, srows)}"

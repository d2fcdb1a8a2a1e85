"""Index shards behind one IndexClient, through Ray: the multi-shard part of ``raykv bench index --scale``.

For 1, 2, 4 and 8 IndexShard actors holding the same memberships (chains of 100 keys, each held
by ``holders`` of 64 workers, as :mod:`raykv.bench.index_scale`):

- ingest: the workers' packed batches split per shard (``EventBatch.for_shards``, as a worker's
  publisher does) and applied by every shard at once (``load_batches``, one call per shard per
  chunk); events per second over the wall time until every shard has applied its part;
- route: ``IndexClient.route`` of a whole 100-key chain from one caller, p50/p99 (with one shard
  the shard walks the chain itself; with more, each shard looks up its keys and the client merges),
  against the Ray round trip of one ``ping`` in the same run.

Every shard runs in its own process; on a machine with fewer cores than shards, ingest cannot
scale past the core count (the row names the cores).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import ray

from actors.cache.liveness import START_TIMEOUT_S
from raykv.bench.index_scale import CHAIN, WORKERS, chain_batches, chain_keys
from raykv.core.types import WorkerId

CHUNK_CHAINS = 2_000


@dataclass(frozen=True)
class ShardsResult:
    shards: int
    memberships: int
    ingest_events_per_s: float
    route_p50_us: float
    route_p99_us: float
    ping_p50_us: float


def _start(n: int) -> list[Any]:
    from actors.cache.index import IndexShard

    shards = [
        ray.remote(IndexShard).options(max_concurrency=64, num_cpus=0).remote(i, n, "raykv-bench")
        for i in range(n)
    ]
    lanes = [(f"w{i}", i, 1) for i in range(WORKERS)]
    ray.get([s.register_lanes.remote(lanes) for s in shards], timeout=START_TIMEOUT_S)
    return shards


def _ingest(shards: list[Any], chains: int, holders: int) -> float:
    """Apply every chain's batches on every shard; returns events per second (wall time)."""
    rng, next_id, n = random.Random(7), [1] * WORKERS, len(shards)
    events, pending = 0, []
    start = time.perf_counter()
    for first in range(0, chains, CHUNK_CHAINS):
        batches = list(chain_batches(first, min(CHUNK_CHAINS, chains - first), holders, rng, next_id))
        events += sum(b.n_ops for b in batches)
        parts = [b.for_shards(n) for b in batches]
        pending += [s.load_batches.remote([p[i] for p in parts]) for i, s in enumerate(shards)]
        if len(pending) > 4 * n:  # bounded in flight: memory stays flat
            ray.get(pending[: -2 * n], timeout=START_TIMEOUT_S)
            pending = pending[-2 * n :]
    ray.get(pending, timeout=START_TIMEOUT_S)
    return events / (time.perf_counter() - start)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples) * 1e6, samples[int(0.99 * (len(samples) - 1))] * 1e6


def measure(n: int, memberships: int, holders: int, routes: int) -> ShardsResult:
    """Start ``n`` shards, load them, route through one IndexClient, stop them."""
    from actors.cache.index import IndexClient

    shards = _start(n)
    try:
        chains = max(1, memberships // (CHAIN * holders))
        ingest = _ingest(shards, chains, holders)
        client = IndexClient(shards, {i: WorkerId(f"w{i}") for i in range(WORKERS)})
        rng = random.Random(11)
        route_s, ping_s = [], []
        for _ in range(routes):
            keys = [bytes(k) for k in chain_keys(rng.randrange(chains), 1)[0]]
            t0 = time.perf_counter()
            client.route(keys)
            route_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get(shards[0].ping.remote(), timeout=START_TIMEOUT_S)
            ping_s.append(time.perf_counter() - t0)
        p50, p99 = _percentiles(route_s)
        ping, _ = _percentiles(ping_s)
        return ShardsResult(n, chains * CHAIN * holders, ingest, p50, p99, ping)
    finally:
        for s in shards:
            ray.kill(s)


def format_results(results: list[ShardsResult]) -> str:
    """Markdown table of the shard runs (ratios against the one-shard row)."""
    one = results[0]
    lines = [
        "| shards | memberships | ingest events/s (x 1 shard) | route p50 / p99 us (x 1 shard) | ping us |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.shards} | {r.memberships / 1e6:g}M | {r.ingest_events_per_s / 1e6:.2f}M "
            f"({r.ingest_events_per_s / one.ingest_events_per_s:.2f}x) | {r.route_p50_us:.0f} / "
            f"{r.route_p99_us:.0f} ({r.route_p50_us / one.route_p50_us:.2f}x) | {r.ping_p50_us:.0f} |"
        )
    lines.append(
        f"({os.cpu_count()} cores: every shard is a process; ingest scales at most to the core count)"
    )
    return "\n".join(lines)


def run(quick: bool, holders: int = 4) -> int:
    """Measure 1, 2, 4, 8 shards on a local Ray (started here when none is) and print the table."""
    from actors.cache.ray_util import shutdown_ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace="raykv-bench")
    try:
        memberships = 400_000 if quick else 4_000_000
        results = []
        for i, n in enumerate((1, 2, 4, 8)):
            print(f"[{i + 1}/4] {n} shard(s), {memberships:,} memberships, r={holders} ...", flush=True)
            results.append(measure(n, memberships, holders, routes=300 if quick else 2_000))
        print(format_results(results))
        return 0
    finally:
        if started:
            shutdown_ray()

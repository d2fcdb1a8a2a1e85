"""Through-Ray index benchmarks, registered as part of ``raykv bench index``.

Route calls per second against one IndexShard actor holding 100k blocks, from 4 concurrent
clients: synchronous (4 threads, ``ray.get`` per call), asynchronous (4 asyncio tasks awaiting
the refs) and batched (16 queries per call). Baseline in the same run: the same clients calling
the shard's no-op ``ping`` (the bare Ray round trip), so ratio = routes/s over round trips/s.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.cache.liveness import START_TIMEOUT_S
from actors.cache.ray_util import shutdown_ray
from raykv.bench import SUITES
from raykv.bench.harness import Benchmark, Row
from raykv.index.holders import pack_ops
from raykv.index.prefix_index import OP_STORE, EventBatch

CLIENTS = 4
BATCH = 16


def _shard(blocks: int) -> tuple[Any, list[list[bytes]]]:
    from actors.cache.index import IndexShard

    shard = ray.remote(IndexShard).options(max_concurrency=64, num_cpus=0).remote(0, 1, "raykv-bench")
    ray.get(shard.register_lanes.remote([(f"w{i}", i, 1) for i in range(64)]), timeout=START_TIMEOUT_S)
    chains = [[os.urandom(32) for _ in range(100)] for _ in range(blocks // 100)]
    batches = [
        EventBatch(
            f"w{i % 64}",
            1,
            i // 64 + 1,
            i // 64 + 1,
            pack_ops((OP_STORE, k, 0) for k in chain),
        )
        for i, chain in enumerate(chains)
    ]
    ray.get(shard.load_batches.remote(batches), timeout=START_TIMEOUT_S)
    return shard, chains


def _threads(call: Callable[[int], None], calls_each: int) -> float:
    def loop(seed: int) -> None:
        for i in range(calls_each):
            call(seed + i)

    threads = [threading.Thread(target=loop, args=(t * 1000,)) for t in range(CLIENTS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return CLIENTS * calls_each / (time.perf_counter() - start)


def _async(make: Callable[[int], Any], calls_each: int) -> float:
    async def client(seed: int) -> None:
        for i in range(calls_each):
            await make(seed + i)

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(client(t * 1000) for t in range(CLIENTS)))
        return CLIENTS * calls_each / (time.perf_counter() - start)

    return asyncio.run(main())


def _ray_rows(quick: bool) -> list[Row]:
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace="raykv-bench")
    try:
        shard, chains = _shard(20_000 if quick else 100_000)
        n = 50 if quick else 300
        q = lambda i: chains[i % len(chains)]  # noqa: E731
        ping_sync = _threads(lambda i: ray.get(shard.ping.remote(), timeout=START_TIMEOUT_S), n)
        rows = [
            Row(
                "Ray route, 4 clients, sync",
                _threads(lambda i: ray.get(shard.route.remote(q(i)), timeout=START_TIMEOUT_S), n),
                ping_sync,
                "calls/s",
                info="baseline: ping round trip",
            )
        ]
        ping_async = _async(lambda i: shard.ping.remote(), n)
        rows.append(
            Row(
                "Ray route, 4 clients, async",
                _async(lambda i: shard.route.remote(q(i)), n),
                ping_async,
                "calls/s",
                info="baseline: ping round trip",
            )
        )
        batched = _threads(
            lambda i: ray.get(
                shard.route_batch.remote([q(i + j) for j in range(BATCH)]), timeout=START_TIMEOUT_S
            ),
            max(1, n // 4),
        )
        rows.append(
            Row(
                f"Ray route, 4 clients, batches of {BATCH}",
                batched * BATCH,
                ping_sync,
                "routes/s",
                info="routes/s vs sync ping round trips/s",
            )
        )
        ray.kill(shard)
        return rows
    finally:
        if started:
            shutdown_ray()


def register() -> None:
    """Add the through-Ray rows to the ``index`` suite (called by the CLI)."""
    base = SUITES["index"]

    def combined(quick: bool) -> tuple[list[Benchmark], str]:
        benches, desc = base(quick)
        return [*benches, Benchmark("index through Ray", lambda: _ray_rows(quick))], desc

    SUITES["index"] = combined

"""In-process benchmarks of the global prefix index (:mod:`raykv.index.prefix_index`).

- route latency for a 100-block prefix over 64 workers holding ``total_blocks`` blocks (1M in full
  mode): a typical prefix (held by 1-3 workers) and a popular one (held by all 64). Baseline: a
  plain ``dict.get`` of the same 100 keys, the floor of any index kept in a Python dict (the index
  beats it with the compiled table, :mod:`raykv.index.holders`; the row says which table ran). The
  note gives p50/p99.
- event ingest: block events per second applied by one shard, vs inserting the same keys into a
  plain dict (the floor).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass

from raykv import native
from raykv.bench.harness import Benchmark, Row, gc_paused
from raykv.core.types import WorkerId
from raykv.index.holders import pack_ops
from raykv.index.prefix_index import OP_STORE, EventBatch, PrefixIndex

WORKERS = 64
CHAIN = 100


@dataclass(frozen=True)
class IndexSettings:
    total_blocks: int
    queries: int


QUICK = IndexSettings(total_blocks=100_000, queries=2_000)
FULL = IndexSettings(total_blocks=1_000_000, queries=20_000)


def _populate(settings: IndexSettings) -> tuple[PrefixIndex, list[list[bytes]], list[EventBatch], float]:
    """An index with ``total_blocks`` blocks in 100-block chains, each chain on 1-3 workers.

    Returns the index, the chains, the batches (for the ingest benchmark) and the ingest seconds.
    """
    rng = random.Random(7)
    index = PrefixIndex()
    for w in range(WORKERS):
        index.register_worker(WorkerId(f"w{w}"), w, 1)
    chains = [[os.urandom(32) for _ in range(CHAIN)] for _ in range(settings.total_blocks // CHAIN)]
    next_id = [1] * WORKERS
    batches = []
    for chain in chains:
        for w in rng.sample(range(WORKERS), rng.randint(1, 3)):
            tier = rng.randrange(3)
            ops = pack_ops((OP_STORE, k, tier) for k in chain)
            batches.append(EventBatch(WorkerId(f"w{w}"), 1, next_id[w], next_id[w] + CHAIN - 1, ops))
            next_id[w] += CHAIN
    with gc_paused():
        start = time.perf_counter()
        for batch in batches:
            index.apply_batch(batch)
        seconds = time.perf_counter() - start
    return index, chains, batches, seconds


def _latencies(index: PrefixIndex, queries: list[list[bytes]]) -> list[float]:
    out = []
    with gc_paused():
        for keys in queries:
            t0 = time.perf_counter()
            index.route(keys)
            out.append(time.perf_counter() - t0)
    return out


def _fresh(queries: list[list[bytes]]) -> list[list[bytes]]:
    """Copies of the query keys: a real caller hashes new key objects (no cached hash, no identity
    shortcut in the dict), so both ours and the floor get keys the table has never seen."""
    return [[bytes(bytearray(k)) for k in keys] for keys in queries]


def _dict_floor(table: dict[bytes, object], queries: list[list[bytes]]) -> float:
    with gc_paused():
        start = time.perf_counter()
        for keys in queries:
            [table.get(k) for k in keys]
        return (time.perf_counter() - start) / len(queries)


def _route_rows(settings: IndexSettings) -> list[Row]:
    index, chains, batches, ingest_s = _populate(settings)
    popular = [os.urandom(32) for _ in range(CHAIN)]
    for w in range(WORKERS):
        ops = pack_ops((OP_STORE, k, 0) for k in popular)
        last = index.last_event_id(WorkerId(f"w{w}"))
        index.apply_batch(EventBatch(WorkerId(f"w{w}"), 1, last + 1, last + 1, ops))
    rng = random.Random(11)
    rows = []
    table = "compiled" if native.load("_holders") is not None else "python"
    floor_table: dict[bytes, object] = dict.fromkeys((k for c in chains for k in c), 0)
    for label, pick in (
        ("typical (1-3 holders)", lambda: rng.choice(chains)),
        ("popular (64 holders)", lambda: popular),
    ):
        queries = [pick() for _ in range(settings.queries)]
        lat = sorted(_latencies(index, _fresh(queries)))
        p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
        floor = _dict_floor(floor_table, _fresh(queries))
        rows.append(
            Row(
                f"route 100 blk / 64 workers, {label}",
                1 / p50,
                1 / floor,
                "routes/s",
                info=f"p50 {p50 * 1e6:.1f} us, p99 {p99 * 1e6:.1f} us (goals 5, 20 us; {table} table)",
            )
        )
    n_ops = sum(b.n_ops for b in batches)
    base = _dict_ingest(batches)
    rows.append(
        Row(
            f"event ingest ({len(index) // 1000}k blocks)",
            n_ops / ingest_s,
            n_ops / base,
            "events/s",
            info="goal >= 5M events/s per shard",
        )
    )
    return rows


def _dict_ingest(batches: list[EventBatch]) -> float:
    table: dict[bytes, int] = {}
    ops = [batch.ops for batch in batches]  # unpacked before the clock starts: the floor's best case
    with gc_paused():
        start = time.perf_counter()
        for batch_ops in ops:
            for _op, key, tier in batch_ops:
                table[key] = tier
        return time.perf_counter() - start


def index_benchmarks(settings: IndexSettings) -> list[Benchmark]:
    return [Benchmark("index route + ingest (in-process)", lambda: _route_rows(settings))]


def suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The suite's benchmarks and description line (``quick``: CI mode)."""

    settings = QUICK if quick else FULL
    return index_benchmarks(settings), f"{settings.total_blocks} blocks, {settings.queries} queries"


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import module_main

    sys.exit(
        module_main(
            "index", suite, note="for the rows through Ray (route calls/s to index actors): raykv bench index"
        )
    )

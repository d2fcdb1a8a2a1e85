"""The prefix index at scale: one shard holding 10^6 to 10^8 memberships (``raykv bench index --scale``).

Workload (as docs/benchmarks.md "Index at scale" states it): 64 workers; disjoint chains of 100
random 32-byte keys, each chain held whole by ``r`` workers picked at random, each worker's
chain one packed 100-event batch on a random tier, applied through ``PrefixIndex.apply_batch``
as a shard applies them. For each (memberships, r):

- bytes per membership: the table's own accounting (``PrefixIndex.memory()``: slots, holder sets,
  their lookup structures) and the process's resident-set growth, each over memberships;
- ingest: events applied per second (the apply calls' time only; batch building excluded);
- routes of whole 100-block chains (new ``bytes`` objects per key, as unpickled from Ray), p50 and
  p99, measured while the shard also ingests new chains at 1M events/s (a paced loop: a batch is
  applied whenever one is due, routes run in between);
- the longest pause: the longest single call (a batch apply or a table move step) in the whole
  run, i.e. the longest a route could wait behind the shard's other work, and a full
  ``gc.collect()`` after the build.

Same-run baselines at the smallest size: a Python dict of the same keys (bytes per membership,
inserts per second, ``dict.get`` of a chain's keys) and the pure-Python table
(``RAYKV_PURE_INDEX=1``). Keys come from a counter-based hash (splitmix64) so no key list is
kept: a 10^8 run fits in a few GiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from raykv.bench.harness import gc_paused
from raykv.core.types import WorkerId
from raykv.index.holders import RECORD
from raykv.index.prefix_index import EventBatch, PrefixIndex

WORKERS = 64
CHAIN = 100
CHUNK_CHAINS = 2_000  # chains generated at a time
PACED_EVENTS_PER_S = 1_000_000
PACED_S = 2.0


@dataclass(frozen=True)
class ScaleResult:
    """One (memberships, holders) run; times in microseconds unless named otherwise."""

    memberships: int
    holders: int
    keys: int
    table: str
    bytes_per_membership: float
    rss_bytes_per_membership: float
    ingest_events_per_s: float
    route_p50_us: float
    route_p99_us: float
    routes: int
    paced_events_per_s: float
    longest_pause_ms: float
    gc_collect_ms: float
    moves: int


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each element (uint64, wrapping)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def chain_keys(first: int, count: int) -> np.ndarray:
    """Keys of chains ``first .. first + count - 1``: uint8 array (count, CHAIN, 32)."""
    pos = (np.arange(first, first + count, dtype=np.uint64)[:, None] * np.uint64(CHAIN)) + np.arange(
        CHAIN, dtype=np.uint64
    )
    words = np.stack([_mix(pos * np.uint64(4) + np.uint64(j)) for j in range(4)], axis=-1)
    return words.view(np.uint8).reshape(count, CHAIN, 32)


def chain_batches(
    first: int, count: int, holders: int, rng: random.Random, next_id: list[int]
) -> Iterator[EventBatch]:
    """Each chain's packed store batch for each of its ``holders`` random workers."""
    records = np.zeros((count, CHAIN, RECORD), dtype=np.uint8)
    records[:, :, 2:] = chain_keys(first, count)
    for c in range(count):
        rec = records[c]
        for w in rng.sample(range(WORKERS), holders):
            rec[:, 1] = rng.randrange(3)
            yield EventBatch(WorkerId(f"w{w}"), 1, next_id[w], next_id[w] + CHAIN - 1, rec.tobytes())
            next_id[w] += CHAIN


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Run:
    """One index under load: counts apply time and the longest single call."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.apply_s = 0.0
        self.events = 0
        self.longest = 0.0

    def apply(self, batch: EventBatch) -> None:
        t0 = time.perf_counter()
        self.index.apply_batch(batch)
        dt = time.perf_counter() - t0
        self.apply_s += dt
        self.events += batch.n_ops
        self.longest = max(self.longest, dt)

    def maintain(self) -> None:
        t0 = time.perf_counter()
        self.index.maintain()
        self.longest = max(self.longest, time.perf_counter() - t0)


def _queries(chains: int, n: int, rng: random.Random) -> list[bytes]:
    """``n`` random chains' keys, each chain one buffer (split into fresh key objects per use)."""
    picks = np.array([rng.randrange(chains) for _ in range(n)], dtype=np.uint64)
    return [chain_keys(int(c), 1).tobytes() for c in picks]


def _fresh(buf: bytes) -> list[bytes]:
    """A chain's keys as new bytes objects, as a shard gets them from an unpickled request."""
    return [buf[i : i + 32] for i in range(0, len(buf), 32)]


def _paced(
    run: _Run, chains: int, holders: int, rng: random.Random, next_id: list[int], paced_s: float
) -> tuple[list[float], float]:
    """Routes while new chains arrive at PACED_EVENTS_PER_S; returns route seconds and the
    event rate reached."""
    queries = _queries(chains, 4_000, rng)
    extra = chain_batches(
        chains, max(1, int(PACED_EVENTS_PER_S * paced_s / CHAIN / holders) + 1), holders, rng, next_id
    )
    lat: list[float] = []
    start = time.perf_counter()
    due = start
    events = 0
    q = 0
    while time.perf_counter() - start < paced_s:
        now = time.perf_counter()
        if now >= due:
            batch = next(extra, None)
            if batch is not None:
                run.apply(batch)
                events += batch.n_ops
            due += CHAIN / PACED_EVENTS_PER_S
            continue
        if run.index.table_stats()["moving"]:
            run.maintain()
            continue
        keys = _fresh(queries[q % len(queries)])
        q += 1
        t0 = time.perf_counter()
        run.index.route(keys)
        lat.append(time.perf_counter() - t0)
    return lat, events / (time.perf_counter() - start)


def measure(
    memberships: int, holders: int, seed: int = 7, paced_s: float = PACED_S, presize: bool = False
) -> ScaleResult:
    """Build one shard of ``memberships`` memberships (``holders`` per key) and measure it
    (routes while ingesting for ``paced_s`` seconds). ``presize``: the table is sized for the
    keys up front (a shard configured with its expected keys), so it never grows."""
    rng = random.Random(seed)
    chains = max(1, memberships // (CHAIN * holders))
    gc.collect()
    rss0 = _rss()
    index = PrefixIndex(capacity=chains * CHAIN if presize else 0)
    for w in range(WORKERS):
        index.register_worker(WorkerId(f"w{w}"), w, 1)
    run, next_id = _Run(index), [1] * WORKERS
    with gc_paused():
        for first in range(0, chains, CHUNK_CHAINS):
            for batch in chain_batches(first, min(CHUNK_CHAINS, chains - first), holders, rng, next_id):
                run.apply(batch)
    ingest = run.events / run.apply_s
    built = run.events
    t0 = time.perf_counter()
    gc.collect()
    gc_ms = (time.perf_counter() - t0) * 1e3
    memory, rss = index.memory(), _rss() - rss0
    with gc_paused():
        lat, paced = _paced(run, chains, holders, rng, next_id, paced_s)
    lat.sort()
    stats = index.table_stats()
    return ScaleResult(
        memberships=built,
        holders=holders,
        keys=chains * CHAIN,
        table=("compiled" if "slot_bytes" in stats else "python") + (", pre-sized" if presize else ""),
        bytes_per_membership=memory / built,
        rss_bytes_per_membership=rss / built,
        ingest_events_per_s=ingest,
        route_p50_us=statistics.median(lat) * 1e6 if lat else float("nan"),
        route_p99_us=lat[int(0.99 * (len(lat) - 1))] * 1e6 if lat else float("nan"),
        routes=len(lat),
        paced_events_per_s=paced,
        longest_pause_ms=run.longest * 1e3,
        gc_collect_ms=gc_ms,
        moves=int(stats.get("moves", 0)),  # type: ignore[call-overload]
    )


def dict_baseline(memberships: int, seed: int = 7) -> dict[str, float]:
    """A plain dict {key: tier} of ``memberships`` keys (one holder each): bytes per key (resident
    growth), inserts per second, and ``dict.get`` of a 100-key chain (p50, us)."""
    chains = max(1, memberships // CHAIN)
    gc.collect()
    rss0 = _rss()
    table: dict[bytes, int] = {}
    spent = 0.0
    with gc_paused():
        for first in range(0, chains, CHUNK_CHAINS):
            keys = [bytes(k) for k in chain_keys(first, min(CHUNK_CHAINS, chains - first)).reshape(-1, 32)]
            t0 = time.perf_counter()
            for k in keys:
                table[k] = 0
            spent += time.perf_counter() - t0
            del keys
    rss = _rss() - rss0
    queries = _queries(chains, 2_000, random.Random(seed))
    lat = []
    with gc_paused():
        for buf in queries:
            q = _fresh(buf)
            t0 = time.perf_counter()
            [table.get(k) for k in q]
            lat.append(time.perf_counter() - t0)
    return {
        "bytes_per_membership": rss / len(table),
        "inserts_per_s": len(table) / spent,
        "get_chain_p50_us": statistics.median(lat) * 1e6,
    }


def format_results(results: list[ScaleResult]) -> str:
    """The results as a markdown table."""
    head = (
        "| memberships | r | table | B/membership (table) | B/membership (RSS) | ingest events/s | "
        "route p50 / p99 us (while ingesting) | paced events/s | longest pause ms | gc.collect ms |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(
            f"| {r.memberships / 1e6:g}M | {r.holders} | {r.table} | {r.bytes_per_membership:.1f} | "
            f"{r.rss_bytes_per_membership:.1f} | {r.ingest_events_per_s / 1e6:.2f}M | "
            f"{r.route_p50_us:.1f} / {r.route_p99_us:.1f} | {r.paced_events_per_s / 1e6:.2f}M | "
            f"{r.longest_pause_ms:.2f} | {r.gc_collect_ms:.1f} |"
        )
    return "\n".join(lines)


SIZES = {"quick": (1_000_000,), "full": (1_000_000, 10_000_000, 100_000_000)}
HOLDERS = (1, 4, 16)


def main(argv: list[str] | None = None) -> int:
    """Run the scale benchmark and print its table (``--json PATH`` also writes the rows)."""
    parser = argparse.ArgumentParser(prog="raykv bench index --scale", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M memberships only")
    parser.add_argument("--sizes", type=int, nargs="*", help="memberships per run (default 1M, 10M, 100M)")
    parser.add_argument("--holders", type=int, nargs="*", default=list(HOLDERS))
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--presize", action="store_true", help="also measure tables sized up front")
    args = parser.parse_args(argv)
    return run(args.sizes or SIZES["quick" if args.quick else "full"], args.holders, args.json, args.presize)


def run(
    sizes: list[int] | tuple[int, ...],
    holders: list[int],
    json_path: str | None = None,
    presize: bool = False,
) -> int:
    """Measure every (size, holders) pair (grown, and with ``presize`` also sized up front), then
    the baselines at the smallest size; print tables."""
    results = []
    plan = [(size, r, p) for size in sizes for r in holders for p in ((False, True) if presize else (False,))]
    for i, (size, r, p) in enumerate(plan):
        print(
            f"[{i + 1}/{len(plan)}] {size:,} memberships, r={r}{', pre-sized' if p else ''} ...", flush=True
        )
        results.append(measure(size, r, presize=p))
    smallest = min(sizes)
    base = dict_baseline(smallest)
    os.environ["RAYKV_PURE_INDEX"] = "1"
    try:
        pure = measure(smallest, 1)
    finally:
        del os.environ["RAYKV_PURE_INDEX"]
    print(format_results([*results, pure]))
    print(
        f"baseline dict {{key: tier}}, {smallest:,} keys: {base['bytes_per_membership']:.1f} B/key (RSS), "
        f"{base['inserts_per_s'] / 1e6:.2f}M inserts/s, "
        f"get of a 100-key chain p50 {base['get_chain_p50_us']:.1f} us"
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"results": [asdict(r) for r in results], "pure": asdict(pure), "dict": base}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

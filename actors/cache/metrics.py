"""Prometheus metrics for CacheWorker actors, index shards and Serve routers, exported through
ray.util.metrics.

Counters are fed from stats deltas (so restarts of the exporter never double count), among them
``raykv_integrity_drops`` (disk pages that failed their checksum); gauges show bytes in use per
tier, pinned pages and the page server's open leases and connections. Tags: worker, and tier,
path (``shm_read``/``shm``/``ucx``/``gpu_read``/...) or failure reason (exactly the values of
:class:`raykv.core.errors.TransferFailure`: a count under any other key is not exported). The
page server's guard counts (connections closed before authenticating, refused over a cap, closed
idle) have the worker tag only: nothing a peer sends becomes a label.

``CacheWorker`` exports on its publisher thread every ``METRICS_INTERVAL_S`` (actor mode) and on
``export_metrics()``; each pull's duration goes to a histogram as it ends. ``backend`` is
anything with ray.util.metrics' ``Counter``, ``Gauge`` and ``Histogram`` (tests pass a recorder;
without Ray nothing else is needed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raykv.core.errors import TransferFailure
from raykv.core.stats import CacheStats

METRICS_INTERVAL_S = 1.0
"""How often a worker's publisher thread exports its stats (the counters are cumulative, so a
scrape between two exports only sees the change later)."""

REASON_LABELS = frozenset(reason.value for reason in TransferFailure)
"""The values the ``reason`` tag takes: the failure enum's, nothing else."""

PULL_SECONDS_BOUNDARIES = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""Histogram buckets of ``raykv_transfer_pull_seconds`` (100 us to 3 s)."""

_WORKER_COUNTERS = (
    ("quota_evictions", "Blocks a tenant's quota dropped (that tenant's own)"),
    ("quota_refused", "Blocks not cached because their tenant was at its quota"),
)
"""Per-worker counters fed straight from CacheStats fields of the same name."""

_TRANSFER_COUNTERS = (
    # (series, help, "client"/"server", stats field, tag for the field's keys)
    ("raykv_transfer_pulls", "Pulls this worker made, by path", "client", "pulls", "path"),
    ("raykv_transfer_pulled_bytes", "Page bytes it pulled, by path", "client", "bytes", "path"),
    ("raykv_transfer_failures", "Its pulls that failed, by reason", "client", "failures", "reason"),
    ("raykv_transfer_served_pulls", "Pulls its page server answered, by path", "server", "pulls", "path"),
    ("raykv_transfer_served_bytes", "Page bytes its page server sent, by path", "server", "bytes", "path"),
    (
        "raykv_transfer_server_errors",
        "Requests its page server failed, by reason",
        "server",
        "errors",
        "reason",
    ),
)


_SERVER_TOTALS = (
    # (series, help, ServerStats field): plain counts, no tag but the worker
    (
        "raykv_transfer_preauth_rejected",
        "Connections its page server closed before they authenticated",
        "preauth_rejected",
    ),
    (
        "raykv_transfer_refused_connections",
        "Connections its page server refused over a connection cap",
        "connections_refused",
    ),
    ("raykv_transfer_idle_closed", "Idle connections its page server closed", "idle_closed"),
)


class WorkerMetrics:
    """Publishes one worker's CacheStats and page-transfer stats as Prometheus series."""

    def __init__(self, worker: str, backend: Any = None) -> None:
        if backend is None:
            from ray.util import metrics as backend
        tags = ("worker", "tier")
        self.worker = worker
        self.hits = backend.Counter("raykv_hit_blocks", "Blocks reused, by tier", tag_keys=tags)
        self.misses = backend.Counter("raykv_miss_blocks", "Blocks not cached", tag_keys=("worker",))
        self.evictions = backend.Counter("raykv_evictions", "Blocks dropped, by tier", tag_keys=tags)
        self.demotions = backend.Counter("raykv_demotions", "Pages demoted, by source tier", tag_keys=tags)
        self.promotions = backend.Counter("raykv_promotions", "Pages promoted, by source tier", tag_keys=tags)
        self.bytes = backend.Gauge("raykv_bytes_in_use", "Bytes held, by tier", tag_keys=tags)
        self.integrity_drops = backend.Counter(
            "raykv_integrity_drops",
            "Disk pages that failed their checksum (dropped, never served)",
            tag_keys=("worker",),
        )
        self.worker_counters = {
            name: backend.Counter(f"raykv_{name}", text, tag_keys=("worker",))
            for name, text in _WORKER_COUNTERS
        }
        self.pinned = backend.Gauge(
            "raykv_pinned_pages", "Pages pinned by active requests", tag_keys=("worker",)
        )
        self.transfer = {
            (side, field): (backend.Counter(name, text, tag_keys=("worker", tag)), tag)
            for name, text, side, field, tag in _TRANSFER_COUNTERS
        }
        self.server_totals = {
            field: backend.Counter(name, text, tag_keys=("worker",)) for name, text, field in _SERVER_TOTALS
        }
        self.open_leases = backend.Gauge(
            "raykv_transfer_open_leases", "Leases the page server holds now", tag_keys=("worker",)
        )
        self.open_connections = backend.Gauge(
            "raykv_transfer_open_connections", "Connections open to the page server now", tag_keys=("worker",)
        )
        self.pull_seconds = backend.Histogram(
            "raykv_transfer_pull_seconds",
            "Duration of this worker's pulls (pull and import), by path",
            boundaries=list(PULL_SECONDS_BOUNDARIES),
            tag_keys=("worker", "path"),
        )
        self._last: CacheStats | None = None
        self._last_transfer: dict[tuple[str, str], dict[str, int]] = {}
        self._last_totals: dict[str, int] = {}

    def update(self, stats: CacheStats, transfer: Mapping[str, Any] | None = None) -> None:
        """Export the change since the previous call (``transfer``: ``WorkerTransfer.stats()``)."""
        last = self._last
        for i, kind in enumerate(stats.tiers):
            tags = {"worker": self.worker, "tier": kind.name.lower()}
            for counter, name in (
                (self.hits, "hit_blocks"),
                (self.evictions, "evictions"),
                (self.demotions, "demotions"),
                (self.promotions, "promotions"),
            ):
                now = getattr(stats, name)[i]
                delta = now - (getattr(last, name)[i] if last is not None else 0)
                if delta > 0:
                    counter.inc(delta, tags=tags)
            self.bytes.set(stats.bytes_in_use[i], tags=tags)
        miss_delta = stats.miss_blocks - (last.miss_blocks if last else 0)
        if miss_delta > 0:
            self.misses.inc(miss_delta, tags={"worker": self.worker})
        drops_delta = stats.integrity_drops - (last.integrity_drops if last else 0)
        if drops_delta > 0:
            self.integrity_drops.inc(drops_delta, tags={"worker": self.worker})
        for name, counter in self.worker_counters.items():
            delta = getattr(stats, name) - (getattr(last, name) if last else 0)
            if delta > 0:
                counter.inc(delta, tags={"worker": self.worker})
        self.pinned.set(stats.pinned_pages, tags={"worker": self.worker})
        self._last = stats
        if transfer is not None:
            self.update_transfer(transfer)

    def observe_pull(self, path: str, seconds: float) -> None:
        """Record one pull's duration (``PullOutcome.path`` and ``.seconds``)."""
        self.pull_seconds.observe(seconds, tags={"worker": self.worker, "path": path})

    def update_transfer(self, transfer: Mapping[str, Any]) -> None:
        """Export the change of the transfer counters since the previous call (reason tags only
        for :data:`REASON_LABELS`)."""
        for (side, field), (counter, tag) in self.transfer.items():
            now: dict[str, int] = dict(transfer.get(side, {}).get(field, {}))
            before = self._last_transfer.get((side, field), {})
            for key, count in now.items():
                if tag == "reason" and key not in REASON_LABELS:
                    continue  # not a TransferFailure: no label of its own
                delta = count - before.get(key, 0)
                if delta > 0:
                    counter.inc(delta, tags={"worker": self.worker, tag: key})
            self._last_transfer[(side, field)] = now
        self._update_server_totals(transfer.get("server", {}))
        if "open_leases" in transfer:
            self.open_leases.set(transfer["open_leases"], tags={"worker": self.worker})
        if "open_connections" in transfer:
            self.open_connections.set(transfer["open_connections"], tags={"worker": self.worker})

    def _update_server_totals(self, server: Mapping[str, Any]) -> None:
        """Export the change of the page server's plain counts (``_SERVER_TOTALS``)."""
        for field, counter in self.server_totals.items():
            now = int(server.get(field, 0))
            delta = now - self._last_totals.get(field, 0)
            if delta > 0:
                counter.inc(delta, tags={"worker": self.worker})
            self._last_totals[field] = now


ROUTE_SECONDS_BOUNDARIES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1)
"""Histogram buckets of ``raykv_index_route_seconds`` (10 us to 100 ms)."""


class IndexMetrics:
    """Publishes one IndexShard's state: keys, table bytes, registered workers, snapshot resyncs, event lag
    per worker (events the worker emitted that the shard has not applied) and the time the shard
    takes to answer a route or lookup. Tag ``shard`` (and ``worker`` for the lag)."""

    def __init__(self, shard: int, backend: Any = None) -> None:
        if backend is None:
            from ray.util import metrics as backend
        self.tags = {"shard": str(shard)}
        self.keys = backend.Gauge("raykv_index_keys", "Keys this index shard holds", tag_keys=("shard",))
        self.workers = backend.Gauge(
            "raykv_index_workers", "Workers registered with this index shard", tag_keys=("shard",)
        )
        self.bytes = backend.Gauge(
            "raykv_index_bytes",
            "Bytes this index shard's table uses (slots and holder sets)",
            tag_keys=("shard",),
        )
        self.resyncs = backend.Counter(
            "raykv_index_resyncs", "Snapshots this shard loaded (gaps, restarts)", tag_keys=("shard",)
        )
        self.lag = backend.Gauge(
            "raykv_index_event_lag",
            "Events a worker emitted that this shard has not applied yet",
            tag_keys=("shard", "worker"),
        )
        self.route_seconds = backend.Histogram(
            "raykv_index_route_seconds",
            "Time this shard took to answer a route or lookup",
            boundaries=list(ROUTE_SECONDS_BOUNDARIES),
            tag_keys=("shard",),
        )
        self._last_resyncs = 0

    def update(
        self, keys: int, workers: int, resyncs: int, lag: Mapping[str, int], table_bytes: int = 0
    ) -> None:
        """Set the gauges and export the resyncs since the previous call."""
        self.keys.set(keys, tags=self.tags)
        self.bytes.set(table_bytes, tags=self.tags)
        self.workers.set(workers, tags=self.tags)
        if resyncs > self._last_resyncs:
            self.resyncs.inc(resyncs - self._last_resyncs, tags=self.tags)
        self._last_resyncs = resyncs
        for worker, events in lag.items():
            self.lag.set(events, tags={**self.tags, "worker": worker})

    def observe_route(self, seconds: float) -> None:
        self.route_seconds.observe(seconds, tags=self.tags)


DECISION_SECONDS_BOUNDARIES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1)
"""Histogram buckets of ``raykv_router_decision_seconds`` (10 us to 100 ms)."""

ROUTER_OUTCOMES = frozenset({"cache_routed", "targeted", "fallback", "index_timeouts", "index_errors"})
"""The values the router's ``outcome`` tag takes (a decision is one of the first three; the two
index outcomes count index trouble, each followed by a fallback)."""


RENDER_OUTCOMES = frozenset({"rendered", "unrendered", "render_timeouts", "render_errors"})
"""The values the render counter's ``outcome`` tag takes (actors.serve.prompts)."""


class RouterMetrics:
    """Publishes one Serve router's decisions: how each came out (``outcome``: one of
    :data:`ROUTER_OUTCOMES`), the time a cache-aware decision took (keys, index route and the
    policy), and the prices its policy learned (the duplicate price, x the recompute of a block
    another worker holds; the pull price, observed seconds per pulled token over per prefilled
    token), and the cache-aware decisions cold placement moved off a full worker
    (:mod:`raykv.routing.placement`). Tag ``deployment`` (and ``outcome``)."""

    def __init__(self, deployment: str, backend: Any = None) -> None:
        if backend is None:
            from ray.util import metrics as backend
        self.tags = {"deployment": deployment}
        self.decisions = backend.Counter(
            "raykv_router_decisions", "Serve router decisions, by outcome", tag_keys=("deployment", "outcome")
        )
        self.seconds = backend.Histogram(
            "raykv_router_decision_seconds",
            "Time a cache-aware routing decision took (keys, index route, policy)",
            boundaries=list(DECISION_SECONDS_BOUNDARIES),
            tag_keys=("deployment",),
        )
        self.duplicate_price = backend.Gauge(
            "raykv_router_duplicate_price",
            "Learned price of recomputing a block another worker holds (x its recompute)",
            tag_keys=("deployment",),
        )
        self.pull_price = backend.Gauge(
            "raykv_router_pull_price",
            "Observed seconds per pulled token over seconds per prefilled token",
            tag_keys=("deployment",),
        )
        self.cold_placed = backend.Counter(
            "raykv_router_cold_placed",
            "Cold requests moved off a full worker to the one sent the fewest new blocks lately",
            tag_keys=("deployment",),
        )
        self.renders = backend.Counter(
            "raykv_router_renders",
            "Chat and text requests the router rendered to token ids, by outcome",
            tag_keys=("deployment", "outcome"),
        )
        self.render_seconds = backend.Histogram(
            "raykv_router_render_seconds",
            "Time from asking for a request's token ids to having them (pool queueing included)",
            boundaries=list(DECISION_SECONDS_BOUNDARIES),
            tag_keys=("deployment",),
        )

    def count(self, outcome: str) -> None:
        """One decision (or index failure) came out as ``outcome`` (ValueError for another)."""
        if outcome not in ROUTER_OUTCOMES:
            raise ValueError(f"unknown router outcome {outcome!r}")
        self.decisions.inc(1.0, tags={**self.tags, "outcome": outcome})

    def rendered(self, outcome: str, seconds: float | None = None) -> None:
        """A request's render came out as ``outcome`` (one of :data:`RENDER_OUTCOMES`; ValueError
        for another), taking ``seconds`` when it rendered."""
        if outcome not in RENDER_OUTCOMES:
            raise ValueError(f"unknown render outcome {outcome!r}")
        self.renders.inc(1.0, tags={**self.tags, "outcome": outcome})
        if seconds is not None:
            self.render_seconds.observe(seconds, tags=self.tags)

    def routed(self, seconds: float, duplicate_price: float, pull_price: float, placed: bool = False) -> None:
        """A cache-aware decision took ``seconds``; the policy's prices after it; ``placed``: cold
        placement moved it."""
        self.seconds.observe(seconds, tags=self.tags)
        self.duplicate_price.set(duplicate_price, tags=self.tags)
        self.pull_price.set(pull_price, tags=self.tags)
        if placed:
            self.cold_placed.inc(1.0, tags=self.tags)


SERIES: dict[str, str] = {
    **dict.fromkeys(
        (
            "raykv_hit_blocks",
            "raykv_miss_blocks",
            "raykv_evictions",
            "raykv_demotions",
            "raykv_promotions",
            "raykv_integrity_drops",
            *(f"raykv_{name}" for name, _ in _WORKER_COUNTERS),
            *(row[0] for row in _TRANSFER_COUNTERS),
            *(row[0] for row in _SERVER_TOTALS),
            "raykv_index_resyncs",
            "raykv_router_decisions",
            "raykv_router_cold_placed",
            "raykv_router_renders",
        ),
        "counter",
    ),
    **dict.fromkeys(
        (
            "raykv_bytes_in_use",
            "raykv_pinned_pages",
            "raykv_transfer_open_leases",
            "raykv_transfer_open_connections",
            "raykv_index_keys",
            "raykv_index_workers",
            "raykv_index_bytes",
            "raykv_index_event_lag",
            "raykv_router_duplicate_price",
            "raykv_router_pull_price",
        ),
        "gauge",
    ),
    "raykv_transfer_pull_seconds": "histogram",
    "raykv_index_route_seconds": "histogram",
    "raykv_router_decision_seconds": "histogram",
    "raykv_router_render_seconds": "histogram",
}
"""Every series WorkerMetrics, IndexMetrics and RouterMetrics create, and its kind (counter,
gauge, histogram)."""


def prometheus_names(series: Mapping[str, str] | None = None) -> frozenset[str]:
    """The names under which Ray's Prometheus endpoint serves ``series`` (default
    :data:`SERIES`): Ray prefixes ``ray_``; a counter ends in ``_total``; a histogram is served
    as ``_bucket``, ``_sum`` and ``_count``."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return frozenset(
        f"ray_{name}{suffix}" for name, kind in (series or SERIES).items() for suffix in suffixes[kind]
    )

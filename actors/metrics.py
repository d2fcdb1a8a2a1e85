"""Prometheus metrics for CacheWorker actors, exported through ray.util.metrics.

Counters are fed from stats deltas (so restarts of the exporter never double count); gauges show
bytes in use per tier and pinned pages. Tags: worker, tier.
"""

from __future__ import annotations

from ray.util import metrics

from raykv.stats import CacheStats


class WorkerMetrics:
    """Publishes one worker's CacheStats as Prometheus series."""

    def __init__(self, worker: str) -> None:
        tags = ("worker", "tier")
        self.worker = worker
        self.hits = metrics.Counter("raykv_hit_blocks", "Blocks reused, by tier", tag_keys=tags)
        self.misses = metrics.Counter("raykv_miss_blocks", "Blocks not cached", tag_keys=("worker",))
        self.evictions = metrics.Counter("raykv_evictions", "Blocks dropped, by tier", tag_keys=tags)
        self.demotions = metrics.Counter("raykv_demotions", "Pages demoted, by source tier", tag_keys=tags)
        self.promotions = metrics.Counter("raykv_promotions", "Pages promoted, by source tier", tag_keys=tags)
        self.bytes = metrics.Gauge("raykv_bytes_in_use", "Bytes held, by tier", tag_keys=tags)
        self.pinned = metrics.Gauge(
            "raykv_pinned_pages", "Pages pinned by active requests", tag_keys=("worker",)
        )
        self._last: CacheStats | None = None

    def update(self, stats: CacheStats) -> None:
        """Export the change since the previous call."""
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
        self.pinned.set(stats.pinned_pages, tags={"worker": self.worker})
        self._last = stats

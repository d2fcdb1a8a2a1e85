"""cluster/grafana-raykv.json against what raykv exports: every query names a series of
actors.cache.metrics.SERIES under the name Ray's Prometheus endpoint gives it, groups only by tags that
series has, and the panels the operations guide promises are there. SERIES itself is checked
against the series WorkerMetrics, IndexMetrics and RouterMetrics create."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from actors.cache.metrics import SERIES, IndexMetrics, RouterMetrics, WorkerMetrics, prometheus_names

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "grafana-raykv.json"
NAME = re.compile(r"\b(ray_raykv_[a-z_]+|raykv_[a-z_]+)")
BY = re.compile(r"\bby \(([^)]*)\)")


class KindRecorder:
    """A metrics backend that records each series' kind and tag keys."""

    def __init__(self) -> None:
        self.kinds: dict[str, str] = {}
        self.tags: dict[str, tuple[str, ...]] = {}

    def _add(self, kind: str, name: str, tag_keys: tuple[str, ...]) -> Any:
        assert name not in self.kinds, f"{name} created twice"
        self.kinds[name], self.tags[name] = kind, tuple(tag_keys)
        return self

    def Counter(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> Any:
        return self._add("counter", name, tag_keys)

    def Gauge(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> Any:
        return self._add("gauge", name, tag_keys)

    def Histogram(self, name: str, description: str = "", boundaries: Any = (), tag_keys: Any = ()) -> Any:
        return self._add("histogram", name, tag_keys)


def _created() -> KindRecorder:
    rec = KindRecorder()
    WorkerMetrics("w", backend=rec)
    IndexMetrics(0, backend=rec)
    RouterMetrics("app", backend=rec)
    return rec


def _queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def _base(prom_name: str) -> str:
    """``ray_raykv_x_total`` -> ``raykv_x`` (the series of SERIES it serves)."""
    for name in SERIES:
        if prom_name.startswith(f"ray_{name}") and prom_name in prometheus_names({name: SERIES[name]}):
            return name
    raise AssertionError(f"{prom_name} is not a name raykv exports")


def test_series_catalogue_is_what_the_exporters_create() -> None:
    assert _created().kinds == SERIES
    names = prometheus_names()
    assert "ray_raykv_hit_blocks_total" in names and "ray_raykv_bytes_in_use" in names
    assert {"ray_raykv_index_route_seconds_bucket", "ray_raykv_index_route_seconds_count"} <= names
    assert "raykv_hit_blocks" not in names  # Ray adds the ray_ prefix


def test_every_dashboard_query_names_an_exported_series_and_its_tags() -> None:
    tags = _created().tags
    queries = _queries()
    assert len(queries) >= 12
    for title, expr in queries:
        found = NAME.findall(expr)
        assert found, (title, expr)
        bases = {_base(name) for name in found}
        allowed = {"le"} | {t for b in bases for t in tags[b]}
        for group in BY.findall(expr):
            labels = {label.strip() for label in group.split(",")}
            assert labels <= allowed, (title, expr, labels - allowed)


def test_dashboard_covers_what_operators_watch() -> None:
    used = {_base(n) for _, expr in _queries() for n in NAME.findall(expr)}
    must = {
        "raykv_hit_blocks",  # hit ratio per tier
        "raykv_miss_blocks",
        "raykv_evictions",
        "raykv_transfer_pulled_bytes",  # transfer bytes
        "raykv_transfer_served_bytes",
        "raykv_transfer_pull_seconds",  # transfer latency
        "raykv_index_event_lag",  # index lag
        "raykv_index_route_seconds",  # route latency
        "raykv_integrity_drops",
        "raykv_router_decisions",  # routing outcomes
        "raykv_router_decision_seconds",  # routing decision latency
    }
    assert must <= used, must - used
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dash["panels"] for t in p["targets"])
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]

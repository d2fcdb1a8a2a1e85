"""A stand-in for ``ray.util.metrics`` for the metrics tests: every series' current value per
tag set, checked as Prometheus would (counters only grow, tags match the declared keys)."""

from __future__ import annotations

import collections


class Recorder:
    """Stands in for ray.util.metrics: the current value of every series per tag set."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = collections.defaultdict(float)
        self.observed: list[tuple[str, dict[str, str], float]] = []

    def Counter(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> Series:
        return Series(self, name, tag_keys, counter=True)

    def Gauge(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> Series:
        return Series(self, name, tag_keys, counter=False)

    def Histogram(
        self, name: str, description: str = "", boundaries: list[float] = (), tag_keys: tuple[str, ...] = ()
    ) -> Series:
        assert list(boundaries) == sorted(boundaries) and boundaries
        return Series(self, name, tag_keys, counter=False)

    def get(self, name: str, **tags: str) -> float:
        return self.values.get((name, tuple(sorted(tags.items()))), 0.0)

    def named(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tags: v for (n, tags), v in self.values.items() if n == name}


class Series:
    def __init__(self, recorder: Recorder, name: str, tag_keys: tuple[str, ...], counter: bool) -> None:
        self.recorder, self.name, self.tag_keys, self.counter = recorder, name, tag_keys, counter

    def _key(self, tags: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return self.name, tuple(sorted(tags.items()))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert self.counter and value > 0, (self.name, value)
        self.recorder.values[self._key(tags or {})] += value

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        assert not self.counter
        self.recorder.values[self._key(tags or {})] = value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.recorder.observed.append((self.name, tags or {}, value))

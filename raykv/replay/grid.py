"""Run every router at every capacity on one trace (pure; backends come from the caller).

Capacity: ``capacity_pct`` is the *total* capacity W x C as a percentage of the trace's unique
blocks (distinct (salt, hash id) pairs), so C = max(2, round(pct / 100 * unique / W)) blocks per
worker; the pooled ideal gets one cache of W x C blocks. Every router replays the same prepared
requests (block keys computed once) with the same seed on a fresh backend (empty caches). Chat
requests (the ``chat_text`` family) are rendered to ids once, by one
:class:`~raykv.replay.chat_text.ChatPrompts` in arrival order, before they are keyed; its cost
(render times, prefix reuse, unrenderable requests) is the result's ``meta["tokenize"]``.

``make_backend(num_caches, blocks_per_cache, pooled)`` is a context manager yielding a
:class:`~raykv.replay.engine.Backend` with empty caches (``pooled``: the one cache of the pooled
ideal); ``actors/replay/backends.py`` provides in-process CacheWorkers and a Ray deployment. After each
run the backend verifies ``verify`` cached pages against the content oracle (when it has a
``verify`` method). Ctrl-C stops the grid and keeps every finished run plus
the partial one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TextIO

from raykv.core.errors import InvalidArgumentError
from raykv.replay.chat_text import ChatPrompts
from raykv.replay.engine import Backend, Prepared, prepare, replay
from raykv.replay.report import Summary, summarize
from raykv.replay.routers import ROUTERS, make_router
from raykv.replay.timing import TimingConfig
from raykv.replay.trace import Request, span_s, unique_blocks
from raykv.routing.policy import DEFAULT_ROUTING, RoutingConfig

BackendFactory = Callable[[int, int, bool], AbstractContextManager[Backend]]


@dataclass(frozen=True)
class GridSpec:
    """Workers, total capacities (% of unique blocks), routers, seed, timing, and the routing
    configuration of the raykv routers (the shipped default unless an experiment overrides it)."""

    workers: int = 8
    capacity_pcts: tuple[float, ...] = (2.0, 10.0, 30.0)
    routers: tuple[str, ...] = ROUTERS
    seed: int = 0
    timing: TimingConfig = field(default_factory=TimingConfig)
    routing: RoutingConfig = DEFAULT_ROUTING
    verify: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidArgumentError("workers", f"must be >= 1, got {self.workers}")
        if not self.capacity_pcts or any(not 0 < c <= 1000 for c in self.capacity_pcts):
            raise InvalidArgumentError("capacity_pcts", f"need values in (0, 1000], got {self.capacity_pcts}")
        for name in self.routers:
            if name not in ROUTERS:
                raise InvalidArgumentError("routers", f"unknown router {name!r}")


def blocks_per_worker(unique: int, pct: float, workers: int) -> int:
    """C for a total capacity of ``pct`` % of ``unique`` blocks over ``workers`` workers."""
    return max(2, round(pct / 100.0 * unique / workers))


@dataclass
class GridResult:
    """Summaries in run order, whether Ctrl-C cut the grid short, and run metadata."""

    summaries: list[Summary]
    interrupted: bool
    meta: dict[str, Any]


class ProgressBar:
    """``label [#####.....] done/total`` redrawn in place on ``out`` at most every 0.2 s.

    On a stream that is not a terminal only the final line is written. ``out`` None: silent.
    """

    def __init__(self, out: TextIO | None, label: str, width: int = 30) -> None:
        self.out, self.label, self.width = out, label, width
        self.start = self.last = time.perf_counter()
        self.tty = bool(out is not None and getattr(out, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        final = done >= total
        if self.out is None or (not final and (not self.tty or now - self.last < 0.2)):
            return
        self.last = now
        filled = self.width * done // max(1, total)
        self.out.write(
            f"{chr(13) if self.tty else ''}  {self.label:<34} "
            f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {now - self.start:5.1f}s"
        )
        if final:
            self.out.write("\n")
        self.out.flush()

    def close(self) -> None:
        """End the line after an interrupted run (prints where it stopped)."""
        if self.out is not None:
            self.out.write(f"  {self.label}: interrupted\n")
            self.out.flush()


def _one(
    prepared: Sequence[Prepared],
    name: str,
    cap: float,
    blocks: int,
    spec: GridSpec,
    speed: float,
    make_backend: BackendFactory,
    span: float,
    out: TextIO | None,
) -> Summary:
    router = make_router(name, spec.routing)
    caches, per_cache = (1, blocks * spec.workers) if router.pooled else (spec.workers, blocks)
    with make_backend(caches, per_cache, router.pooled) as backend:
        bar = ProgressBar(out, f"{cap:g}% C={blocks} {name}")
        res = replay(prepared, router, backend, spec.timing, speed, spec.workers, spec.seed, bar)
        if res.interrupted:
            bar.close()
        verify = getattr(backend, "verify", None)
        if spec.verify and verify is not None and not res.interrupted:
            res.notes["verified_pages"] = verify(spec.verify)
        paths = getattr(backend, "pull_paths", None)
        if paths:
            res.notes["pull_paths"] = dict(paths)
        page_bytes = backend.page_bytes
    return summarize(res, cap, blocks, spec.timing, span, page_bytes)


def run_grid(
    requests: Sequence[Request],
    spec: GridSpec,
    make_backend: BackendFactory,
    out: TextIO | None = sys.stderr,
) -> GridResult:
    """Replay ``requests`` through every router of ``spec`` at every capacity (module docstring)."""
    if not requests:
        raise InvalidArgumentError("requests", "nothing to replay")
    t0 = time.perf_counter()
    prompts = ChatPrompts() if any(r.messages is not None for r in requests) else None
    prepared = prepare(requests, prompts)
    unique = unique_blocks(requests)
    speed = spec.timing.calibrate(requests, spec.workers)
    span = span_s(requests)
    meta: dict[str, Any] = {
        "requests": len(requests),
        "unique_blocks": unique,
        "workers": spec.workers,
        "speed_units_per_s": speed,
        "span_s": span,
        "seed": spec.seed,
        "timing": spec.timing.__dict__,
        "routing": spec.routing.__dict__,
        "capacity_pcts": list(spec.capacity_pcts),
    }
    if prompts is not None:
        meta["tokenize"] = prompts.summary()
    summaries: list[Summary] = []
    interrupted = False
    try:
        for cap in spec.capacity_pcts:
            blocks = blocks_per_worker(unique, cap, spec.workers)
            for name in spec.routers:
                s = _one(prepared, name, cap, blocks, spec, speed, make_backend, span, out)
                summaries.append(s)
                if s.interrupted:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    meta["wall_s"] = time.perf_counter() - t0
    return GridResult(summaries, interrupted, meta)

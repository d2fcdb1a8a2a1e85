"""The replay's timing model: per-worker FIFO servers in simulated time (pure; no ray).

Each of the W servers (one per worker) serves its requests one at a time, in dispatch order (no
batching, no prefill/decode overlap). A request's work, in *units* (one unit = prefilling one
token):

    work = uncached input tokens + decode_units_per_token * output tokens

and it spends ``pre_s`` before that: the time to pull blocks from another worker
(``link_latency_s + bytes / link_bytes_per_s``) plus the time to read reused blocks from a lower
tier (``bytes / lower_tier_bytes_per_s[i]`` for the second, third tier). Bytes are KV bytes of
the *modelled* engine (``kv_bytes_per_token`` per token, default Llama-3.1-8B in bf16: 32 layers x
8 KV heads x 128 dims x K,V x 2 bytes), not the replay's tiny pages.

    start  = max(arrival, when the server is free)
    TTFT   = (start - arrival) + pre_s + uncached tokens / speed
    finish = start + pre_s + work / speed

``speed`` (units per second per server) is calibrated so that the trace's *no-cache* work (every
input token prefilled) is ``target_load`` (70%) of W servers' capacity over the trace's span, as
in ../shared/reference/router_baselines.md; cache hits lower the realised utilisation.

Load signals, all at the arrival time: ``queue_lengths`` / ``in_flight`` (requests dispatched and
not finished: what Ray's routers compare), ``busy_since`` (when each server last went from idle to
busy), ``queued_prefill`` (prompt tokens still to prefill: the
uncached tokens of requests whose prefill has not started plus what is left of the one in
progress, as an engine's scheduler knows them; what a raykv worker reports as
``queued_prefill_tokens``) and ``mean_decode_units`` (mean decode units of the requests finished so
far: what a router can learn from completions); ``reported_loads`` combines them into raykv's load
estimate. ``outstanding`` (exact units not yet served) uses the output lengths of requests still
decoding, which no deployment knows in advance: only the ``pooled_oracle`` ideal uses it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.core.errors import InvalidArgumentError
from raykv.replay.trace import Request, span_s


@dataclass(frozen=True)
class TimingConfig:
    """Constants of the timing model (see the module docstring). ``speed`` None = calibrate."""

    target_load: float = 0.7
    decode_units_per_token: float = 5.0
    kv_bytes_per_token: int = 131072
    link_bytes_per_s: float = 25e9
    link_latency_s: float = 0.001
    lower_tier_bytes_per_s: tuple[float, ...] = (16e9, 2e9)
    speed: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.target_load <= 10.0:
            raise InvalidArgumentError("target_load", f"must be in (0, 10], got {self.target_load}")
        for name in ("decode_units_per_token", "link_latency_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise InvalidArgumentError(name, "must be finite and >= 0")
        if self.kv_bytes_per_token < 1 or self.link_bytes_per_s <= 0:
            raise InvalidArgumentError("kv_bytes_per_token", "KV bytes and link bandwidth must be > 0")
        if any(bw <= 0 for bw in self.lower_tier_bytes_per_s):
            raise InvalidArgumentError("lower_tier_bytes_per_s", "bandwidths must be > 0")
        if self.speed is not None and not (math.isfinite(self.speed) and self.speed > 0):
            raise InvalidArgumentError("speed", f"must be > 0, got {self.speed}")

    def no_cache_work(self, req: Request) -> float:
        """Units of ``req`` when nothing is cached."""
        return req.input_length + self.decode_units_per_token * req.output_length

    def calibrate(self, requests: Sequence[Request], servers: int) -> float:
        """Units per second per server (``speed`` if set, else the 70%-load calibration)."""
        if self.speed is not None:
            return self.speed
        if not requests or servers < 1:
            raise InvalidArgumentError("requests", "calibration needs requests and >= 1 server")
        total = sum(self.no_cache_work(r) for r in requests)
        return total / (self.target_load * servers * span_s(requests))

    def pull_s(self, tokens: int) -> float:
        """Seconds to pull ``tokens`` tokens of KV from another worker (0 for none)."""
        if tokens <= 0:
            return 0.0
        return self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def lower_tier_s(self, tokens_by_level: Sequence[int]) -> float:
        """Seconds to read reused KV from tiers below the top (index 0 = top tier, free)."""
        total = 0.0
        for level, tokens in enumerate(tokens_by_level[1:]):
            if tokens:
                bw = self.lower_tier_bytes_per_s[min(level, len(self.lower_tier_bytes_per_s) - 1)]
                total += tokens * self.kv_bytes_per_token / bw
        return total


@dataclass(frozen=True)
class Served:
    """When a dispatched request starts, its TTFT and when it finishes (simulated seconds)."""

    start: float
    ttft: float
    finish: float


class ServerQueues:
    """W FIFO servers in simulated time. Call :meth:`advance` with non-decreasing times."""

    def __init__(self, servers: int, speed: float) -> None:
        if servers < 1 or not speed > 0:
            raise InvalidArgumentError("servers", "need >= 1 server and speed > 0")
        self.speed = speed
        self.now = 0.0
        self.free_at = [0.0] * servers
        self.work = [0.0] * servers  # units served (or queued) per server over the run
        self.queued_prefill = [0.0] * servers  # reported at the last advance (module docstring)
        self._prefill_sum = [0.0] * servers  # uncached tokens of the requests in _prefills
        self._finishes: list[collections.deque[tuple[float, float]]] = [
            collections.deque() for _ in range(servers)
        ]
        self._prefills: list[collections.deque[tuple[float, float]]] = [
            collections.deque() for _ in range(servers)
        ]
        self.in_flight = [0] * servers  # requests dispatched and not finished (at the last advance)
        self.busy_since = [0.0] * servers  # when each server last went from idle to busy
        self._done = 0
        self._done_decode = 0.0

    @property
    def servers(self) -> int:
        return len(self.free_at)

    def advance(self, now: float) -> None:
        """Move the clock to ``now`` (never backwards) and retire finished requests."""
        self.now = now = max(self.now, now)
        speed, reported = self.speed, self.queued_prefill
        for server, queue in enumerate(self._prefills):
            while queue and queue[0][0] <= now:
                self._prefill_sum[server] -= queue.popleft()[1]
            if not queue:
                self._prefill_sum[server] = reported[server] = 0.0  # no float drift
                continue
            end, head = queue[0]  # the head may be part-way through its prefill
            reported[server] = self._prefill_sum[server] - head + min(head, (end - now) * speed)
        for server, queue in enumerate(self._finishes):
            if queue and queue[0][0] <= now:
                while queue and queue[0][0] <= now:
                    self._done += 1
                    self._done_decode += queue.popleft()[1]
                self.in_flight[server] = len(queue)

    @property
    def mean_decode_units(self) -> float:
        """Mean decode units (``work - uncached``) of the requests finished so far (0 before any)."""
        return self._done_decode / self._done if self._done else 0.0

    def reported_loads(self) -> list[float]:
        """Per server, the load a raykv deployment reports, in units: ``queued_prefill`` plus
        ``mean_decode_units`` per request in flight (what raykv's routers and the pooled ideal
        compare; no output length of a request still running enters it)."""
        dec = self._done_decode / self._done if self._done else 0.0  # mean_decode_units, inlined
        loads = []
        for q, n in zip(self.queued_prefill, self.in_flight):  # no comprehension: no function object
            loads.append(q + dec * n)
        return loads

    def outstanding(self) -> list[float]:
        """Per server, units of work not yet served at ``now``."""
        now, speed = self.now, self.speed
        return [max(0.0, f - now) * speed for f in self.free_at]

    def queue_lengths(self) -> list[int]:
        """Per server, requests dispatched and not finished at ``now`` (a copy of ``in_flight``)."""
        return list(self.in_flight)

    def dispatch(self, server: int, pre_s: float, uncached: float, work: float) -> Served:
        """Queue a request arriving at ``now``: ``pre_s`` seconds of transfers, then ``work``
        units of which the first ``uncached`` are the prefill that precedes the first token."""
        start = max(self.now, self.free_at[server])
        ttft = start - self.now + pre_s + uncached / self.speed
        prefilled = start + pre_s + uncached / self.speed
        finish = start + pre_s + work / self.speed
        self.free_at[server] = finish
        self.work[server] += work
        self._finishes[server].append((finish, work - uncached))
        self._prefills[server].append((prefilled, uncached))
        if not self.in_flight[server]:
            self.busy_since[server] = self.now
        self.in_flight[server] += 1
        self._prefill_sum[server] += uncached
        self.queued_prefill[server] += uncached
        return Served(start, ttft, finish)

    def imbalance(self) -> float:
        """max / mean of the work given to each server (1.0 = perfectly even)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean > 0 else 1.0

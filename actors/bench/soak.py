"""``raykv bench soak``: replay the built-in workload against a live local deployment while
injecting faults, with the content oracle checking every page served.

A cache may get slower under faults; it must never serve a wrong page nor fail a request because
of itself. The deployment runs :class:`actors.testing.TestingCacheWorker` workers (the oracle is
their engine) restarted by Ray without limit. One driver thread replays requests in a closed loop:
``pick_worker`` chooses, the worker runs the request with ``verify=True`` (the reused pages and
every page before commit are oracle-checked), and a share of requests then moves to a second
worker through a page pull and runs there too (a prefill/decode split). A fault thread injects, one
at a time at seeded random times, every kind in :data:`FAULT_KINDS`:

- ``kill_worker``: ``ray.kill(no_restart=False)``, Ray restarts it empty;
- ``kill_shard``: the same for an index shard (it rebuilds from worker snapshots);
- ``stop_worker`` / ``stop_shard``: SIGSTOP the actor's process for 1-2 s, then SIGCONT;
- ``transfer``: a worker's page server drops, stalls or corrupts pulls for a few seconds;
- ``disk``: flip a byte in some of a worker's disk-tier pages (``corrupt_disk``).

Counted per request: served; failed by the cache (any exception but a documented fallback: a
pull's TransferError, after which the destination recomputes, and an actor the soak itself killed
or stopped, after which the request is routed again, counted as ``rerouted``); oracle mismatches
(a wrong page, a broken invariant, an impossible outcome). Every 10 s window and at the end, every
live worker verifies all its pages (``verify_all``) and its invariants (``check``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.testing import RequestOutcome, TestingCacheWorker
from raykv.core.config import BufferSpec, CacheConfig, KVLayout, LayerSpec, TierConfig
from raykv.core.errors import TransferError, UnavailableError
from raykv.core.keys import ReuseScope
from raykv.core.types import WorkerId
from raykv.replay.trace import BLOCK_TOKENS, Request, tokens_for
from raykv.replay.workload import WorkloadSpec, generate

FAULT_KINDS = ("kill_worker", "kill_shard", "stop_worker", "stop_shard", "transfer", "disk")
WINDOW_S = 10.0
CALL_S = 30.0  # one actor call; a stopped process answers once continued
RETRIES = 5  # attempts per request when the chosen worker was killed or stopped under it
TRANSFER_FAULTS: tuple[dict[str, Any], ...] = (
    {"drop_after_header": True},
    {"corrupt_payload": True},
    {"stall_after_header_s": 0.5},
)
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, UnavailableError)


def soak_config(host_pages: int = 48, disk_pages: int = 256) -> CacheConfig:
    """Tiny pages (one layer, K and V of one int8 each, 512 tokens per block: 1 KiB) on a small
    host tier over a disk tier, so requests both hit and spill to disk."""
    kv = (BufferSpec("k", (1,), "int8"), BufferSpec("v", (1,), "int8"))
    layout = KVLayout(layers=(LayerSpec(0, kv),), tokens_per_block=BLOCK_TOKENS)
    page = layout.page_bytes
    tiers = (TierConfig.host(host_pages * page, pin_memory=False), TierConfig.disk(disk_pages * page))
    return CacheConfig(layout, tiers)


def soak_workload(seed: int, requests: int = 2000) -> list[Request]:
    """The built-in workload, scaled so a request is at most ~16 blocks."""
    spec = WorkloadSpec(
        requests=requests,
        seed=seed,
        system_tokens=(600, 1500),
        user_tokens=(50, 400),
        output_tokens=(20, 200),
        agent_context=(1000, 4000),
        fanout=(2, 4),
    )
    return generate(spec)


# ---- tallies ------------------------------------------------------------------------------------
@dataclass
class Window:
    """One WINDOW_S slice of the soak."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    faults: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Tally:
    """What the soak counted; shared by the driver and the fault thread (under ``lock``)."""

    started: float = field(default_factory=time.monotonic)
    served: int = 0
    failed: int = 0
    mismatches: int = 0
    rerouted: int = 0
    pulls: int = 0
    pull_fallbacks: int = 0
    verified_pages: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    windows: list[Window] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def window(self) -> Window:
        i = int((time.monotonic() - self.started) // WINDOW_S)
        while len(self.windows) <= i:
            self.windows.append(Window())
        return self.windows[i]

    def error(self, kind: str, what: str) -> None:
        with self.lock:
            if kind == "mismatch":
                self.mismatches += 1
            else:
                self.failed += 1
            if len(self.errors) < 20:
                self.errors.append(f"{kind}: {what}")

    def fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1
            self.window().faults += 1


# ---- faults -------------------------------------------------------------------------------------
class Faults(threading.Thread):
    """Injects one fault at a time at seeded random times until ``stop`` is set."""

    def __init__(self, dep: Any, tally: Tally, seed: int, interval_s: float) -> None:
        super().__init__(name="raykv-soak-faults", daemon=True)
        self.dep, self.tally, self.interval_s = dep, tally, interval_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.touched: dict[str, float] = {}  # actor name -> when its fault ended (or began)
        self.order: list[str] = []

    def next_kind(self) -> str:
        """Every kind once per round, in a seeded order (so a short soak still sees each kind)."""
        if not self.order:
            self.order = list(FAULT_KINDS)
            self.rng.shuffle(self.order)
        return self.order.pop()

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.interval_s):
            kind = self.next_kind()
            try:
                if getattr(self, f"_{kind}")():
                    self.tally.fault(kind)
            except Exception as exc:  # a fault that could not be injected is not the cache's failure
                with self.tally.lock:
                    self.tally.errors.append(f"fault {kind} not injected: {exc!r}"[:300])

    def recently(self, name: str, within_s: float = 20.0) -> bool:
        when = self.touched.get(name)
        return when is not None and time.monotonic() - when < within_s

    def _mark(self, name: str) -> None:
        self.touched[name] = time.monotonic()

    def _worker(self) -> tuple[WorkerId, Any]:
        live = self.dep.live_workers() or list(self.dep.worker_ids)
        name = self.rng.choice(sorted(live))
        return name, self.dep.workers[name]

    def _shard(self) -> tuple[str, Any]:
        i = self.rng.randrange(len(self.dep.shards))
        return self.dep.spec.shards[i], self.dep.shards[i]

    def _kill(self, name: str, handle: Any, ping: Callable[[], Any]) -> bool:
        self._mark(name)
        ray.kill(handle, no_restart=False)
        _until(lambda: ray.get(ping(), timeout=2.0), 60.0, self.stop)  # back before the next fault
        self._mark(name)
        return True

    def _kill_worker(self) -> bool:
        name, handle = self._worker()
        return self._kill(name, handle, lambda: handle.health.remote())

    def _kill_shard(self) -> bool:
        name, handle = self._shard()
        return self._kill(name, handle, lambda: handle.ping.remote())

    def _pause(self, name: str, pid: int) -> bool:
        self._mark(name)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.rng.uniform(1.0, 2.0))
        finally:
            os.kill(pid, signal.SIGCONT)
            self._mark(name)
        return True

    def _stop_worker(self) -> bool:
        name, handle = self._worker()
        return self._pause(name, int(ray.get(handle.health.remote(), timeout=CALL_S)["pid"]))

    def _stop_shard(self) -> bool:
        name, handle = self._shard()
        return self._pause(name, int(ray.get(handle.info.remote(), timeout=CALL_S)["pid"]))

    def _transfer(self) -> bool:
        _, handle = self._worker()
        fault = self.rng.choice(TRANSFER_FAULTS)
        ray.get(handle.set_transfer_faults.remote(**fault), timeout=CALL_S)
        self.stop.wait(self.rng.uniform(2.0, 4.0))
        off = {k: type(v)() for k, v in fault.items()}
        _until(lambda: ray.get(handle.set_transfer_faults.remote(**off), timeout=2.0) or True, 60.0, None)
        return True

    def _disk(self) -> bool:
        for name in self.rng.sample(sorted(self.dep.live_workers()), len(self.dep.live_workers())):
            hit = ray.get(
                self.dep.workers[name].corrupt_disk.remote(3, self.rng.randrange(1 << 30)), timeout=CALL_S
            )
            if hit:
                return True
        return False


def _until(check: Callable[[], Any], timeout_s: float, stop: threading.Event | None) -> bool:
    """Call ``check`` until it returns truthy (exceptions count as no) or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


# ---- requests -----------------------------------------------------------------------------------
def check_outcome(out: RequestOutcome, tokens: int, tpb: int, decode: int = 0) -> str | None:
    """What is impossible about a request's outcome (None: nothing)."""
    if not 0 <= out.reused_tokens <= tokens or out.reused_tokens % tpb:
        return f"reused {out.reused_tokens} of {tokens} tokens"
    if sum(out.reused_by_tier) * tpb != out.reused_tokens:
        return f"reused by tier {out.reused_by_tier} != {out.reused_tokens} tokens"
    if out.committed_blocks > (tokens + decode) // tpb:
        return f"committed {out.committed_blocks} blocks of a {tokens + decode}-token request"
    return None


class Driver:
    """Runs the requests, one at a time, and counts what happened."""

    def __init__(self, dep: Any, tally: Tally, faults: Faults, seed: int, pull_share: float) -> None:
        self.dep, self.tally, self.faults = dep, tally, faults
        self.rng = random.Random(seed + 1)
        self.pull_share = pull_share
        self.tpb = dep.config.tokens_per_block

    def one(self, req: Request) -> None:
        tokens = [int(t) for t in tokens_for(req)]
        scope = ReuseScope(None, req.salt)
        try:
            worker, out = self._run_routed(tokens, req.salt, scope)
            self._account(tokens, out)
            if self.rng.random() < self.pull_share:
                self._split(worker, tokens, req.salt, scope)
        except AssertionError as exc:
            self.tally.error("mismatch", str(exc)[:300])
        except Exception as exc:
            self.tally.error("failed", f"{type(exc).__name__}: {exc}"[:300])

    def _run_routed(
        self, tokens: list[int], salt: int | None, scope: ReuseScope
    ) -> tuple[WorkerId, RequestOutcome]:
        """Pick a worker and run there; again when a worker the soak faulted failed under it."""
        for attempt in range(RETRIES):
            worker = WorkerId("")
            try:
                worker = self.dep.pick_worker(tokens, scope).worker
                return worker, self._run(worker, tokens, salt)
            except ACTOR_GONE:
                if attempt + 1 == RETRIES or not self._faulted(worker):
                    raise
                with self.tally.lock:
                    self.tally.rerouted += 1
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def _faulted(self, worker: str) -> bool:
        """Whether the soak itself killed or stopped ``worker`` lately ("": any actor)."""
        names = [worker] if worker else list(self.faults.touched)
        return any(self.faults.recently(n) for n in names)

    def _run(
        self, worker: WorkerId, tokens: list[int], salt: int | None, decode: Sequence[int] = ()
    ) -> RequestOutcome:
        handle = self.dep.workers[worker]
        out: RequestOutcome = ray.get(
            handle.run_request.remote(tokens, salt=salt, decode_tokens=list(decode), verify=True),
            timeout=CALL_S,
        )
        bad = check_outcome(out, len(tokens), self.tpb, len(decode))
        if bad:
            raise AssertionError(f"{worker}: {bad}")
        return out

    def _account(self, tokens: Sequence[int], out: RequestOutcome) -> None:
        with self.tally.lock:
            self.tally.served += 1
            win = self.tally.window()
            win.requests += 1
            win.prompt_tokens += len(tokens)
            win.reused_tokens += out.reused_tokens

    def _split(self, src: WorkerId, tokens: list[int], salt: int | None, scope: ReuseScope) -> None:
        """Decode on another live worker: pull the prompt's blocks from ``src`` (a failed pull
        falls back to recomputing), then run the request there with a few decode tokens."""
        others = [w for w in self.dep.live_workers() if w != src]
        if not others:
            return
        dst = self.rng.choice(sorted(others))
        keys = self.dep.keys(tokens, scope)
        with self.tally.lock:
            self.tally.pulls += 1
        try:
            self.dep.pull(dst, src, keys)
        except TransferError:
            with self.tally.lock:
                self.tally.pull_fallbacks += 1
        try:
            self._run(dst, tokens, salt, decode=[7] * self.tpb)
        except ACTOR_GONE:
            if not (self._faulted(dst) or self._faulted(src)):
                raise
            with self.tally.lock:
                self.tally.rerouted += 1

    def verify_all(self) -> None:
        """Every live worker verifies all its pages and its invariants."""
        for name in self.dep.live_workers():
            handle = self.dep.workers.get(name)
            if handle is None:
                continue
            try:
                pages = ray.get(handle.verify_all.remote(), timeout=CALL_S)
                ray.get(handle.check.remote(), timeout=CALL_S)
            except AssertionError as exc:
                self.tally.error("mismatch", f"{name}: {exc}"[:300])
                continue
            except ACTOR_GONE:
                continue  # restarted or stopped meanwhile: its pages were not served
            with self.tally.lock:
                self.tally.verified_pages += int(pages)


# ---- the soak -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakArgs:
    minutes: float = 1.0
    workers: int = 3
    shards: int = 2
    seed: int = 0
    fault_interval_s: float = 3.0
    pull_share: float = 0.25
    every_kind: bool = False  # run past ``minutes`` (up to 3x) until each fault kind was injected


def run_soak(args: SoakArgs, progress: bool = True) -> Tally:
    """Start a deployment in a fresh namespace, soak it for ``args.minutes``, shut it down."""
    import raykv

    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    dep = raykv.start(
        num_workers=args.workers,
        index_shards=args.shards,
        config=soak_config(),
        namespace=f"raykv-soak-{uuid.uuid4().hex[:8]}",
        max_restarts=-1,
        worker_class=TestingCacheWorker,
    )
    try:
        return _soak(dep, args, progress)
    finally:
        dep.shutdown()
        if owns_ray:
            ray.shutdown()


def _soak(dep: Any, args: SoakArgs, progress: bool) -> Tally:
    tally = Tally()
    faults = Faults(dep, tally, args.seed, args.fault_interval_s)
    driver = Driver(dep, tally, faults, args.seed, args.pull_share)
    duration = args.minutes * 60.0
    bar = _Progress(duration, progress)
    faults.start()
    try:
        _drive(driver, tally, args, bar)
    finally:
        faults.stop.set()
        faults.join(timeout=120.0)
        bar.close()
    _settle(dep)
    driver.verify_all()
    return tally


def _done(tally: Tally, args: SoakArgs, elapsed: float) -> bool:
    duration = args.minutes * 60.0
    if elapsed < duration:
        return False
    with tally.lock:
        missing = [k for k in FAULT_KINDS if not tally.faults[k]]
    return not (args.every_kind and missing) or elapsed >= 3 * duration


def _drive(driver: Driver, tally: Tally, args: SoakArgs, bar: _Progress) -> None:
    round_ = 0
    next_verify = WINDOW_S
    while True:
        for req in soak_workload(args.seed * 1000 + round_):
            elapsed = time.monotonic() - tally.started
            if _done(tally, args, elapsed):
                return
            driver.one(req)
            if elapsed >= next_verify:
                driver.verify_all()
                next_verify += WINDOW_S
            bar.update(elapsed, tally)
        round_ += 1


def _settle(dep: Any) -> None:
    """Wait (bounded) until every worker and shard answers again after the last fault."""
    for handle in dep.workers.values():
        _until(lambda h=handle: ray.get(h.health.remote(), timeout=2.0), 60.0, None)
    for shard in dep.shards:
        _until(lambda s=shard: ray.get(s.ping.remote(), timeout=2.0), 60.0, None)


class _Progress:
    """tqdm on stderr when installed, else a line every 5 s."""

    def __init__(self, total_s: float, enabled: bool) -> None:
        self.enabled, self.last, self.bar = enabled, -1.0, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=int(total_s), unit="s", desc="soak", file=sys.stderr)
            except ImportError:
                pass

    def update(self, elapsed: float, tally: Tally) -> None:
        """Redraw at most twice a second (tqdm) or every 5 s (plain line)."""
        if not self.enabled or elapsed - self.last < (0.5 if self.bar is not None else 5.0):
            return
        self.last = elapsed
        status = (
            f"served={tally.served} faults={sum(tally.faults.values())} bad={tally.mismatches + tally.failed}"
        )
        if self.bar is not None:
            self.bar.n = min(int(elapsed), int(self.bar.total))
            self.bar.set_postfix_str(status, refresh=True)
        else:
            print(f"soak {elapsed:.0f}s {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- report -------------------------------------------------------------------------------------
def summary_line(tally: Tally, args: SoakArgs) -> str:
    faults = sum(tally.faults.values())
    hit = sum(w.reused_tokens for w in tally.windows) / max(1, sum(w.prompt_tokens for w in tally.windows))
    return (
        f"soak {args.minutes:g} min, {args.workers} workers, seed {args.seed}: "
        f"{tally.served} requests served, {faults} faults injected, "
        f"{tally.mismatches} oracle mismatches, {tally.failed} failed by the cache, "
        f"hit ratio {hit:.1%}"
    )


def report(tally: Tally, args: SoakArgs) -> str:
    """The final table and, last, the summary line."""
    lines = ["window      requests  faults  hit ratio"]
    for i, w in enumerate(tally.windows):
        t0 = i * WINDOW_S
        lines.append(f"{t0:4.0f}-{t0 + WINDOW_S:<4.0f}s  {w.requests:8d}  {w.faults:6d}  {w.hit_ratio:9.1%}")
    lines.append("")
    lines.append("faults by kind: " + ", ".join(f"{k} {tally.faults.get(k, 0)}" for k in FAULT_KINDS))
    lines.append(
        f"pulls {tally.pulls} ({tally.pull_fallbacks} fell back to recompute), "
        f"rerouted {tally.rerouted}, pages verified {tally.verified_pages}"
    )
    lines.extend(f"  {e}" for e in tally.errors)
    lines.append(summary_line(tally, args))
    return "\n".join(lines)


def soak_main(args: argparse.Namespace) -> int:
    """``raykv bench soak``: exit 1 when a page was wrong or a request failed by the cache."""
    soak = SoakArgs(
        minutes=args.minutes, workers=args.workers, seed=args.seed, fault_interval_s=args.fault_interval
    )
    tally = run_soak(soak)
    print(report(tally, soak), flush=True)
    return 1 if tally.mismatches or tally.failed else 0

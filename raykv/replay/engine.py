"""The replay loop: requests -> router -> (pull) -> cache worker -> timing model (pure; no ray).

:func:`replay` drives one router over one prepared trace against a :class:`Backend`: the cache
workers and the index (in-process CacheWorker objects or a Ray deployment; see
``actors/replay/backends.py``). For each request, in arrival order:

1. the servers' clock moves to the arrival time;
2. the router chooses a server (timed: the *routing decision*, from the request's block keys,
   which :func:`prepare` computed and timed beforehand, after rendering a chat request's
   messages to ids; see :mod:`raykv.replay.routers`);
3. if it asked for a pull, the named blocks are exported from the holder and imported into the
   chosen worker (the real export/import data path);
4. the chosen worker runs the whole request with the content oracle as engine
   (``TestingCacheWorker.run_request``, actors/testing.py): it reuses what it has cached, writes
   oracle KV for the rest and commits; its events reach the index before the next request;
5. the router updates its own state (timed separately), and the timing model queues the work.

A request longer than a worker's cache keeps only its first ``capacity_blocks`` blocks in the
cache; the rest is prefilled every time (counted as uncached). Ctrl-C (KeyboardInterrupt) ends the
loop cleanly: the result then covers the requests done so far and says ``interrupted``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from raykv.core.keys import ReuseScope
from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.replay.chat_text import ChatPrompts
from raykv.replay.routers import Prepared, Router, RouterContext
from raykv.replay.timing import ServerQueues, TimingConfig
from raykv.replay.trace import BLOCK_TOKENS, Request, tokens_for
from raykv.routing.session_keys import SessionKeys

Progress = Callable[[int, int], None]


class Outcome(NamedTuple):
    """What a worker did with one request: reused tokens and reused blocks per tier level."""

    reused_tokens: int
    reused_by_level: tuple[int, ...]


class Backend(Protocol):
    """Cache workers and the index as the replay sees them (one ``worker_ids`` entry per cache)."""

    worker_ids: list[WorkerId]
    capacity_blocks: int
    page_bytes: int

    def set_clock(self, now: float) -> None: ...
    def route(self, keys: Sequence[bytes]) -> dict[WorkerId, RouteMatch]: ...
    def predict(self, worker: WorkerId, keys: Sequence[bytes]) -> None: ...
    def run(self, worker: WorkerId, tokens: Any, salt: int | None) -> Outcome: ...
    def pull(self, src: WorkerId, dst: WorkerId, keys: Sequence[bytes]) -> int:
        """``dst`` imports ``keys`` from ``src``; ``src``'s copies become its first victims."""
        ...


def prepare(requests: Sequence[Request], prompts: ChatPrompts | None = None) -> list[Prepared]:
    """Each request with its block keys (computed once, shared by every router) and the time
    computing them took from its tokens (``keys_ns``; the tokens are given), through one
    :class:`~raykv.routing.session_keys.SessionKeys`, as raykv's Serve router keys prompts: with
    the compiled memo, any block equal to one keyed before (same parent key, same tokens) reuses
    its key; without it, a request of a labelled session (``session >= 0``) reuses the keys of
    the session's previous prompt, and one without a label is hashed whole.

    A chat request (``messages``) is first rendered to ids by ``prompts`` (None: a fresh
    :class:`~raykv.replay.chat_text.ChatPrompts`, made at the first chat request), timed in
    ``render_ns``, as raykv's Serve router renders a chat before it keys it; the rendered ids are
    then keyed like any request's. One that cannot be rendered gets no keys and ``unrendered``
    (the raykv routers route it by load)."""
    out = []
    clock = time.perf_counter_ns
    sessions = SessionKeys(BLOCK_TOKENS)
    for i, req in enumerate(requests):
        scope = ReuseScope(salt=req.salt) if req.salt is not None else None
        session = req.session if req.session >= 0 else None
        render_ns = 0
        if req.messages is None:
            tokens = tokens_for(req)
        else:
            prompts = prompts if prompts is not None else ChatPrompts()
            rendered, render_ns = prompts.render(req)
            if rendered is None:
                out.append(Prepared(i, req, (), 0, render_ns, True))
                continue
            tokens = rendered
        t0 = clock()
        keys = sessions.keys(tokens, scope, session)
        out.append(Prepared(i, req, keys, clock() - t0, render_ns))
    return out


@dataclass
class RunResult:
    """Everything measured in one run (one router, one capacity)."""

    router: str
    servers: int
    capacity_blocks: int
    total_requests: int
    speed: float
    ttft: list[float] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    decide_ns: list[int] = field(default_factory=list)
    keys_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    blocks: int = 0
    hit_blocks: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    pulled_blocks: int = 0
    pull_failures: int = 0
    work: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    no_cache_work: float = 0.0
    interrupted: bool = False
    wall_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return len(self.ttft)


def _context(
    router: Router,
    backend: Backend,
    servers: int,
    speed: float,
    timing: TimingConfig,
    prepared: Sequence[Prepared],
    seed: int,
    queues: ServerQueues,
) -> RouterContext:
    mean_work = sum(timing.no_cache_work(p.req) for p in prepared) / max(1, len(prepared))
    wids = backend.worker_ids if not router.pooled else [backend.worker_ids[0]] * servers
    return RouterContext(
        servers,
        list(wids),
        backend.route,
        backend.predict,
        speed,
        timing,
        mean_work,
        seed,
        lambda: queues.now,
        backend.capacity_blocks,
    )


def _pull(p: Prepared, choice: Any, backend: Backend, cap: int, res: RunResult) -> int:
    """Do the pull a router asked for; returns the blocks imported (0 if it failed)."""
    lo, hi = choice.own_blocks, min(choice.own_blocks + choice.pull_blocks, cap, len(p.keys))
    if hi <= lo:
        return 0
    src, dst = backend.worker_ids[choice.pull_from], backend.worker_ids[choice.server]
    try:
        n = backend.pull(src, dst, p.keys[lo:hi])
    except Exception as exc:  # a failed pull imports nothing: the worker recomputes
        res.pull_failures += 1
        res.notes.setdefault("pull_error", f"{type(exc).__name__}: {exc}"[:200])
        return 0
    res.pulled_blocks += n
    return n


def _step(
    p: Prepared, router: Router, backend: Backend, queues: ServerQueues, timing: TimingConfig, res: RunResult
) -> None:
    req = p.req
    queues.advance(req.arrival_s)
    backend.set_clock(queues.now)
    t0 = time.perf_counter_ns()
    choice = router.choose(p, queues)
    res.decide_ns.append(time.perf_counter_ns() - t0)
    res.keys_ns.append(p.keys_ns)
    cap = backend.capacity_blocks
    pulled = _pull(p, choice, backend, cap, res) if choice.pull_blocks > 0 else 0
    worker = backend.worker_ids[0] if router.pooled else backend.worker_ids[choice.server]
    out = backend.run(worker, tokens_for(req, cap), req.salt)
    t1 = time.perf_counter_ns()
    router.routed(p, choice)
    res.update_ns.append(time.perf_counter_ns() - t1)
    tpb = BLOCK_TOKENS
    pull_s = timing.pull_s(pulled * tpb)
    pre_s = pull_s + timing.lower_tier_s([b * tpb for b in out.reused_by_level])
    uncached = req.input_length - out.reused_tokens
    router.observed(pulled * tpb, pull_s, uncached, uncached / queues.speed)
    served = queues.dispatch(
        choice.server, pre_s, uncached, uncached + timing.decode_units_per_token * req.output_length
    )
    res.ttft.append(served.ttft)
    res.chosen.append(choice.server)
    res.reused.append(out.reused_tokens // tpb)
    res.makespan_s = max(res.makespan_s, served.finish)
    res.blocks += req.num_blocks
    res.hit_blocks += out.reused_tokens // tpb
    res.input_tokens += req.input_length
    res.hit_tokens += out.reused_tokens
    res.no_cache_work += timing.no_cache_work(req)


def replay(
    prepared: Sequence[Prepared],
    router: Router,
    backend: Backend,
    timing: TimingConfig,
    speed: float,
    servers: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> RunResult:
    """Replay ``prepared`` through ``router`` on ``backend`` (see the module docstring).

    ``servers`` FIFO servers run at ``speed`` units/s; a pooled router gets one cache
    (``backend.worker_ids[0]``) shared by all servers. Returns the RunResult (``interrupted`` after
    Ctrl-C). Errors other than KeyboardInterrupt propagate.
    """
    queues = ServerQueues(servers, speed)
    res = RunResult(router.name, servers, backend.capacity_blocks, len(prepared), speed)
    router.start(_context(router, backend, servers, speed, timing, prepared, seed, queues))
    start = time.perf_counter()
    every = max(1, len(prepared) // 200)
    try:
        for i, p in enumerate(prepared):
            _step(p, router, backend, queues, timing, res)
            if progress is not None and (i + 1) % every == 0 and i + 1 < len(prepared):
                progress(i + 1, len(prepared))
    except KeyboardInterrupt:
        res.interrupted = True
    res.work = list(queues.work)
    res.wall_s = time.perf_counter() - start
    stats = getattr(router, "stats", None)
    if isinstance(stats, dict):
        res.notes.update({f"routed_{k}": v for k, v in stats.items()})
    if progress is not None:
        progress(res.done, len(prepared))
    return res

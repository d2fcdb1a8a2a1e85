"""A vLLM engine whose paired CacheWorker hangs or dies keeps serving (issue 40, "a hung paired
worker").

Requirement: an engine whose CacheWorker is SIGSTOPped mid-run keeps serving: every request
completes with exactly the no-connector tokens, and the batch after the stall takes at most
``1.5 x`` the no-connector time plus the routing budget (the connector's ``lookup_budget_ms``,
250 ms by default); same for a killed worker.

The probe of the issue, per test: an engine with the connector (kv_both, paired with worker 0 of
a deployment of its own, so that killing a worker breaks no other test) serves 6 prompts, whose
blocks worker 0 then holds; worker 0's process is stopped (SIGSTOP; resumed at the end) or killed
(SIGKILL), and the engine serves those 6 prompts again plus 6 new ones in one ``llm.generate``
call. The ``baseline`` engine (no connector) serves the same batch just before (the median of 3
runs is the no-connector time); its tokens are the reference (greedy; the engines are exact
across each other, see raykv.integrations.vllm.testing). The stop test runs first: the kill test
leaves worker 0 dead.

Where the stall was (issue 40's probe: 120.5 s against 0.3 s): the lookup thread
(actors.vllm.lookups) marked each lookup's Future running while its call to the stopped worker
waited out ``timeout_s`` (10 s), so the scheduler side, giving up on it past its budget, could not
cancel it and blocked on its outcome, 10 s per lookup batch, in vLLM's scheduler loop.

Timing asserts are normally avoided in this suite; this is the issue's acceptance test, so the
bound is the issue's, exactly, and each test prints its figures (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

import ray  # noqa: E402

import raykv  # noqa: E402
from actors.cache.cluster import RayKVCluster  # noqa: E402
from actors.testing import TestingCacheWorker  # noqa: E402
from raykv import CacheConfig, TierConfig  # noqa: E402
from raykv.integrations.vllm import testing  # noqa: E402
from raykv.integrations.vllm.scheduler import LOOKUP_BUDGET_MS  # noqa: E402

from .helpers import TPB, prompt, wait_held, worker  # noqa: E402

# Two engines and four batches (~75 s on 2 cores, most of it starting the engines): deselected by
# default, run by CI with `pytest -m ci_only` (pyproject.toml, .ci/run).
pytestmark = pytest.mark.ci_only

BUDGET_S = LOOKUP_BUDGET_MS / 1e3  # the routing budget of the bound
SLOWDOWN = 1.5  # the bound: SLOWDOWN x the no-connector time + BUDGET_S
PROMPTS = 6  # served before the stall, then again with as many new ones
MAX_TOKENS = 6
HOST_PAGES = 512  # every prompt of both tests fits: nothing is evicted
BASE_RUNS = 3  # the no-connector time is the median of this many runs
STOPS = 3  # stop episodes of the stop test; its connector time is their median


@dataclass(frozen=True)
class Rig:
    """A deployment of two workers (a shared host tier each, no disk tier: a killed worker
    leaves only its /dev/shm files, which the kill test removes) and an engine with the
    connector paired with worker 0."""

    deployment: RayKVCluster
    engine: Any


@pytest.fixture(scope="module")
def rig(ray_address: str, model_dir: str, baseline: Any) -> Iterator[Rig]:
    """The module's :class:`Rig` (``baseline`` first: both engines then start with the same
    thread settings); shut down at the end of the module."""
    from vllm import LLM

    layout = testing.tiny_layout()
    host = TierConfig.host(HOST_PAGES * layout.page_bytes, pin_memory=False, shared=True)
    namespace = f"raykv-stall-{uuid.uuid4().hex[:8]}"
    deployment = raykv.start(
        num_workers=2,
        config=CacheConfig(layout, (host,)),
        namespace=namespace,
        worker_class=TestingCacheWorker,
    )
    saved = testing.pin_engine_threads()
    try:
        kwargs = testing.engine_kwargs(model_dir)
        kwargs["kv_transfer_config"] = testing.connector_config(namespace, ray_address, worker=0)
        llm = LLM(**kwargs)
        try:
            yield Rig(deployment, llm)
        finally:
            testing.shutdown_engine(llm)
    finally:
        testing.restore_env(saved)
        deployment.shutdown()


def _prompts(seed: int) -> list[list[int]]:
    """:data:`PROMPTS` prompts of 100 to 250 tokens (3 to 7 full blocks), seeded."""
    return [prompt(seed + i, 100 + 30 * i) for i in range(PROMPTS)]


def _serve(llm: Any, prompts: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], float]:
    """``prompts`` through ``llm`` in one ``generate`` call (greedy, :data:`MAX_TOKENS` each):
    every request's generated tokens, in order, and the call's wall time in seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    batch = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(batch, sampling, use_tqdm=False)
    took = time.perf_counter() - start
    return [tuple(out.outputs[0].token_ids) for out in outs], took


def _stored_then_reference(
    rig: Rig, baseline: Any, first: list[list[int]], batch: list[list[int]]
) -> tuple[list[tuple[int, ...]], float]:
    """Serve ``first`` on the rig's engine until worker 0 holds every full block of it; serve it
    on ``baseline`` too (warm-up), then ``batch`` there :data:`BASE_RUNS` times: its tokens (the
    same every run) and the median seconds (one run on a shared machine may be quick or slow)."""
    want_first, _ = _serve(baseline, first)
    got_first, _ = _serve(rig.engine, first)
    assert got_first == want_first
    for tokens in first:
        wait_held(rig.deployment, 0, tokens, len(tokens) // TPB, timeout=30)
    runs = [_serve(baseline, batch) for _ in range(BASE_RUNS)]
    assert all(tokens == runs[0][0] for tokens, _ in runs)
    return runs[0][0], statistics.median(took for _, took in runs)


def _pid(deployment: RayKVCluster, index: int) -> int:
    """The process id of worker ``index``."""
    return int(ray.get(worker(deployment, index).health.remote(), timeout=30)["pid"])


def _check(
    what: str, got: list[tuple[int, ...]], want: list[tuple[int, ...]], took: float, base: float
) -> None:
    """Print the figures, then assert the issue's requirement on a batch served ``took`` seconds
    (the no-connector engine: ``base``)."""
    bound = SLOWDOWN * base + BUDGET_S
    print(f"\n{what}: no connector {base:.3f} s, with the connector {took:.3f} s (bound {bound:.3f} s)")
    assert got == want, f"{what}: tokens differ from the no-connector engine's"
    assert took <= bound, f"{what}: the batch took {took:.2f} s, bound {bound:.2f} s"


@pytest.mark.timeout(900)
def test_engine_keeps_serving_while_its_worker_is_stopped(rig: Rig, baseline: Any) -> None:
    """Worker 0 stopped (SIGSTOP) after it stored 6 prompts: those 6 again plus 6 new ones
    generate the no-connector tokens within the issue's bound. Resumed (SIGCONT) afterwards.
    :data:`STOPS` such episodes, each on prompts of its own: the connector's time is their
    median, as the no-connector time is a median (one stopped batch on the 2-core VM took
    0.56-0.73 s against a no-connector median of 0.25 s, in back-to-back runs of the same code)."""
    pid = _pid(rig.deployment, 0)
    figures = []
    for episode in range(STOPS):
        first = _prompts(4000 + 1000 * episode)
        batch = first + _prompts(4100 + 1000 * episode)
        want, base = _stored_then_reference(rig, baseline, first, batch)
        os.kill(pid, signal.SIGSTOP)
        try:
            got, took = _serve(rig.engine, batch)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert got == want, f"stopped worker, episode {episode}: tokens differ from the no-connector engine's"
        assert _pid(rig.deployment, 0) == pid  # it answers again
        print(
            f"\nstopped worker, episode {episode}: no connector {base:.3f} s, with the connector {took:.3f} s"
        )
        figures.append((took, base))
    took = statistics.median(t for t, _ in figures)
    base = statistics.median(b for _, b in figures)
    _check(f"stopped worker, median of {STOPS}", want, want, took, base)


@contextlib.contextmanager
def _removing_shm_of(deployment: RayKVCluster, index: int) -> Iterator[None]:
    """On exit, remove the /dev/shm files of worker ``index``'s shared host tier (a process killed
    with SIGKILL leaves them behind)."""
    stats = ray.get(worker(deployment, index).transfer_stats.remote(), timeout=30)
    path = stats.get("shm_path")
    try:
        yield
    finally:
        for leftover in (path, f"{path}.dir") if path else ():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


@pytest.mark.timeout(900)
def test_engine_keeps_serving_after_its_worker_is_killed(rig: Rig, baseline: Any) -> None:
    """Worker 0 killed (SIGKILL) after it stored 6 prompts: those 6 again plus 6 new ones
    generate the no-connector tokens within the issue's bound. Worker 0 stays dead (the
    deployment does not restart workers): this test runs last in the module."""
    first = _prompts(5000)
    batch = first + _prompts(5100)
    want, base = _stored_then_reference(rig, baseline, first, batch)
    with _removing_shm_of(rig.deployment, 0):
        os.kill(_pid(rig.deployment, 0), signal.SIGKILL)
        got, took = _serve(rig.engine, batch)
    _check("killed worker", got, want, took, base)

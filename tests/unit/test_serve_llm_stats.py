"""A Serve LLM replica's routing stats: the prompt tokens it has in flight and the pull and
prefill times its engine's connector handed the paired worker (``CacheWorker.engine_timing``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from deps import require

require("ray.llm")

from actors.cache.worker import CacheWorker  # noqa: E402
from actors.serve.deployments import ReplicaCache  # noqa: E402
from actors.serve.llm import RaykvLLMServer  # noqa: E402
from raykv.core.keys import ReuseScope  # noqa: E402


class _Cache:
    """The replica state _counting touches (ReplicaCache's, without its deployment); its paired
    worker holds ``held`` leading blocks, and the probe answers once ``release`` is set."""

    prefilling = ReplicaCache.prefilling  # the replica's own load counting
    decoding = ReplicaCache.decoding
    tokens_per_block = 16

    def __init__(self, held: int = 0) -> None:
        self.queued_prefill_tokens = self.running_decodes = 0
        self._held = held
        self.probed: list[tuple[int, Any]] = []
        self.release: asyncio.Event | None = None

    async def held(self, tokens: Any, scope: Any = None) -> int:
        self.probed.append((len(tokens), scope))
        if self.release is not None:
            await self.release.wait()
        return self._held

    def counts(self) -> tuple[int, int]:
        return self.queued_prefill_tokens, self.running_decodes


class _Server(RaykvLLMServer):  # type: ignore[misc]
    """The server class with its replica state handed in (no engine started)."""

    def __init__(self, cache: _Cache) -> None:
        self.cache = cache

    def _cache(self) -> Any:
        return self.cache


def _counted(cache: _Cache, stream: AsyncIterator[Any], prompt: Any) -> list[Any]:
    """What ``_counting`` passes on from ``stream``; then the probe may answer (``release``)."""

    async def drain() -> list[Any]:
        request = prompt if isinstance(prompt, dict) else {"prompt": prompt}  # token ids, or a chat
        out = [item async for item in _Server(cache)._counting(stream, request)]
        if cache.release is not None:
            cache.release.set()
        await asyncio.sleep(0.01)
        return out

    return asyncio.run(drain())


def test_a_replica_counts_a_request_queued_until_its_first_chunk_then_decoding() -> None:
    cache = _Cache()
    whole = SimpleNamespace(kv_transfer_params={"raykv": {"prefilled_tokens": 40, "prefill_us": 8000}})
    items: list[Any] = ["data: {}\n\n", SimpleNamespace(kv_transfer_params=None), whole]
    seen = []

    async def stream() -> AsyncIterator[Any]:
        for item in items:
            await asyncio.sleep(0.001)  # the probe (its worker holds nothing) has answered
            seen.append(cache.counts())
            yield item

    assert _counted(cache, stream(), list(range(48))) == items  # passed through unchanged
    assert seen == [(48, 1), (0, 1), (0, 1)]  # queued until its first streamed chunk, then decoding
    assert cache.counts() == (0, 0)


def test_a_chat_request_counts_its_rendered_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat request's prompt tokens (rendered with the model's tokenizer beside the request)
    count as queued until its first chunk; one the replica cannot render counts as a decode only
    and is served all the same."""
    import actors.serve.llm as serve_llm
    from actors.serve.prompts import RequestTokens
    from raykv.routing.local_tokenizer import build_chat_tokenizer
    from raykv.routing.prompts import PromptRenderer

    renderer = PromptRenderer(build_chat_tokenizer())
    prompts = RequestTokens("local", loader=lambda _: renderer)
    monkeypatch.setattr(serve_llm, "_REPLICA_PROMPTS", prompts)
    messages = [{"role": "system", "content": "w1 w2 w3"}, {"role": "user", "content": "w4 w5"}]
    want = len(renderer.chat(messages))
    for request, queued in (
        ({"messages": messages}, want),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 0),
    ):
        cache, seen = _Cache(), []
        answered = prompts.counters["rendered"] + prompts.counters["unrendered"]

        async def stream(
            cache: _Cache = cache, seen: list[Any] = seen, before: int = answered
        ) -> AsyncIterator[Any]:
            await _until(lambda: prompts.counters["rendered"] + prompts.counters["unrendered"] > before)
            await asyncio.sleep(0.01)
            seen.append(cache.counts())
            yield "data: {}\n\n"

        assert _counted(cache, stream(), request) == ["data: {}\n\n"]
        assert seen == [(queued, 1)] and cache.counts() == (0, 0)
    assert prompts.counters["unrendered_multimodal"] == 1


async def _until(cond: Any) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not met in 2 s")


async def _two_steps(cache: _Cache, prompt: int, seen: list[tuple[int, int]]) -> AsyncIterator[Any]:
    """Two items (not streamed chunks): the counts before the probe answers, then once it has."""
    assert cache.release is not None
    seen.append(cache.counts())
    yield 1
    cache.release.set()
    await _until(lambda: cache.counts()[0] != prompt)
    seen.append(cache.counts())
    yield 2


@pytest.mark.parametrize(("prompt", "after"), [(50, 18), (32, 1)])
def test_the_blocks_the_paired_worker_holds_leave_the_queued_count(prompt: int, after: int) -> None:
    """A 50-token prompt whose first 2 blocks (32 tokens) the paired worker holds counts 50
    queued tokens until the probe answers, then 18 (the engine loads the rest); a prompt it holds
    whole keeps its last token queued."""
    cache, seen = _Cache(held=2), []
    cache.release = asyncio.Event()
    assert _counted(cache, _two_steps(cache, prompt, seen), list(range(prompt))) == [1, 2]
    assert seen == [(prompt, 1), (after, 1)] and cache.probed == [(prompt, ReuseScope())]
    assert cache.counts() == (0, 0)


def test_a_probe_answering_after_the_request_changes_nothing() -> None:
    cache = _Cache(held=2)
    cache.release = asyncio.Event()

    async def one() -> AsyncIterator[Any]:
        yield "only"

    assert _counted(cache, one(), list(range(50))) == ["only"]  # released after the request
    assert cache.counts() == (0, 0)


class _DeadWorker:
    """A paired worker whose every probe fails."""

    class probe:  # an actor method's shape: probe.remote(...)
        @staticmethod
        def remote(*_: Any) -> Any:
            raise RuntimeError("actor died")


def test_failed_probes_count_and_warn_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """Every request probes its paired worker: with the worker gone, each probe answers 0 held
    blocks and counts an error, and the log gets one warning a minute, not one per request."""
    import collections

    from raykv.core.warn_every import WarnEvery

    cache = ReplicaCache.__new__(ReplicaCache)  # the replica's state without a deployment
    cache.worker, cache.worker_id, cache.timeout_s = _DeadWorker(), "raykv-worker-0", 1.0
    cache.counters, cache.probe_warnings = collections.Counter(), WarnEvery(60.0)
    with caplog.at_level("WARNING", logger="actors.serve.deployments"):
        assert [asyncio.run(cache.held([1, 2, 3])) for _ in range(5)] == [0] * 5
    assert cache.counters["probe_errors"] == 5
    assert [r.getMessage() for r in caplog.records] == [
        "raykv probe of raykv-worker-0 failed (1 in all, one warning a minute): actor died"
    ]
    cache.probe_warnings.at -= 60.0  # a minute later
    with caplog.at_level("WARNING", logger="actors.serve.deployments"):
        asyncio.run(cache.held([1]))
    assert "(6 in all" in caplog.records[-1].getMessage()


class _TimingWorker:
    """A paired worker (the real CacheWorker's timing methods, called as an actor's are), or one
    whose every call fails when ``dead``."""

    def __init__(self, state: CacheWorker, dead: bool = False) -> None:
        self.state = state
        self.dead = dead
        outer = self

        class engine_timing:  # an actor method's shape: engine_timing.remote(...)
            @staticmethod
            def remote(engine: str) -> Any:
                if outer.dead:
                    raise RuntimeError("actor died")
                return _done(outer.state.engine_timing(engine))

        self.engine_timing = engine_timing


def _done(value: Any) -> Any:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


@pytest.fixture
def worker() -> Iterator[CacheWorker]:
    from actors.replay.backends import replay_config

    state = CacheWorker("raykv-worker-0", 0, replay_config(4))
    yield state
    state.shutdown()


def test_a_replica_reads_its_engines_timing_from_the_worker_and_keeps_it_on_failure(
    worker: CacheWorker,
) -> None:
    """The totals the replica reports are those its own engine (by name) last handed the paired
    worker, streamed requests included; a failed read keeps the last ones and counts an error."""
    import collections

    from raykv.core.warn_every import WarnEvery

    worker.note_engine_timing("replica-a", [64, 3000, 40, 8000])
    worker.note_engine_timing("replica-b", [1, 1, 1, 1])  # another engine
    handle = _TimingWorker(worker)
    cache = ReplicaCache.__new__(ReplicaCache)  # the replica's state without a deployment
    cache.worker, cache.worker_id, cache.timeout_s, cache.engine = handle, "raykv-worker-0", 1.0, "replica-a"
    cache.timing, cache.counters, cache.timing_warnings = [0, 0, 0, 0], collections.Counter(), WarnEvery(60.0)
    assert asyncio.run(cache.refresh_timing()) == [64, 3000, 40, 8000]
    worker.note_engine_timing("replica-a", [64, 3000, 90, 9000])
    assert asyncio.run(cache.refresh_timing()) == [64, 3000, 90, 9000] == cache.timing
    handle.dead = True
    assert asyncio.run(cache.refresh_timing()) == [64, 3000, 90, 9000]
    assert cache.counters["timing_errors"] == 1


def test_a_worker_keeps_each_engines_last_totals_and_rejects_bad_ones(worker: CacheWorker) -> None:
    from actors.cache.worker import MAX_ENGINES
    from raykv.core.errors import InvalidArgumentError

    worker.note_engine_timing("e1", [10, 20, 30, 40])
    worker.note_engine_timing("e2", [1, 2, 3, 4])
    worker.note_engine_timing("e1", [11, 21, 31, 41])  # replaces, not adds
    assert worker.engine_timing("e1") == [11, 21, 31, 41]
    assert worker.engine_timing() == [12, 23, 34, 45]  # every engine's
    assert worker.engine_timing("nobody") == [0, 0, 0, 0]
    bad = [("e1", [1, 2, 3]), ("e1", [1, 2, 3, -4]), ("e1", [1, 2, 3, 4.5]), ("", [1, 2, 3, 4])]
    for engine, totals in bad:
        with pytest.raises(InvalidArgumentError):
            worker.note_engine_timing(engine, totals)
    assert worker.engine_timing() == [12, 23, 34, 45]  # unchanged
    for i in range(MAX_ENGINES + 5):
        worker.note_engine_timing(f"x{i}", [1, 0, 0, 0])
    assert worker.engine_timing() == [MAX_ENGINES, 0, 0, 0]  # the oldest were forgotten


def test_status_shows_the_engines_microseconds_per_token(worker: CacheWorker) -> None:
    from actors.cli.ops import format_status

    row = {**worker.status(), "health": "ok"}
    assert row["engine_timing"] == [0, 0, 0, 0]
    worker.note_engine_timing("e1", [512, 2_700, 1000, 41_000])
    worker.note_engine_timing("e2", [0, 0, 1000, 43_000])
    fresh = {**worker.status(), "health": "ok"}
    text = format_status({"namespace": "ns", "workers": [row, fresh], "shards": []})
    header, before, after = text.splitlines()[1:4]
    assert "engine us/token pull, prefill" in header
    assert before.split()[-4:] == ["-,", "-", "0,", "0/0"]
    assert after.split()[-4:] == ["5.3,", "42.0", "0,", "0/0"]


def test_status_shows_the_engines_store_inboxes(worker: CacheWorker) -> None:
    from actors.cli.ops import format_status

    page = worker.manager.config.layout.page_bytes
    worker.open_inboxes("e1", 2, 4 * page)
    worker.open_inboxes("e2", 1, 3 * page)
    status = worker.status()
    assert status["inboxes"]["engines"]["e1"] == {"inboxes": 2, "slots": 8, "held": 0}
    text = format_status({"namespace": "ns", "workers": [{**status, "health": "ok"}], "shards": []})
    header, row = text.splitlines()[1:3]
    assert header.endswith("engines, inbox held/slots") and row.endswith("2, 0/11")
    worker.unbind_engine("e1")
    assert set(worker.status()["inboxes"]["engines"]) == {"e2"}

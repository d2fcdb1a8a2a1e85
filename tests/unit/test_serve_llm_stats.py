"""A Serve LLM replica's routing stats: the prompt tokens it has in flight and the pull and
prefill times its engine reported in the responses (``kv_transfer_params["raykv"]``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.llm")

from actors.serve_kv import EngineTiming, ReplicaCache
from actors.serve_llm import RaykvLLMServer


def test_engine_timing_adds_up_pairs_of_positive_whole_figures() -> None:
    timing = EngineTiming()
    timing.observe({"pulled_tokens": 64, "fetch_us": 3000, "prefilled_tokens": 40, "prefill_us": 8000})
    timing.observe({"prefilled_tokens": 10, "prefill_us": 1000, "fetch_us": 500})  # no pull
    timing.observe({"pulled_tokens": 16, "fetch_us": -1, "prefilled_tokens": 2.5, "prefill_us": 9})
    timing.observe({"pulled_tokens": True, "fetch_us": 7})  # a bool is no count
    assert timing.totals() == [64, 3000, 50, 9000]


class _Cache:
    """The replica state _counting touches (ReplicaCache's, without its deployment)."""

    def __init__(self) -> None:
        self.timing = EngineTiming()
        self.queued_prefill_tokens = self.running_decodes = 0
        self.seen: list[tuple[int, int]] = []

    prefilling = ReplicaCache.prefilling  # the replica's own load counting
    decoding = ReplicaCache.decoding


class _Server(RaykvLLMServer):  # type: ignore[misc]
    """The server class with its replica state handed in (no engine started)."""

    def __init__(self, cache: _Cache) -> None:
        self.cache = cache

    def _cache(self) -> Any:
        return self.cache


def test_a_replica_adds_up_the_timing_its_responses_carry() -> None:
    cache = _Cache()
    server = _Server(cache)
    whole = SimpleNamespace(kv_transfer_params={"raykv": {"prefilled_tokens": 40, "prefill_us": 8000}})
    items: list[Any] = ["data: {}\n\n", SimpleNamespace(kv_transfer_params=None), whole]

    async def stream() -> AsyncIterator[Any]:
        for item in items:
            cache.seen.append((cache.queued_prefill_tokens, cache.running_decodes))
            yield item

    async def drain() -> list[Any]:
        return [item async for item in server._counting(stream(), 48)]

    assert asyncio.run(drain()) == items  # passed through unchanged
    assert cache.seen == [(48, 1)] * 3  # counted in flight while it ran
    assert cache.timing.totals() == [0, 0, 40, 8000]
    assert (cache.queued_prefill_tokens, cache.running_decodes) == (0, 0)

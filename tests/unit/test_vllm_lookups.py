"""The vLLM connector's lookup thread (actors.vllm.lookups) with a paired worker that hangs.

A query's Future must stay cancellable while its batch waits on the worker: the scheduler side
cancels a lookup past its budget and reads its outcome at once. When the thread marked the
Future running for the whole call, ``cancel()`` failed and the scheduler's read blocked until the
call timed out (issue 40: a SIGSTOPped CacheWorker stalled its engine ``timeout_s`` per batch).
The real-engine check is tests/vllm_connector/test_vllm_stall.py.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError

import pytest

from actors.vllm.lookups import LookupThread, Query
from raykv.integrations.vllm.link import Match


class HungWorker:
    """``held_many`` that blocks until :meth:`release` (a stopped worker), then answers
    ``blocks`` for every chain; counts its calls."""

    def __init__(self, blocks: int = 2) -> None:
        self.blocks = blocks
        self.calls = 0
        self.entered = threading.Event()
        self._released = threading.Event()

    def held_many(self, chains: list[list[bytes]]) -> list[int]:
        self.calls += 1
        self.entered.set()
        self._released.wait(10)
        return [self.blocks] * len(chains)

    def release(self) -> None:
        self._released.set()


def _answer(queries: Sequence[Query], held: list[int]) -> list[Match]:
    return [Match(n) for n in held]


@pytest.fixture
def hung() -> Iterator[tuple[HungWorker, LookupThread, collections.Counter[str]]]:
    """A lookup thread over a :class:`HungWorker` (released and closed at the end)."""
    worker, counts = HungWorker(), collections.Counter[str]()
    thread = LookupThread(worker.held_many, _answer, lambda name: counts.update([name]))
    yield worker, thread, counts
    worker.release()
    thread.close()


def _query() -> Query:
    return Query([b"k" * 32, b"l" * 32], {})


def test_a_query_waiting_on_a_hung_worker_is_cancelled_at_once(
    hung: tuple[HungWorker, LookupThread, collections.Counter[str]],
) -> None:
    """Cancelling a query whose batch waits on the worker succeeds, and reading its outcome then
    returns at once (what the scheduler side does past its lookup budget)."""
    worker, thread, _ = hung
    waiting = thread.submit(_query())
    assert worker.entered.wait(5)
    start = time.monotonic()
    assert waiting.cancel() and waiting.cancelled()
    with pytest.raises(CancelledError):
        waiting.exception()
    assert time.monotonic() - start < 0.1


def test_answers_reach_the_queries_not_cancelled_and_the_thread_goes_on(
    hung: tuple[HungWorker, LookupThread, collections.Counter[str]],
) -> None:
    """A query cancelled during its call gets no answer (the thread does not fail on it), one
    cancelled while queued is never sent, the others get their Match in later batches."""
    worker, thread, counts = hung
    first = thread.submit(_query())
    assert worker.entered.wait(5)
    assert first.cancel()
    queued, dropped = thread.submit(_query()), thread.submit(_query())
    assert dropped.cancel()
    worker.release()
    assert queued.result(timeout=5) == Match(2)
    assert thread.submit(_query()).result(timeout=5) == Match(2)
    assert first.cancelled() and dropped.cancelled()
    assert worker.calls == 3 and counts["lookup_batches"] == 3

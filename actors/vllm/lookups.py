"""The vLLM connector's lookups, answered off the scheduler thread (see actors.vllm.link).

vLLM's scheduler loop serves every running request of its engine, so a lookup must not wait
there for another process. :class:`LookupThread` takes each lookup as a :class:`Query`, returns a
Future at once, and answers queries on one background thread, in batches: everything queued
when the thread wakes goes to the paired CacheWorker in one actor call
(``CacheWorker.held_many``: the leading blocks it holds of each key chain, every tensor-parallel
rank's chain included), then, for the queries the paired worker does not hold whole, no
producer's hint names a worker for and no router's match came with (the hint's ``route``,
:mod:`raykv.integrations.vllm.route`), to the index (one call per shard for the batch). A
query whose Future was cancelled before its batch left is skipped. A batch that fails answers
``Match(0)`` for each of its queries (counted as ``lookup_errors``); nothing raises into the
scheduler.

A query's Future stays pending (cancellable) while its batch waits on the worker or the index:
it is marked running only at the moment its answer is set. The scheduler gives up on an answer
later than its budget by cancelling the Future, and must not then wait for a call that may hang
for ``timeout_s`` (a stopped worker): a Future marked running for the whole call could not be
cancelled, and reading its outcome blocked the scheduler until the call timed out.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raykv.integrations.vllm.link import Match
from raykv.integrations.vllm.route import FIELD as ROUTE_FIELD
from raykv.integrations.vllm.route import Route

log = logging.getLogger(__name__)

MAX_BATCH = 256
"""Most queries one batch carries."""


@dataclass
class Query:
    """One lookup: ``keys`` (the prompt's usable blocks) and, on a tensor-parallel engine,
    ``others`` (the other ranks' chains of those blocks), whose leading held blocks the paired
    worker counts; ``hint`` (the request's ``kv_transfer_params["raykv"]``: a producer's worker
    and blocks, the router's match) and the Future its Match goes to."""

    keys: Sequence[bytes]
    hint: Mapping[str, Any]
    others: Callable[[], list[list[bytes]]] | None = None
    """The other tensor-parallel ranks' chains, computed on the lookup thread."""
    future: Future[Match] = field(default_factory=Future)
    chains: list[list[bytes]] = field(default_factory=list)

    def route(self) -> Route | None:
        """The router's match the hint carries (:class:`~raykv.integrations.vllm.route.Route`),
        None when it carries none; ValueError when the field is malformed."""
        raw = self.hint.get(ROUTE_FIELD)
        return None if raw is None else Route.parse(raw)

    def chain_all(self) -> list[list[bytes]]:
        """Every rank's chain (rank 0's first), computed once."""
        if not self.chains:
            self.chains = [list(self.keys), *(self.others() if self.others is not None else [])]
        return self.chains


class LookupThread:
    """Answers :class:`Query` objects on a daemon thread (module docstring).

    ``held_many(chains)``: the paired worker's answer for a batch's chains (blocking, bounded);
    ``answer(queries, held)``: the Matches of queries whose chains' least held counts are
    ``held`` (may ask the index, once for the batch; blocking, bounded); ``count(name)``: counts
    an event.
    """

    def __init__(
        self,
        held_many: Callable[[list[list[bytes]]], list[int]],
        answer: Callable[[Sequence[Query], list[int]], list[Match]],
        count: Callable[[str], None],
    ) -> None:
        self._held_many = held_many
        self._answer = answer
        self._count = count
        self._queue: queue.SimpleQueue[Query | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="raykv-lookups")
        self._thread.start()

    def submit(self, query: Query) -> Future[Match]:
        """Queue ``query``; its Future resolves to the Match (never to an exception)."""
        self._queue.put(query)
        return query.future

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread (queries still queued are cancelled)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            self._run([q for q in batch if not q.future.cancelled()])
            if stop:
                self._drain()
                return

    def _run(self, batch: Sequence[Query]) -> None:
        """Answer ``batch`` (its futures pending; one cancelled meanwhile is not answered): one
        call for what the paired worker holds, then each query's Match."""
        if not batch:
            return
        self._count("lookup_batches")
        try:
            chains = [chain for q in batch for chain in q.chain_all()]
            held = self._held_many(chains)
        except Exception as exc:
            log.warning("raykv lookup of %d requests failed: %s", len(batch), exc)
            for q in batch:
                self._count("lookup_errors")
                _resolve(q, Match(0))
            return
        least, at = [], 0
        for q in batch:
            least.append(min(held[at : at + len(q.chains)]))
            at += len(q.chains)
        try:
            matches = self._answer(batch, least)
        except Exception as exc:  # the index failed: what the paired worker holds still loads
            self._count("lookup_errors")
            log.warning("raykv index lookup of %d requests failed: %s", len(batch), exc)
            matches = [Match(n) for n in least]
        for q, match in zip(batch, matches):
            _resolve(q, match)

    def _drain(self) -> None:
        while True:
            try:
                q = self._queue.get_nowait()
            except queue.Empty:
                return
            if q is not None:
                q.future.cancel()


def _resolve(query: Query, match: Match) -> None:
    """Set ``match`` as ``query``'s answer unless its Future was cancelled (then nothing).
    Marking the Future running and setting its result happen back to back (nothing blocks in
    between), so a scheduler that cancels it either succeeds or finds it answered at once."""
    if query.future.set_running_or_notify_cancel():
        query.future.set_result(match)

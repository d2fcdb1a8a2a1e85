"""The HTTP client of ``raykv bench serve``: plays a :class:`~raykv.bench.serve_workload.Workload`
against an OpenAI-compatible endpoint with the ``openai`` package's ``AsyncOpenAI``.

Each request is sent at its planned time, but never before the session's previous turn has
completed (its reply is part of the next request's messages): a turn that waits is late, and the
lateness (``sent_s - planned_s``) shows a server that cannot keep up. Every request streams
(``stream=True``, ``stream_options={"include_usage": True}``), greedy, with ``max_tokens`` of
the workload. Per request: time to first content (TTFT), inter-token latency (first to last
content over the output tokens between: Ray Serve LLM batches streamed chunks), completion
time, and the usage the engine reports (prompt tokens and
``prompt_tokens_details.cached_tokens``: prompt tokens the engine did not compute, its prefix
cache and connector loads together). A failed request keeps its error and gives its session an
empty reply. No Ray here; ``openai`` is imported when a phase runs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raykv.bench.serve_workload import Request, Workload, conversations


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds from the phase's start (``perf_counter``)."""

    index: int
    session: int
    turn: int
    planned_s: float
    sent_s: float = 0.0
    first_s: float | None = None  # first content chunk
    last_s: float | None = None  # last content chunk
    end_s: float | None = None
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage: bool = False  # the stream ended with a usage chunk
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def itl_s(self) -> float | None:
        """Seconds per output token after the first: first to last content over the tokens
        between (Ray Serve LLM batches streamed chunks, so gaps between chunks are not tokens)."""
        if self.first_s is None or self.last_s is None or self.completion_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.completion_tokens - 1)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None


def _drop_info(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def _quiet_httpx() -> None:
    """No log line per request from httpx (``AsyncOpenAI``'s transport); a filter too, since
    logging set up later (Ray's, vLLM's) may set the logger's level back."""
    httpx_log = logging.getLogger("httpx")
    httpx_log.setLevel(logging.WARNING)
    if _drop_info not in httpx_log.filters:
        httpx_log.addFilter(_drop_info)


async def run_phase(
    base_url: str,
    model: str,
    workload: Workload,
    on_done: Callable[[RequestRecord], None] | None = None,
    timeout_s: float = 120.0,
    extra_body: dict[str, Any] | None = None,
) -> list[RequestRecord]:
    """Play ``workload`` against ``model`` at ``base_url`` (``http://host:port``); the records in
    request order."""
    from openai import AsyncOpenAI

    _quiet_httpx()
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="raykv-bench", max_retries=0, timeout=timeout_s)
    talks = conversations(workload)
    done: dict[tuple[int, int], asyncio.Event] = {
        (r.session, r.turn): asyncio.Event() for r in workload.requests
    }
    records = [RequestRecord(r.index, r.session, r.turn, r.at_s) for r in workload.requests]
    start = time.perf_counter()

    async def one(request: Request, record: RequestRecord) -> None:
        try:
            delay = start + request.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if request.turn:
                await done[request.session, request.turn - 1].wait()
            talk = talks[request.session]
            messages = talk.ask(request.user)
            record.sent_s = time.perf_counter() - start
            reply = await _stream(
                client, model, messages, workload.config.max_tokens, record, start, extra_body
            )
            talk.answer(reply)
        except Exception as exc:  # a failed request is a result, not a crash of the bench
            record.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            talks[request.session].answer("")
        finally:
            done[request.session, request.turn].set()
            if on_done is not None:
                on_done(record)

    try:
        await asyncio.gather(*(one(r, rec) for r, rec in zip(workload.requests, records)))
    finally:
        await client.close()
    return records


async def _stream(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    record: RequestRecord,
    start: float,
    extra_body: dict[str, Any] | None,
) -> str:
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra_body or None,
    )
    text: list[str] = []
    async for chunk in stream:
        now = time.perf_counter() - start
        for choice in chunk.choices or ():
            content = getattr(choice.delta, "content", None)
            if content:
                if record.first_s is None:
                    record.first_s = now
                record.last_s = now
                record.chunks += 1
                text.append(content)
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            record.usage = True
            record.prompt_tokens = int(usage.prompt_tokens or 0)
            record.completion_tokens = int(usage.completion_tokens or 0)
            details = getattr(usage, "prompt_tokens_details", None)
            record.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0)
    record.end_s = time.perf_counter() - start
    if record.first_s is None:  # no content at all (only special tokens were generated)
        record.first_s = record.end_s
    return "".join(text).strip()


class Progress:
    """tqdm over every phase's requests on stderr when installed, else a line every 5 s."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.bar, self.last, self.done = enabled, None, 0.0, 0
        self.phase, self.errors = "", 0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", desc="bench serve", file=sys.stderr)
            except ImportError:
                pass

    def note(self, text: str) -> None:
        self.phase = text
        self._draw(force=True)

    def request(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += record.error is not None
        if self.bar is not None:
            self.bar.update(1)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        status = f"{self.phase} errors={self.errors}"
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=True)
        elif force or time.monotonic() - self.last >= 5.0:
            self.last = time.monotonic()
            print(f"bench serve: {self.done} requests, {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

"""Token ids for Serve requests that carry none: OpenAI chat messages and text prompts.

:class:`RequestTokens` renders such a request with the deployment's own tokenizer
(:class:`raykv.routing.prompts.PromptRenderer`: the chat template applied as vLLM applies it,
prefix reuse across a conversation's turns) on a small thread pool, never on the caller's event
loop, within ``budget_s``. The tokenizer loads in the background from the model's path (the
``LLMConfig``'s ``model_source``, or a ``tokenizer_source``) as soon as the object is built;
requests that arrive before it is loaded wait for it within their budget.

A request it cannot render (non-text content, a template error, a tokenizer that failed to load,
a render past its budget) gives None and is counted: the caller routes it by load and never
fails it. ``counters``: ``rendered``, ``render_us_total`` (time from asking to the ids, queueing
on the pool included), ``unrendered`` (with ``unrendered_<reason>``), ``render_timeouts``,
``render_errors``; ``renderer_stats()``: the renderer's own (characters reused and tokenized).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raykv.routing.prompts import PromptRenderer, Unrenderable

log = logging.getLogger(__name__)

RENDER_BUDGET_S = 0.25
"""Default time a request may wait for its token ids (tokenizer loading included)."""


def renderable(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The request among ``kwargs`` values and ``args`` that carries chat ``messages`` or a text
    ``prompt`` (an OpenAI request object or a mapping); None when there is none."""
    for source in (*kwargs.values(), *args):
        for name in ("messages", "prompt"):
            value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
            if name == "messages" and isinstance(value, list):
                return source
            if name == "prompt" and (isinstance(value, str) or _text_batch(value)):
                return source
    return None


def prompt_ids(prompt: Any) -> list[int] | None:
    """An OpenAI completion ``prompt`` as token ids: a list of ints, or a batch of exactly one
    such list; None for text or larger batches."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def _text_batch(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


class RequestTokens:
    """Renders requests to token ids for one model (module docstring). ``source``: where the
    tokenizer loads from (None: nothing is rendered); ``loader``: builds the renderer from it;
    ``counters``: where the counts go (a router's decision counters; default a new Counter);
    ``eager``: load the tokenizer now (else on the first request); ``metrics``: a
    :class:`actors.cache.metrics.RouterMetrics` the outcomes also go to (Prometheus)."""

    def __init__(
        self,
        source: str | None,
        budget_s: float = RENDER_BUDGET_S,
        threads: int = 2,
        loader: Callable[[str], PromptRenderer] = PromptRenderer.from_pretrained,
        counters: collections.Counter[str] | None = None,
        eager: bool = True,
        metrics: Any = None,
    ) -> None:
        self.source = source
        self.budget_s = budget_s
        self.counters: collections.Counter[str] = collections.Counter() if counters is None else counters
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="raykv-render")
        self._loader = loader
        self.metrics = metrics  # RouterMetrics (its rendered()), or None
        self._renderer = self._pool.submit(loader, source) if source and eager else None
        self._warned = False

    async def tokens(self, request: Any) -> list[int] | None:
        """``request``'s prompt token ids, as its engine will see them; None (counted) when it
        cannot be rendered in time. Never raises but for cancellation."""
        if self.source is None:
            return None
        if self._renderer is None:  # not eager: the first request loads the tokenizer
            self._renderer = self._pool.submit(self._loader, self.source)
        start = time.perf_counter()
        try:
            job = asyncio.wrap_future(self._pool.submit(self._render, request))
            ids = await asyncio.wait_for(job, self.budget_s)
        except asyncio.TimeoutError:
            self._count("render_timeouts")
            return None
        except Unrenderable as exc:
            self._count("unrendered")
            self.counters[f"unrendered_{str(exc).split(':', 1)[0]}"] += 1
            return None
        except Exception as exc:
            self._count("render_errors")
            if not self._warned:
                self._warned = True
                log.warning("raykv: cannot render requests with %s's tokenizer: %s", self.source, exc)
            return None
        seconds = time.perf_counter() - start
        self._count("rendered", seconds)
        self.counters["render_us_total"] += int(seconds * 1e6)
        return ids

    def _count(self, outcome: str, seconds: float | None = None) -> None:
        self.counters[outcome] += 1
        if self.metrics is not None:
            self.metrics.rendered(outcome, seconds)

    def _render(self, request: Any) -> list[int]:
        assert self._renderer is not None
        return self._renderer.result().request(request)

    def renderer_stats(self) -> dict[str, int]:
        """The renderer's counters (``rendered``, ``reused_chars``, ``tokenized_chars``,
        ``render_us``); empty until the tokenizer has loaded."""
        if self._renderer is None or not self._renderer.done() or self._renderer.exception():
            return {}
        return dict(self._renderer.result().stats)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_source(llm_config: Any) -> str | None:
    """Where an ``LLMConfig``'s engine loads its tokenizer from: ``tokenizer_source`` when set,
    else ``model_source`` (a path or hub name); None when neither is a str."""
    loading = getattr(llm_config, "model_loading_config", None)
    for name in ("tokenizer_source", "model_source"):
        value = getattr(loading, name, None)
        if isinstance(value, str) and value:
            return value
    return None

"""Workload families for ``raykv replay --workload NAME`` (pure; no ray).

Each family is a seeded generator of :class:`~raykv.replay.trace.Request` lists in the Mooncake
conventions (512-token blocks, an id names its whole prefix; :mod:`raykv.replay.blocks`). Sizes
below are drawn uniformly from the ranges, all from one ``random.Random(seed)``, so a family,
size and seed always give the same requests. Every tenant has its own cache salt, so raykv never
shares KV across tenants. Sessions start as a Poisson process; absolute times hardly matter (the
timing model calibrates the servers' speed to the trace's span), the *shape* of arrivals does.

chat
    Multi-turn chat: tenants with their own system prompts (1-4 blocks); sessions of 2-10 turns
    that re-send the whole history plus a new user message, the answer joining the history;
    turns a think time apart (exponential, mean 30 s).
agentic
    Multi-tenant agents: per-tenant system prompts of 2-12 blocks; each task starts with a user
    request and runs 3-12 steps whose context grows turn by turn (the model's output and a tool
    result join it). A step is a tool loop (one request) or, with probability 0.4, a tool-call
    fan-out of 2-8 parallel requests that share the whole context plus a short distinct
    instruction and arrive within 20 ms; the next step then sees every branch's answer. Steps
    are 0.5-4 s apart (tool latency).
rag
    Retrieval: a few long shared documents (8 documents of 6-24k tokens, Zipf popularity) behind
    one system prompt per tenant, and many short questions (20-200 tokens) on one document (a
    quarter of them followed by a retrieved passage of 2-8k tokens: the document is then the shared
    prefix).
long_context
    Long context: each session brings its own document of 16-96k tokens behind a short system
    prompt and asks 1-4 questions about it, a think time apart (mean 60 s); little is shared
    across sessions, a lot within one.
chat_text
    ``chat``'s sessions (the same for a seed) carried as OpenAI chat ``messages``, as a Serve
    router receives them, with the ids the engine prefills: the routers render them with the
    model's chat template (:mod:`raykv.replay.chat_text`); 2% of user turns attach an image,
    which no router can render.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import ReuseScope
from raykv.core.overrides import replace_fields
from raykv.replay.blocks import BlockIds, Doc, Range, draw
from raykv.replay.chat_text import chat_text
from raykv.replay.trace import BLOCK_TOKENS, Request


@dataclass(frozen=True)
class AgenticShape:
    """The ``agentic`` family's shape (the defaults are the family; ``raykv replay --workload
    agentic --shape tenants=12,fanout_p=0.6`` draws another): ``tenants`` with system prompts of
    ``prompt_blocks`` blocks; tasks starting at ``task_rate`` per second with a first request of
    ``first_tokens``, then ``steps`` steps ``step_gap_s`` apart, each a tool-call fan-out with
    probability ``fanout_p`` (``fanout`` branches arriving within ``spread_s``) or a tool loop
    whose result adds ``tool_tokens``. Ranges are inclusive ``(low, high)``."""

    tenants: int = 6
    prompt_blocks: Range = (2, 12)
    task_rate: float = 0.5
    first_tokens: Range = (100, 1500)
    steps: Range = (3, 12)
    step_gap_s: tuple[float, float] = (0.5, 4.0)
    fanout_p: float = 0.4
    fanout: Range = (2, 8)
    spread_s: float = 0.02
    tool_tokens: Range = (100, 2000)

    def __post_init__(self) -> None:
        if self.tenants < 1:
            raise InvalidArgumentError("tenants", f"must be >= 1, got {self.tenants}")
        for name in ("prompt_blocks", "first_tokens", "steps", "fanout", "tool_tokens"):
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise InvalidArgumentError(name, f"range must be ints with 1 <= low <= high, got {(lo, hi)}")
        lo_s, hi_s = self.step_gap_s
        if not 0 <= lo_s <= hi_s:
            raise InvalidArgumentError(
                "step_gap_s", f"range must satisfy 0 <= low <= high, got {(lo_s, hi_s)}"
            )
        if not 0.0 <= self.fanout_p <= 1.0:
            raise InvalidArgumentError("fanout_p", f"must be in [0, 1], got {self.fanout_p}")
        if not (self.task_rate > 0 and self.spread_s >= 0):
            raise InvalidArgumentError("task_rate", "task_rate must be > 0 and spread_s >= 0")

    @classmethod
    def parse(cls, text: str) -> AgenticShape:
        """The default shape with the fields ``text`` names replaced (``name=value`` pairs,
        comma-separated; a range as ``low:high``; :func:`raykv.core.overrides.replace_fields`).
        InvalidArgumentError for an unknown field, a value of the wrong kind or one the shape
        rejects."""
        return replace_fields(cls(), text, "shape")


@dataclass(frozen=True)
class FamilySpec:
    """Name, size and seed of a generated workload (see the module docstring), and for
    ``agentic`` its shape (None: the family's)."""

    name: str = "agentic"
    requests: int = 3000
    seed: int = 0
    shape: AgenticShape | None = None

    def __post_init__(self) -> None:
        if self.name not in FAMILIES:
            raise InvalidArgumentError(
                "workload", f"unknown workload {self.name!r}; known: {', '.join(FAMILIES)}"
            )
        if self.requests < 1:
            raise InvalidArgumentError("requests", f"must be >= 1, got {self.requests}")
        if self.shape is not None and self.name != "agentic":
            raise InvalidArgumentError("shape", f"only the agentic family takes a shape, not {self.name!r}")


class _Out:
    """The requests generated so far, a seeded RNG, fresh ids and tenant salts."""

    def __init__(self, seed: int, tenants: int) -> None:
        self.rng = random.Random(seed)
        self.ids = BlockIds()
        self.salts = [ReuseScope.from_cache_salt(f"tenant-{i}").salt for i in range(tenants)]
        self.reqs: list[Request] = []
        self.session = 0

    def add(self, at: float, doc: Doc, salt: int | None, output: int) -> None:
        self.reqs.append(Request(at, doc.length, output, doc.hash_ids(self.ids), salt, self.session))

    def prompts(self, blocks: Range) -> list[Doc]:
        """One system prompt per tenant, ``blocks`` full blocks plus a partial one."""
        rng = self.rng
        return [
            Doc([], 0).grown(self.ids, draw(rng, blocks) * BLOCK_TOKENS + rng.randint(0, BLOCK_TOKENS - 1))
            for _ in self.salts
        ]


def _sessions(out: _Out, requests: int, rate: float, one: Callable[[float], None]) -> list[Request]:
    """Start sessions (``one(start)``) as a Poisson process of ``rate`` per second until
    ``requests`` requests exist; returns the first ``requests`` in arrival order."""
    at = 0.0
    while len(out.reqs) < requests:
        one(at)
        out.session += 1
        at += out.rng.expovariate(rate)
    out.reqs.sort(key=lambda r: (r.arrival_s, r.session))
    return out.reqs[:requests]


def chat(requests: int, seed: int) -> list[Request]:
    """The ``chat`` family (module docstring)."""
    out = _Out(seed, tenants=4)
    prompts = out.prompts((1, 4))
    rng = out.rng

    def session(start: float) -> None:
        tenant = rng.randrange(len(out.salts))
        doc, at = prompts[tenant], start
        for _ in range(draw(rng, (2, 10))):
            doc = doc.grown(out.ids, draw(rng, (20, 500)))
            output = draw(rng, (50, 600))
            out.add(at, doc, out.salts[tenant], output)
            doc = doc.grown(out.ids, output)
            at += rng.expovariate(1.0 / 30.0)

    return _sessions(out, requests, 1.0 / 3.0, session)


def agentic(requests: int, seed: int, shape: AgenticShape | None = None) -> list[Request]:
    """The ``agentic`` family (module docstring), of ``shape`` (None: the family's own)."""
    sh = shape or AgenticShape()
    out = _Out(seed, tenants=sh.tenants)
    prompts = out.prompts(sh.prompt_blocks)
    rng = out.rng

    def task(start: float) -> None:
        tenant = rng.randrange(len(out.salts))
        salt = out.salts[tenant]
        doc, at = prompts[tenant].grown(out.ids, draw(rng, sh.first_tokens)), start
        for _ in range(draw(rng, sh.steps)):
            if rng.random() < sh.fanout_p:
                answers = 0
                for _ in range(draw(rng, sh.fanout)):
                    output = draw(rng, (20, 300))
                    answers += output
                    out.add(
                        at + rng.uniform(0.0, sh.spread_s),
                        doc.grown(out.ids, draw(rng, (20, 200))),
                        salt,
                        output,
                    )
                doc = doc.grown(out.ids, answers)
            else:
                output = draw(rng, (20, 400))
                out.add(at, doc, salt, output)
                doc = doc.grown(out.ids, output + draw(rng, sh.tool_tokens))  # the answer, a tool result
            at += rng.uniform(*sh.step_gap_s)

    return _sessions(out, requests, sh.task_rate, task)


def rag(requests: int, seed: int) -> list[Request]:
    """The ``rag`` family (module docstring)."""
    out = _Out(seed, tenants=2)
    rng = out.rng
    prompts = out.prompts((1, 2))
    docs = [[p.grown(out.ids, draw(rng, (6000, 24000))) for _ in range(8)] for p in prompts]
    weights = [1.0 / (i + 1) for i in range(8)]

    def question(start: float) -> None:
        tenant = rng.randrange(len(out.salts))
        first = rng.choices(range(8), weights)[0]
        doc = docs[tenant][first]
        if rng.random() < 0.25:
            doc = doc.grown(out.ids, draw(rng, (2000, 8000)))  # a retrieved passage after it
        out.add(start, doc.grown(out.ids, draw(rng, (20, 200))), out.salts[tenant], draw(rng, (50, 300)))

    return _sessions(out, requests, 4.0, question)


def long_context(requests: int, seed: int) -> list[Request]:
    """The ``long_context`` family (module docstring)."""
    out = _Out(seed, tenants=3)
    rng = out.rng
    prompts = out.prompts((1, 1))

    def session(start: float) -> None:
        tenant = rng.randrange(len(out.salts))
        doc, at = prompts[tenant].grown(out.ids, draw(rng, (16000, 96000))), start
        for _ in range(draw(rng, (1, 4))):
            doc = doc.grown(out.ids, draw(rng, (20, 300)))
            output = draw(rng, (100, 500))
            out.add(at, doc, out.salts[tenant], output)
            doc = doc.grown(out.ids, output)
            at += rng.expovariate(1.0 / 60.0)

    return _sessions(out, requests, 1.0 / 8.0, session)


FAMILIES: dict[str, Callable[[int, int], list[Request]]] = {
    "chat": chat,
    "agentic": agentic,
    "rag": rag,
    "long_context": long_context,
    "chat_text": chat_text,
}
"""Every workload family by name (``raykv replay --workload NAME``)."""

DEFAULT_REQUESTS = {"chat": 4000, "agentic": 6000, "rag": 3000, "long_context": 800, "chat_text": 4000}
"""Each family's size when ``--requests`` is not given (about a minute per 5-router grid)."""


def generate_family(spec: FamilySpec) -> list[Request]:
    """The requests of ``spec``'s family, in arrival order (deterministic for a spec)."""
    if spec.shape is not None:
        return agentic(spec.requests, spec.seed, spec.shape)
    return FAMILIES[spec.name](spec.requests, spec.seed)

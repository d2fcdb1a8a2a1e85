"""The built-in workload: multi-turn chat and agent fan-out, several tenants (pure; no ray).

Generated requests use the Mooncake conventions of :mod:`raykv.replay.trace` (one id per 512-token
block, an id names the block and its whole prefix), so the replay treats them exactly like a trace.

Shape (every size below is drawn uniformly from the spec's range, all from one seeded RNG, so a
spec and seed always give the same requests):

- ``system_prompts`` shared system prompts. Every tenant uses them, but each tenant has its own
  cache salt (``ReuseScope.from_cache_salt("tenant-<i>")``): raykv never shares KV across tenants,
  while a salt-unaware router (Ray's prefix tree sees only text) believes they share the prompt.
- Chat sessions (``chat_share`` of the requests): system prompt, then turns; each turn re-sends the
  whole history plus a new user message, and the model's answer joins the history for the next
  turn. Turns are ``think_s`` (mean, exponential) apart.
- Agent tasks (the rest): a long shared context (system prompt + documents, ``agent_context``
  tokens), then ``fanout`` requests that arrive within one second (same context + a short distinct
  instruction), then one reduce request with the context and every branch's answer.

Session and task starts are spread uniformly over ``requests * interarrival_s`` seconds. Absolute
times hardly matter: the timing model calibrates the servers' speed to the trace's span.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import ReuseScope
from raykv.replay.blocks import BlockIds, Doc, Range, draw
from raykv.replay.trace import Request


@dataclass(frozen=True)
class WorkloadSpec:
    """Size, seed and shape of the built-in workload (see the module docstring)."""

    requests: int = 400
    seed: int = 0
    tenants: int = 3
    system_prompts: int = 2
    chat_share: float = 0.6
    system_tokens: Range = (800, 2500)
    turns: Range = (2, 6)
    user_tokens: Range = (50, 800)
    output_tokens: Range = (20, 400)
    agent_context: Range = (2000, 8000)
    fanout: Range = (3, 8)
    instruction_tokens: Range = (50, 300)
    think_s: float = 20.0
    interarrival_s: float = 0.5

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise InvalidArgumentError("requests", f"must be >= 1, got {self.requests}")
        if self.tenants < 1 or self.system_prompts < 1:
            raise InvalidArgumentError("tenants", "tenants and system_prompts must be >= 1")
        if not 0.0 <= self.chat_share <= 1.0:
            raise InvalidArgumentError("chat_share", f"must be in [0, 1], got {self.chat_share}")
        for name in ("system_tokens", "turns", "user_tokens", "output_tokens", "agent_context", "fanout"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise InvalidArgumentError(name, f"range must satisfy 1 <= lo <= hi, got {(lo, hi)}")
        if self.think_s <= 0 or self.interarrival_s <= 0:
            raise InvalidArgumentError("think_s", "think_s and interarrival_s must be > 0")


class _Gen:
    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.ids = BlockIds()
        self.salts = [ReuseScope.from_cache_salt(f"tenant-{i}").salt for i in range(spec.tenants)]
        self.prompts = [
            Doc([], 0).grown(self.ids, draw(self.rng, spec.system_tokens)) for _ in range(spec.system_prompts)
        ]
        self.out: list[Request] = []
        self.sessions = 0

    def request(self, at: float, doc: Doc, salt: int | None, output: int) -> None:
        self.out.append(Request(at, doc.length, output, doc.hash_ids(self.ids), salt, self.sessions))

    def chat(self, start: float) -> None:
        spec, rng = self.spec, self.rng
        salt = rng.choice(self.salts)
        doc = rng.choice(self.prompts)
        at = start
        for _ in range(draw(rng, spec.turns)):
            doc = doc.grown(self.ids, draw(rng, spec.user_tokens))
            output = draw(rng, spec.output_tokens)
            self.request(at, doc, salt, output)
            doc = doc.grown(self.ids, output)
            at += rng.expovariate(1.0 / spec.think_s)

    def agent(self, start: float) -> None:
        spec, rng = self.spec, self.rng
        salt = rng.choice(self.salts)
        context = rng.choice(self.prompts).grown(self.ids, draw(rng, spec.agent_context))
        answers = 0
        for _ in range(draw(rng, spec.fanout)):
            branch = context.grown(self.ids, draw(rng, spec.instruction_tokens))
            output = draw(rng, spec.output_tokens)
            answers += output
            self.request(start + rng.random(), branch, salt, output)
        reduce = context.grown(self.ids, answers + draw(rng, spec.instruction_tokens))
        self.request(
            start + 1.0 + rng.expovariate(1.0 / spec.think_s), reduce, salt, draw(rng, spec.output_tokens)
        )


def generate(spec: WorkloadSpec | None = None) -> list[Request]:
    """The built-in workload's requests in arrival order (deterministic for a spec and seed)."""
    spec = spec or WorkloadSpec()
    gen = _Gen(spec)
    span = spec.requests * spec.interarrival_s
    while len(gen.out) < spec.requests:
        start = gen.rng.uniform(0.0, span)
        if gen.rng.random() < spec.chat_share:
            gen.chat(start)
        else:
            gen.agent(start)
        gen.sessions += 1
    gen.out.sort(key=lambda r: (r.arrival_s, r.session))
    return gen.out[: spec.requests]

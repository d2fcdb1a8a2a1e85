"""The multi-turn chat workload of ``raykv bench serve`` (pure: no Ray, no engine, no I/O).

A :class:`Workload` is a deterministic function of its :class:`WorkloadConfig` (seed included):

- a few shared **system prompts** (``system_prompts`` of ``system_words`` words each), picked by
  sessions with skewed weights (prompt ``i`` weighs ``1 / (i + 1)``), as a few products or agents
  each bring their own instructions;
- **sessions** of ``turns`` user turns, each turn a user message of ``user_words`` words; every
  turn re-sends the whole conversation: the system prompt, every earlier user message and the
  assistant replies the server gave (read from the responses at run time,
  :class:`Conversation`), so histories grow turn by turn;
- **arrivals**: enough sessions to keep the rate (``rate x`` the mean gap between a session's
  turns) are there at the start; the others arrive through the run as a Poisson process of
  ``0.85 x rate / mean turns`` per second (just under the rate at which sessions end; the slot
  rule below brings the next one early when the talking ones are all thinking), so the number
  talking at once stays about level;
- a **fixed offered rate**: request send times are a Poisson process of ``rate`` per second for
  ``duration_s`` seconds. Each slot goes to the session that has been ready longest (a session
  is ready ``min_think_s`` plus an exponential ``think_s`` seconds after its previous turn was
  sent); when no active session is ready, the next session to arrive comes early; only when none
  is left does the slot wait for the first session to be ready (so a ``sessions`` too small for
  the rate lowers the offered rate, which the workload reports). Sessions still talking at the
  end are cut there. ``sessions = 0`` picks enough of them (:func:`auto_sessions`).

Text is words ``w0`` .. of the locally made chat tokenizer
(:mod:`raykv.routing.local_tokenizer`): one word is one token, so a message of ``n`` words is
``n`` prompt tokens plus the template's role and end tokens.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from raykv.routing.local_tokenizer import FIRST_WORD

TEMPLATE_TOKENS_PER_MESSAGE = 3
"""The chat template's tokens around each message (role tag, end tag; one more for the
generation prompt and the BOS, counted here per message as an upper bound)."""


ARRIVAL_LOAD = 0.85
"""Sessions arrive at this fraction of the rate at which they end (module docstring)."""


@dataclass(frozen=True)
class WorkloadConfig:
    """What the workload is made of (module docstring); every field is part of the seed's
    result."""

    sessions: int = 0  # 0: auto_sessions()
    rate: float = 3.0
    duration_s: float = 60.0
    seed: int = 0
    system_prompts: int = 3
    system_words: int = 320
    turns: tuple[int, int] = (3, 7)
    user_words: tuple[int, int] = (40, 120)
    min_think_s: float = 2.0
    think_s: float = 2.0
    max_tokens: int = 12
    vocab_size: int = 512

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.rate <= 0 or self.duration_s <= 0 or self.system_prompts < 1:
            raise ValueError("rate, duration_s and system_prompts must be positive, sessions >= 0")
        if not (1 <= self.turns[0] <= self.turns[1]) or not (1 <= self.user_words[0] <= self.user_words[1]):
            raise ValueError("turns and user_words must be (low, high) ranges of positive ints")
        if self.vocab_size <= FIRST_WORD + 1:
            raise ValueError(f"vocab_size must exceed {FIRST_WORD + 1}")

    def with_changes(self, **changes: object) -> WorkloadConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Session:
    id: int
    system: int  # index into Workload.system_texts
    turns: int
    arrival_s: float  # when it may send its first turn


@dataclass(frozen=True)
class Request:
    """One turn to send: ``at_s`` seconds after the phase starts (its planned time), the
    ``turn``-th (0-based) of ``session``, whose user message is ``user``."""

    index: int
    at_s: float
    session: int
    turn: int
    user: str
    last: bool  # the session's last planned turn


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    system_texts: tuple[str, ...]
    sessions: tuple[Session, ...]
    requests: tuple[Request, ...]

    @property
    def duration_s(self) -> float:
        """Planned time of the last request."""
        return self.requests[-1].at_s if self.requests else 0.0

    @property
    def offered_rate(self) -> float:
        """Requests per second the plan offers (its requests over its span)."""
        n = len(self.requests)
        return (n - 1) / self.duration_s if n > 1 and self.duration_s > 0 else float(n)

    def max_prompt_tokens(self) -> int:
        """An upper bound of any request's prompt tokens (the template's tokens included), for
        sizing ``max_model_len``."""
        c = self.config
        per_turn = c.user_words[1] + c.max_tokens + 2 * TEMPLATE_TOKENS_PER_MESSAGE
        return c.system_words + TEMPLATE_TOKENS_PER_MESSAGE + 2 + c.turns[1] * per_turn

    def working_set_tokens(self, at_s: float) -> int:
        """Tokens of the contexts of the sessions talking at ``at_s`` (sent a turn by then, with
        one still to come), each system prompt counted once, replies at ``max_tokens``: what the
        caches must hold to serve every next turn from cache."""
        c = self.config
        last = {r.session: r.at_s for r in self.requests}
        own: dict[int, int] = {}
        for r in self.requests:
            if r.at_s <= at_s < last[r.session]:
                own[r.session] = own.get(r.session, 0) + len(r.user.split()) + c.max_tokens + 6
        systems = {self.sessions[s].system for s in own}
        return sum(own.values()) + len(systems) * (c.system_words + TEMPLATE_TOKENS_PER_MESSAGE)

    def mean_working_set(self, samples: int = 20) -> float:
        """:meth:`working_set_tokens` averaged over the run."""
        times = [self.duration_s * (i + 0.5) / samples for i in range(samples)]
        return sum(self.working_set_tokens(t) for t in times) / samples


def _words(rng: random.Random, n: int, vocab_size: int) -> str:
    return " ".join(f"w{rng.randrange(0, vocab_size - FIRST_WORD)}" for _ in range(n))


def initial_sessions(c: WorkloadConfig) -> int:
    """Sessions talking at once to keep ``c``'s rate: ``rate x`` the mean gap between turns."""
    return max(1, math.ceil(c.rate * (c.min_think_s + c.think_s)))


def auto_sessions(c: WorkloadConfig) -> int:
    """Sessions enough for ``c``'s rate and duration: :func:`initial_sessions` plus those
    arriving in the run (up to ``rate / mean turns`` per second), with 30% to spare."""
    return initial_sessions(c) + math.ceil(1.3 * c.rate * c.duration_s / (sum(c.turns) / 2))


def build_workload(config: WorkloadConfig) -> Workload:
    """The workload of ``config`` (module docstring); equal configs give equal workloads."""
    c = config
    rng = random.Random(f"raykv-bench-serve/{c.seed}")
    n = c.sessions or auto_sessions(c)
    systems = tuple(_words(rng, c.system_words, c.vocab_size) for _ in range(c.system_prompts))
    weights = [1.0 / (i + 1) for i in range(c.system_prompts)]
    counts = [rng.randint(*c.turns) for _ in range(n)]
    initial = min(n, initial_sessions(c))
    arrivals = [0.0] * initial
    session_rate = ARRIVAL_LOAD * c.rate / (sum(c.turns) / 2)
    while len(arrivals) < n:
        arrivals.append(arrivals[-1] + rng.expovariate(session_rate))
    sessions = tuple(
        Session(i, rng.choices(range(c.system_prompts), weights)[0], counts[i], arrivals[i]) for i in range(n)
    )
    messages = [
        [_words(rng, rng.randint(*c.user_words), c.vocab_size) for _ in range(s.turns)] for s in sessions
    ]
    thinks = [[c.min_think_s + rng.expovariate(1.0 / c.think_s) for _ in range(s.turns)] for s in sessions]
    return Workload(c, systems, sessions, tuple(_schedule(c, sessions, messages, thinks, rng)))


def _schedule(
    c: WorkloadConfig,
    sessions: Sequence[Session],
    messages: Sequence[Sequence[str]],
    thinks: Sequence[Sequence[float]],
    rng: random.Random,
) -> list[Request]:
    """Assign Poisson send slots to session turns for ``duration_s`` (module docstring)."""
    pending = list(sessions)  # by arrival
    ready: list[tuple[float, int]] = []  # (ready at, session id): the active sessions
    sent = [0] * len(sessions)
    out: list[Request] = []
    t = 0.0
    for index in range(sum(s.turns for s in sessions)):
        if index:
            t += rng.expovariate(c.rate)
        if t > c.duration_s:
            break
        while pending and pending[0].arrival_s <= t:
            s = pending.pop(0)
            heapq.heappush(ready, (s.arrival_s, s.id))
        if not ready or ready[0][0] > t:
            if pending:  # the next session arrives early rather than the slot going unused
                s = pending.pop(0)
                heapq.heappush(ready, (t, s.id))
            elif ready:  # too few sessions for the rate: the slot waits for one
                t = ready[0][0]
            else:
                break
        _, sid = heapq.heappop(ready)
        k = sent[sid]
        sent[sid] += 1
        out.append(Request(index, t, sid, k, messages[sid][k], False))
        if sent[sid] < sessions[sid].turns:
            heapq.heappush(ready, (t + thinks[sid][k], sid))
    final = {r.session: r.index for r in out}
    return [replace(r, last=True) if final[r.session] == r.index else r for r in out]


@dataclass
class Conversation:
    """A session's messages as the client sends them: the system prompt, then per turn the user
    message and the reply the server gave."""

    system: str
    messages: list[dict[str, str]] = field(default_factory=list)

    def ask(self, user: str) -> list[dict[str, str]]:
        """The messages of the next request: the history and ``user``'s message (added)."""
        self.messages.append({"role": "user", "content": user})
        return [{"role": "system", "content": self.system}, *self.messages]

    def answer(self, reply: str) -> None:
        """The server's reply to the last :meth:`ask` (empty text is kept as it is)."""
        self.messages.append({"role": "assistant", "content": reply})


def conversations(workload: Workload) -> dict[int, Conversation]:
    """A fresh :class:`Conversation` per session of ``workload``."""
    return {s.id: Conversation(workload.system_texts[s.system]) for s in workload.sessions}


def request_times(workload: Workload) -> list[float]:
    """Planned send times, ascending."""
    return [r.at_s for r in workload.requests]


def active_sessions(workload: Workload, at_s: float) -> int:
    """Sessions that have sent a turn by ``at_s`` and still have one to send after it."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for r in workload.requests:
        first.setdefault(r.session, r.at_s)
        last[r.session] = r.at_s
    return sum(1 for s in first if first[s] <= at_s < last[s])


__all__ = [
    "Conversation",
    "Request",
    "Session",
    "Workload",
    "WorkloadConfig",
    "active_sessions",
    "auto_sessions",
    "build_workload",
    "initial_sessions",
    "conversations",
    "request_times",
]

"""The ``chat_text`` workload family and the router's tokenize path in the replay (pure; no ray).

``chat_text`` is the ``chat`` family (:mod:`raykv.replay.families`) carried as OpenAI chat
``messages`` instead of token ids. For a seed it has the ``chat`` family's tenants, sessions,
arrivals, turns and lengths: its shape is drawn from ``random.Random(seed)`` in the ``chat``
family's order, its words from a second RNG seeded from the seed. The text is words of the
locally made tokenizer (:func:`raykv.routing.local_tokenizer.build_chat_tokenizer` over
:data:`CHAT_VOCAB` ids; nothing is downloaded), one token per word:

- each tenant's system prompt (its ``chat`` length in words) is shared by all its sessions;
- a turn re-sends the whole history: the system prompt, every earlier user turn and the
  assistant's reply to it, then the new user turn. A reply is drawn once (``output_length``
  words) and the same text is re-sent in every later turn, so a turn's rendered prompt is a prefix
  of the next turn's and their full blocks are shared;
- a user turn attaches an image with probability :data:`IMAGE_P` (an ``image_url`` part before
  its text). No router can render it to the engine's ids, nor any later turn of its session (the
  history holds the image).

Each request also carries the ids its engine prefills (``Request.tokens``): the chat template
applied with ``add_generation_prompt`` and the text tokenized whole, as vLLM renders a chat (an
image stands for 64-256 placeholder tokens of its own, as a multimodal engine's image tokens do);
``hash_ids`` name those ids' blocks in the Mooncake convention (a full block's id names its
tokens and its parent's id; a trailing partial block gets a fresh id). A session's requests share
their message dicts: read them, never change them.

:class:`ChatPrompts` is the router's side: one :class:`~raykv.routing.prompts.PromptRenderer`
(raykv's Serve router holds one per model, ``actors/serve/prompts.py``) renders each request's
messages in arrival order, timed; a request it cannot render gives None and is counted, and the
raykv routers route it by load, as Serve's router does. ``transformers`` loads on first use only.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.keys import ReuseScope
from raykv.replay.blocks import draw
from raykv.replay.trace import BLOCK_TOKENS, Request, tokens_for
from raykv.routing.local_tokenizer import FIRST_WORD, build_chat_tokenizer, words
from raykv.routing.prompts import PromptRenderer, Unrenderable

CHAT_VOCAB = 4096
"""Token ids of the family's tokenizer (special tokens, then words)."""
IMAGE_P = 0.02
"""Probability that a user turn attaches an image (its session is unrenderable from then on)."""
IMAGE_TOKENS = (64, 256)
"""Placeholder tokens an image stands for in the engine's prompt."""
TENANTS = 4
Message = dict[str, Any]


@functools.lru_cache(maxsize=4)
def chat_tokenizer(vocab_size: int = CHAT_VOCAB) -> Any:
    """The family's tokenizer (built once per process and vocabulary; read-only afterwards)."""
    return build_chat_tokenizer(vocab_size)


def chat_renderer(vocab_size: int = CHAT_VOCAB) -> PromptRenderer:
    """A fresh renderer (empty prefix cache, zeroed ``stats``) over the family's tokenizer."""
    return PromptRenderer(chat_tokenizer(vocab_size))


def engine_ids(tokenizer: Any, conversations: Sequence[list[Message]]) -> list[npt.NDArray[np.uint32]]:
    """The ids an engine prefills for each of ``conversations`` (string contents): the chat
    template applied with ``add_generation_prompt``, each text tokenized whole without added
    special tokens (the template writes them), as vLLM renders a chat; in one batch."""
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations
    ]
    return [
        np.asarray(ids, dtype=np.uint32) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
    ]


class _Gen:
    """The generator's state: the shape RNG (the ``chat`` family's draws), the words RNG, the
    tenants' salts and system prompts, block ids by content, the requests made so far."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.text_rng = random.Random(f"chat_text:{seed}")
        self.tokenizer = chat_tokenizer()
        self.salts = [ReuseScope.from_cache_salt(f"tenant-{i}").salt for i in range(TENANTS)]
        sizes = [
            draw(self.rng, (1, 4)) * BLOCK_TOKENS + self.rng.randint(0, BLOCK_TOKENS - 1) for _ in self.salts
        ]
        self.systems: list[Message] = [{"role": "system", "content": self.words(n)} for n in sizes]
        self.blocks: dict[tuple[int, bytes], int] = {}
        self.next_id = 0
        self.images = 0
        self.reqs: list[Request] = []
        self.session = 0

    def words(self, n: int) -> str:
        """``n`` words drawn from the vocabulary (``n`` tokens)."""
        return words(self.text_rng.choices(range(FIRST_WORD, CHAT_VOCAB), k=n))

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def hash_ids(self, ids: npt.NDArray[np.uint32]) -> tuple[int, ...]:
        """Mooncake ids of ``ids``' blocks (module docstring)."""
        out, parent = [], -1
        for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            digest = hashlib.blake2b(ids[start : start + BLOCK_TOKENS].tobytes(), digest_size=16).digest()
            block = self.blocks.get((parent, digest))
            if block is None:
                block = self.blocks[(parent, digest)] = self.fresh()
            out.append(block)
            parent = block
        if len(ids) % BLOCK_TOKENS:
            out.append(self.fresh())
        return tuple(out)

    def user_turn(self, tokens: int) -> tuple[Message, Message]:
        """A user message of ``tokens`` words: (as sent, as the engine renders it). With
        probability IMAGE_P an image part comes first (the engine sees its placeholder tokens)."""
        text = self.words(tokens)
        if self.text_rng.random() >= IMAGE_P:
            message = {"role": "user", "content": text}
            return message, message
        self.images += 1
        image = {"type": "image_url", "image_url": {"url": f"https://images.example/{self.images}.png"}}
        placeholder = self.words(draw(self.text_rng, IMAGE_TOKENS))
        sent = {"role": "user", "content": [image, {"type": "text", "text": text}]}
        return sent, {"role": "user", "content": f"{placeholder}\n{text}"}

    def conversation(self, start: float) -> None:
        """One session (the ``chat`` family's draws, in its order), its turns tokenized in one
        batch by the engine."""
        rng = self.rng
        tenant = rng.randrange(TENANTS)
        sent, engine, at = [self.systems[tenant]], [self.systems[tenant]], start
        turns: list[tuple[float, tuple[Message, ...], list[Message], int]] = []
        for _ in range(draw(rng, (2, 10))):
            user, user_engine = self.user_turn(draw(rng, (20, 500)))
            sent, engine = [*sent, user], [*engine, user_engine]
            output = draw(rng, (50, 600))
            turns.append((at, tuple(sent), engine, output))
            reply = {"role": "assistant", "content": self.words(output)}
            sent, engine = [*sent, reply], [*engine, reply]
            at += rng.expovariate(1.0 / 30.0)
        salt = self.salts[tenant]
        for (at, messages, _, output), ids in zip(turns, engine_ids(self.tokenizer, [t[2] for t in turns])):
            hash_ids = self.hash_ids(ids)
            self.reqs.append(
                Request(at, len(ids), output, hash_ids, salt, self.session, messages, ids.tobytes())
            )


def chat_text(requests: int, seed: int) -> list[Request]:
    """The ``chat_text`` family (module docstring): ``requests`` chat requests in arrival order,
    the same for a size and seed."""
    gen = _Gen(seed)
    at = 0.0
    while len(gen.reqs) < requests:
        gen.conversation(at)
        gen.session += 1
        at += gen.rng.expovariate(1.0 / 3.0)
    gen.reqs.sort(key=lambda r: (r.arrival_s, r.session))
    return gen.reqs[:requests]


class ChatPrompts:
    """The router's tokenize path over a replay's chat requests (module docstring).

    ``renderer`` (default :func:`chat_renderer`) renders every request's messages, one request
    after the other. ``counts``: ``rendered``; ``unrendered`` and ``unrendered_<reason>``
    (Unrenderable's first word, as Serve counts them); ``engine_mismatch``, rendered ids that
    differ from the engine's (their keys cannot hit; 0 when rendering is right). ``render_ns``:
    each rendered request's render time, wall clock. Not thread-safe."""

    def __init__(
        self, renderer: PromptRenderer | None = None, clock: Callable[[], int] = time.perf_counter_ns
    ) -> None:
        self.renderer = renderer if renderer is not None else chat_renderer()
        self.counts: collections.Counter[str] = collections.Counter()
        self.render_ns: list[int] = []
        self._clock = clock

    def render(self, req: Request) -> tuple[npt.NDArray[np.uint32] | None, int]:
        """``req``'s prompt ids as the router renders its ``messages`` (None when it cannot:
        counted) and the nanoseconds rendering took. ValueError for a request without messages."""
        if req.messages is None:
            raise ValueError("not a chat request: it carries no messages")
        t0 = self._clock()
        try:
            ids = self.renderer.request({"messages": req.messages})
        except Unrenderable as exc:
            self.counts["unrendered"] += 1
            self.counts[f"unrendered_{str(exc).split(':', 1)[0]}"] += 1
            return None, self._clock() - t0
        ns = self._clock() - t0
        self.render_ns.append(ns)
        self.counts["rendered"] += 1
        out = np.asarray(ids, dtype=np.uint32)
        if not np.array_equal(out, tokens_for(req)):
            self.counts["engine_mismatch"] += 1
        return out, ns

    def summary(self) -> dict[str, Any]:
        """The tokenize cost so far: ``rendered``, ``unrendered`` (with reasons),
        ``engine_mismatch``, render microseconds per rendered request (``render_p50_us``,
        ``render_p99_us``, ``render_mean_us``; NaN before any) and the renderer's prefix reuse
        (``reused_pct``: characters reused / characters rendered; ``stats``: its counters)."""
        us = np.asarray(self.render_ns, dtype=np.float64) / 1000.0
        stats = dict(self.renderer.stats)
        chars = stats.get("reused_chars", 0) + stats.get("tokenized_chars", 0)

        def pct(q: float) -> float:
            return float(np.percentile(us, q)) if len(us) else float("nan")

        return {
            **{k: v for k, v in sorted(self.counts.items()) if k.startswith("unrendered_")},
            "rendered": self.counts["rendered"],
            "unrendered": self.counts["unrendered"],
            "engine_mismatch": self.counts["engine_mismatch"],
            "render_p50_us": pct(50),
            "render_p99_us": pct(99),
            "render_mean_us": float(us.mean()) if len(us) else float("nan"),
            "reused_pct": 100.0 * stats.get("reused_chars", 0) / chars if chars else 0.0,
            "prefix_reuse": self.renderer.reuse,
            "stats": stats,
        }

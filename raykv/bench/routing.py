"""Routing decision benchmarks: raykv's index + cost model vs Ray Serve LLM's prefix tree.

Setup (same for both): the built-in replay workload, each session pinned to one of 8 workers
(the state a cache-aware router converges to). raykv: a :class:`~raykv.index.prefix_index.PrefixIndex` holding
every request's block keys on its worker; a decision is ``route(keys)`` + ``choose_loads``.
Baseline: Ray's own ``PrefixTree`` (``ray.llm``, built by the factory ``actors/replay/ray_tree.py``
registers) holding the same requests as text; a decision is ``prefix_match(text, replicas)`` plus
``get_smallest_tenants()`` when the match rate is under 10% (PrefixCacheAffinityRouter's calls).
Text is 16 characters per 512-token block (the replay's encoding) and, in a second row, 2048
characters per block (about 4 characters per token, what Ray's character-level tree sees with real
prompts). Figures are decisions/s (median
over passes, higher is better); ``info`` gives the median per-decision latency.

A second benchmark times the tokenize path a router runs for chat requests (``_render_rows``).
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from raykv.bench.harness import Benchmark, Row, gc_paused
from raykv.core.keys import ReuseScope, block_keys
from raykv.core.types import WorkerId
from raykv.index.holders import pack_ops
from raykv.index.prefix_index import OP_STORE, EventBatch, PrefixIndex
from raykv.replay.peer_tree import new_prefix_tree
from raykv.replay.trace import BLOCK_TOKENS, Request, block_text, tokens_for
from raykv.replay.workload import WorkloadSpec, generate
from raykv.routing.adaptive import RoutingPolicy
from raykv.routing.policy import DEFAULT_ROUTING

WORKERS = 8


@dataclass(frozen=True)
class RoutingSettings:
    requests: int
    passes: int
    chat_turns: int = 16


QUICK = RoutingSettings(requests=300, passes=3, chat_turns=8)
FULL = RoutingSettings(requests=1500, passes=5, chat_turns=24)


def _placed(n: int) -> tuple[list[Request], list[list[bytes]], list[int]]:
    reqs = generate(WorkloadSpec(requests=n, seed=7))
    keys: list[list[bytes]] = [
        list(block_keys(tokens_for(r), BLOCK_TOKENS, ReuseScope(salt=r.salt) if r.salt is not None else None))
        for r in reqs
    ]
    return reqs, keys, [r.session % WORKERS for r in reqs]


def _raykv(
    reqs: Sequence[Request], keys: Sequence[list[bytes]], owner: Sequence[int]
) -> Callable[[int], Any]:
    index = PrefixIndex()
    workers = [WorkerId(f"w{i}") for i in range(WORKERS)]
    for lane, w in enumerate(workers):
        index.register_worker(w, lane, 1)
    ids = [0] * WORKERS
    for ks, lane in zip(keys, owner):
        ids[lane] += 1
        ops = pack_ops((OP_STORE, k, 0) for k in ks)
        index.apply_batch(EventBatch(workers[lane], 1, ids[lane], ids[lane], ops))
    policy = RoutingPolicy(replace(DEFAULT_ROUTING, tokens_per_block=BLOCK_TOKENS, w_host=1.0))
    loads = [float(1000 * i) for i in range(WORKERS)]
    rng = random.Random(0)

    def decide(i: int) -> Any:
        return policy.decide(reqs[i].input_length, workers, loads, index.route(keys[i]), rng)

    return decide


def _ray(reqs: Sequence[Request], owner: Sequence[int], chars_per_block: int) -> Callable[[int], Any]:
    reps = chars_per_block // 16
    texts = ["".join(block_text(h) * reps for h in r.hash_ids) for r in reqs]
    tree = new_prefix_tree()
    tenants = [f"replica-{i}" for i in range(WORKERS)]
    tree.add_tenants(tenants, 0.0)
    for i, (text, w) in enumerate(zip(texts, owner)):
        tree.insert(text, tenants[w], float(i))

    def decide(i: int) -> Any:
        matched, _ = tree.prefix_match(texts[i], tenants)
        if len(matched) / len(texts[i]) < 0.1:
            return tree.get_smallest_tenants()
        return matched

    return decide


def _rate(decide: Callable[[int], Any], n: int, passes: int) -> tuple[float, float]:
    """(decisions/s, median us per decision) over ``passes`` passes of ``n`` decisions."""
    rates, lat = [], []
    with gc_paused():
        for _ in range(passes):
            start = time.perf_counter()
            for i in range(n):
                t0 = time.perf_counter_ns()
                decide(i)
                lat.append(time.perf_counter_ns() - t0)
            rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates), statistics.median(lat) / 1000.0


def _rows(settings: RoutingSettings) -> list[Row]:
    reqs, keys, owner = _placed(settings.requests)
    n, passes = len(reqs), settings.passes
    ours, ours_us = _rate(_raykv(reqs, keys, owner), n, passes)
    rows = []
    for chars in (16, 2048):
        base, base_us = _rate(_ray(reqs, owner, chars), n, passes if chars == 16 else 1)
        rows.append(
            Row(
                f"routing decision vs Ray PrefixTree, {chars} chars/block",
                ours,
                base,
                "decisions/s",
                info=f"p50 raykv {ours_us:.1f} us vs Ray tree {base_us:.1f} us ({WORKERS} workers)",
            )
        )
    return rows


def _render_rows(turns: int) -> list[Row]:
    """A router's tokenize path: a ``turns``-turn chat (a 400-word system prompt, 60-word user
    turns, 30-word replies) rendered turn after turn by one :class:`PromptRenderer` (each turn
    reuses the ids of the turn before), against transformers' ``apply_chat_template(...,
    tokenize=True)`` per turn (what vLLM runs), same ids checked. The locally made word-level
    tokenizer: a BPE tokenizer costs more per character, so reuse saves more."""
    from raykv.routing.local_tokenizer import FIRST_WORD, build_chat_tokenizer, words
    from raykv.routing.prompts import PromptRenderer

    rng = random.Random(3)
    tokenizer = build_chat_tokenizer()
    say = lambda n: words(rng.randrange(FIRST_WORD, 512) for _ in range(n))  # noqa: E731
    chat = [{"role": "system", "content": say(400)}]
    histories = []
    for _ in range(turns):
        chat = [*chat, {"role": "user", "content": say(60)}]
        histories.append(chat)
        chat = [*chat, {"role": "assistant", "content": say(30)}]
    renderer = PromptRenderer(tokenizer)
    ours, base = [], []
    for history in histories:
        t0 = time.perf_counter()
        got = renderer.chat(history)
        t1 = time.perf_counter()
        want = tokenizer.apply_chat_template(
            history, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        t2 = time.perf_counter()
        if got != list(want):
            raise AssertionError("rendered ids differ from the chat template's")
        ours.append(t1 - t0)
        base.append(t2 - t1)
    tokens = len(got)
    p50 = f"p50 {statistics.median(ours) * 1e6:.0f} vs {statistics.median(base) * 1e6:.0f} us"
    info = f"{p50}; last turn {tokens} tokens"
    return [
        Row(
            f"render a chat turn, {turns} turns, reuse vs whole",
            1 / statistics.mean(ours),
            1 / statistics.mean(base),
            "turns/s",
            info=info,
        )
    ]


def routing_benchmarks(settings: RoutingSettings) -> list[Benchmark]:
    """One benchmark producing both rows (the workload is built once), and the chat render."""
    benches = [Benchmark("routing decision", lambda: _rows(settings))]
    if importlib.util.find_spec("transformers") is not None:
        benches.append(Benchmark("chat render", lambda: _render_rows(settings.chat_turns)))
    return benches


def suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The suite's benchmarks and description line (``quick``: CI mode)."""

    settings = QUICK if quick else FULL
    return routing_benchmarks(settings), f"{settings.requests} built-in requests, {settings.passes} passes"


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import module_main

    sys.exit(module_main("routing", suite))

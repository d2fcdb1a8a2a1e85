"""The chat-templated workload family (``raykv replay --workload chat_text``): requests that
carry OpenAI messages, rendered by the routers' one PromptRenderer before they are keyed."""

from __future__ import annotations

import collections
import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from actors.cli.main import build_parser
from actors.replay.backends import in_process
from raykv.core.types import WorkerId
from raykv.replay.chat_text import ChatPrompts, chat_renderer, chat_text, chat_tokenizer
from raykv.replay.engine import prepare, replay
from raykv.replay.families import FAMILIES, chat
from raykv.replay.routers import Prepared, RaykvRouter, RouterContext, make_router
from raykv.replay.timing import ServerQueues, TimingConfig
from raykv.replay.trace import BLOCK_TOKENS, Request, TraceError, check_request, tokens_for
from raykv.routing.prompts import conversation

TIMING = TimingConfig(speed=1000.0)


@pytest.fixture(scope="module")
def reqs() -> list[Request]:
    return chat_text(300, seed=0)


def _has_image(req: Request) -> bool:
    assert req.messages is not None
    return any(isinstance(m["content"], list) for m in req.messages)


def _sessions(reqs: list[Request]) -> dict[int, list[Request]]:
    out: dict[int, list[Request]] = collections.defaultdict(list)
    for r in reqs:
        out[r.session].append(r)
    return out


def test_chat_text_is_the_chat_familys_sessions_as_messages(reqs: list[Request]) -> None:
    """Same arrivals, sessions, tenants and output lengths as ``chat`` for a seed; each request
    a whole history (system, user and assistant turns) ending in a user turn, valid and seeded."""
    assert FAMILIES["chat_text"] is chat_text
    plain = chat(300, seed=0)
    assert [(r.arrival_s, r.session, r.salt, r.output_length) for r in reqs] == [
        (r.arrival_s, r.session, r.salt, r.output_length) for r in plain
    ]
    assert reqs == chat_text(300, seed=0) and reqs != chat_text(300, seed=1)
    for r in reqs:
        check_request(r)
        assert r.messages is not None
        roles = [m["role"] for m in r.messages]
        assert roles[0] == "system" and roles[1::2] == ["user"] * (len(roles) // 2)
        assert roles[2::2] == ["assistant"] * (len(roles) // 2 - 1)
    systems = collections.defaultdict(set)
    for r in reqs:
        assert r.messages is not None
        systems[r.salt].add(r.messages[0]["content"])
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per tenant, shared


def test_rendered_ids_equal_the_templates_and_the_engines(reqs: list[Request]) -> None:
    """What the routers' renderer gives for a family request is the tokenizer's chat template
    tokenized (``apply_chat_template``), a fresh renderer's ids, and the ids the engine runs."""
    tokenizer = chat_tokenizer()
    prompts = ChatPrompts()
    checked = 0
    for r in reqs[:60]:
        ids, ns = prompts.render(r)
        assert ns > 0
        if _has_image(r):
            assert ids is None
            continue
        assert r.messages is not None
        template = tokenizer.apply_chat_template(
            list(r.messages), tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ids is not None and ids.tolist() == list(template)
        assert ids.tolist() == chat_renderer().chat(r.messages)
        assert np.array_equal(ids, tokens_for(r)) and len(ids) == r.input_length
        checked += 1
    assert checked > 40 and prompts.counts["engine_mismatch"] == 0
    assert prompts.counts["rendered"] == checked == len(prompts.render_ns)


def test_consecutive_turns_share_their_previous_turns_full_blocks(reqs: list[Request]) -> None:
    """A session's assistant replies are re-sent as they were, so each rendered turn is a prefix
    of the next one's and every full block of it keeps its key; the worker that ran the first
    turn has them when raykv routes the second turn there."""
    prepared = prepare(reqs)
    by_session: dict[int, list[Prepared]] = collections.defaultdict(list)
    for p in prepared:
        by_session[p.req.session].append(p)
    pairs = 0
    for turns in by_session.values():
        for a, b in itertools.pairwise(turns):
            if a.unrendered or b.unrendered:
                continue
            assert len(a.keys) == a.req.input_length // BLOCK_TOKENS > 0
            assert list(b.keys[: len(a.keys)]) == list(a.keys)
            assert b.req.hash_ids[: len(a.keys)] == a.req.hash_ids[: len(a.keys)]
            pairs += 1
    assert pairs > 100
    first, second = next(t[:2] for t in _sessions(reqs).values() if len(t) >= 2 and not _has_image(t[1]))
    second = second._replace(arrival_s=first.arrival_s + 100.0)
    with in_process(4, 256) as backend:
        res = replay(prepare([first, second]), RaykvRouter(), backend, TIMING, 1000.0, 4)
    assert res.chosen[0] == res.chosen[1]
    assert res.reused == [0, first.input_length // BLOCK_TOKENS]


def test_prefix_reuse_kicks_in_for_later_turns(reqs: list[Request]) -> None:
    """The renderer tokenizes a later turn's history again only past what it rendered for the
    previous turn: all of the previous turn's text (it ends with a special token) is reused."""
    tokenizer = chat_tokenizer()
    first, second = next(t[:2] for t in _sessions(reqs).values() if len(t) >= 2 and not _has_image(t[1]))
    prompts = ChatPrompts()
    prompts.render(first)
    assert prompts.renderer.stats["reused_chars"] == 0
    prompts.render(second)
    assert first.messages is not None
    text = tokenizer.apply_chat_template(list(first.messages), tokenize=False, add_generation_prompt=True)
    assert prompts.renderer.stats["reused_chars"] == len(text)
    whole = ChatPrompts()
    prepare(reqs, whole)
    summary = whole.summary()
    assert whole.renderer.stats["reused_chars"] > 0 and 50.0 < summary["reused_pct"] < 100.0
    assert summary["rendered"] + summary["unrendered"] == len(reqs)


def test_an_image_makes_its_turn_and_later_turns_unrenderable_routed_by_load(reqs: list[Request]) -> None:
    """An image part cannot be rendered: the request gets no keys, is counted, and raykv routes
    it as Serve does without ids (two servers, the lower reported load), learning nothing."""
    prepared = prepare(reqs, prompts := ChatPrompts())
    unrendered = [p for p in prepared if p.unrendered]
    assert unrendered and all(p.keys == () for p in unrendered)
    assert prompts.counts["unrendered"] == prompts.counts["unrendered_multimodal"] == len(unrendered)
    for turns in _sessions(reqs).values():
        flags = [_has_image(r) for r in turns]
        assert flags == sorted(flags)  # once a session has an image, every later turn has it
    for p in unrendered:
        assert p.req.messages is not None and _has_image(p.req)
        assert p.req.input_length > len(conversation([p.req.messages[0]])[0]["content"].split())
    q = ServerQueues(2, speed=100.0)
    q.dispatch(0, pre_s=0.0, uncached=500, work=500)
    router = RaykvRouter()
    router.start(
        RouterContext(
            2, [WorkerId("w0"), WorkerId("w1")], lambda k: {}, lambda w, k: None, 100.0, TIMING, 1.0
        )
    )
    for p in unrendered[:5]:
        choice = router.choose(p, q)
        router.routed(p, choice)
        assert choice.server == 1  # the lower reported load
    assert router.stats == {"unrendered": 5} and router.policy.decisions == 0  # nothing learned
    with in_process(3, 64) as backend:
        res = replay(prepared, make_router("raykv"), backend, TIMING, 1000.0, 3)
    assert res.notes["routed_unrendered"] == len(unrendered)
    with in_process(3, 64) as backend:
        assert (
            "routed_unrendered" not in replay(prepared, make_router("pow2"), backend, TIMING, 1000.0, 3).notes
        )


def test_chat_requests_need_both_messages_and_tokens(reqs: list[Request]) -> None:
    r = reqs[0]
    with pytest.raises(TraceError):
        check_request(r._replace(tokens=None))
    with pytest.raises(TraceError):
        check_request(r._replace(tokens=(r.tokens or b"") + b"\0\0\0\0"))
    with pytest.raises(ValueError):
        ChatPrompts().render(chat(1, 0)[0])


def test_replay_command_reports_the_tokenize_cost(tmp_path: Path) -> None:
    """The chat_text workload prints a tokenize line and writes it in the JSON meta; a workload
    of token ids prints none."""
    argv = ["replay", "--workload", "chat_text,chat", "--requests", "120", "--workers", "3"]
    argv += ["--capacity-pct", "20", "--routers", "pow2,raykv,pooled", "--out", str(tmp_path)]
    args = build_parser().parse_args(argv)
    out = io.StringIO()
    assert args.func(args, out, io.StringIO()) == 0
    lines = [line.strip() for line in out.getvalue().splitlines() if line.strip().startswith("tokenize:")]
    assert len(lines) == 1 and "chat requests rendered by one PromptRenderer" in lines[0]
    meta = json.loads((tmp_path / "chat_text.json").read_text())["meta"]
    tokenize = meta["tokenize"]
    assert tokenize["rendered"] + tokenize["unrendered"] == 120 and tokenize["engine_mismatch"] == 0
    assert tokenize["render_p50_us"] > 0 and tokenize["render_p99_us"] >= tokenize["render_p50_us"]
    assert tokenize["stats"]["reused_chars"] > 0 and f"{tokenize['unrendered']} unrenderable" in lines[0]
    assert "tokenize" not in json.loads((tmp_path / "chat.json").read_text())["meta"]

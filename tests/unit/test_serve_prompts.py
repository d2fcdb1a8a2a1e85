"""Chat and text requests get token ids: raykv.routing.prompts (the renderer) and the Serve
router's use of it (actors.serve.prompts, CacheAwareRouter._request)."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace
from typing import Any

import pytest

from actors.serve.prompts import RequestTokens, renderable, tokenizer_source
from actors.serve.ranking import CacheRanker
from actors.serve.routed import RoutedRequest
from actors.serve.router import CacheAwareRouter
from raykv.routing.local_tokenizer import FIRST_WORD, build_chat_tokenizer, words
from raykv.routing.prompts import PromptRenderer, Unrenderable

SYSTEM = {"role": "system", "content": words(range(FIRST_WORD, FIRST_WORD + 40))}


def _chat(turns: int) -> list[dict[str, Any]]:
    """A conversation of ``turns`` user turns (with the assistant's replies between them)."""
    out: list[dict[str, Any]] = [SYSTEM]
    for t in range(turns):
        if t:
            out.append({"role": "assistant", "content": words([FIRST_WORD + 100 + t] * 3)})
        out.append({"role": "user", "content": words(range(FIRST_WORD + 10 * t, FIRST_WORD + 10 * t + 7))})
    return out


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The ids vLLM's renderer computes: the template applied and tokenized by transformers."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_chat_tokenizer()


def test_chat_ids_are_the_templates_and_later_turns_reuse_the_earlier_ones(tokenizer: Any) -> None:
    """Every turn renders to exactly ``apply_chat_template(..., tokenize=True)``'s ids (what vLLM
    computes), whether rendered whole or over a remembered earlier turn; later turns reuse."""
    renderer = PromptRenderer(tokenizer)
    assert renderer.reuse
    for turns in range(1, 6):
        messages = _chat(turns)
        want = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert renderer.chat(messages) == want
        assert PromptRenderer(tokenizer).chat(messages) == want  # rendered whole
    assert renderer.stats["reused_chars"] > renderer.stats["tokenized_chars"] / 2
    assert renderer.stats["rendered"] == 5


def test_request_fields_change_the_ids_as_vllm_applies_them(tokenizer: Any) -> None:
    renderer = PromptRenderer(tokenizer)
    messages = _chat(2)
    plain = renderer.request({"messages": messages})
    no_prompt = renderer.request({"messages": messages, "add_generation_prompt": False})
    assert plain[:-1] == no_prompt and plain[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    parts = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
    assert renderer.request({"messages": [{"role": "user", "content": parts}]}) == renderer.chat(
        [{"role": "user", "content": "w1 w2\nw3"}]
    )
    assert renderer.request({"prompt": "w1 w2"}) == [1, FIRST_WORD + 1, FIRST_WORD + 2]  # BOS added
    assert renderer.request({"prompt": ["w1 w2"], "add_special_tokens": False}) == [
        FIRST_WORD + 1,
        FIRST_WORD + 2,
    ]
    as_object = SimpleNamespace(messages=messages, add_generation_prompt=True, model_extra={})
    assert renderer.request(as_object) == plain


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "multimodal"),
        ({"prompt": ["w1", "w2"]}, "batch"),
        ({"prompt": [1, 2, 3]}, "kind"),
        ({"messages": [{"role": "user", "content": "w1"}], "chat_template": "{{ raise_me() }}"}, "template"),
    ],
)
def test_what_cannot_be_rendered_raises_with_its_reason(tokenizer: Any, request_: Any, reason: str) -> None:
    with pytest.raises(Unrenderable, match=f"^{reason}"):
        PromptRenderer(tokenizer).request(request_)


def test_a_tokenizer_that_does_not_split_at_special_tokens_is_rendered_whole(tokenizer: Any) -> None:
    """Reuse is checked before it is used: a tokenizer whose ids for a text differ from the ids
    of its parts split after a special token gets no reuse, and its ids stay exact."""

    class Merging:  # a stand-in whose tokenization of "X" depends on what precedes it
        all_special_tokens = ["<s>"]

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            ids = [ord(c) for c in text.replace("<s> ", "\x01")]
            return {"input_ids": ids}

        def apply_chat_template(self, conversation: Any, tokenize: bool = False, **_: Any) -> str:
            return "<s> " + " ".join(m["content"] for m in conversation)

    renderer = PromptRenderer(Merging())
    assert not renderer.reuse
    assert renderer.chat([{"role": "user", "content": "ab"}]) == [1, ord("a"), ord("b")]


# ---- the Serve router ------------------------------------------------------------------------------


def _router(tokenizer: Any, budget_s: float = 5.0, metrics: Any = None) -> CacheAwareRouter:
    """A CacheAwareRouter's request reading (no Serve controller: its state set by hand)."""
    router = CacheAwareRouter.__new__(CacheAwareRouter)
    router.ranker = CacheRanker(lambda: asyncio.sleep(0))  # type: ignore[arg-type, return-value]
    router.prompts = RequestTokens(
        "local",
        budget_s,
        loader=lambda _: PromptRenderer(tokenizer),
        counters=router.ranker.counters,
        metrics=metrics,
    )
    router._rendered = collections.OrderedDict()
    return router


def test_the_router_keys_chat_and_text_by_their_rendered_ids(tokenizer: Any) -> None:
    from metrics_support import Recorder

    from actors.cache.metrics import RouterMetrics

    rec = Recorder()
    router = _router(tokenizer, metrics=RouterMetrics("app", backend=rec))
    messages = _chat(3)
    chat = {"messages": messages, "cache_salt": "tenant", "session_id": "s1"}
    want = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )

    async def go() -> list[RoutedRequest | None]:
        return [
            await router._request((chat,), {}, "r1"),
            await router._request((chat,), {}, "r1"),  # a retry: not rendered again
            await router._request(({"prompt": "w5 w6"},), {}, "r2"),
            await router._request(({"prompt": [3, 4, 5]},), {}, "r3"),  # ids given: no render
            await router._request(({"prompt": ["w1", "w2"]},), {}, "r4"),
            await router._request(({"other": 1},), {}, "r5"),
        ]

    first, again, text, ids, batch, neither = asyncio.run(go())
    assert first is not None and list(first.tokens) == want and first.session == "s1"
    assert first.scope.salt is not None and again == first
    assert text is not None and list(text.tokens) == [1, FIRST_WORD + 5, FIRST_WORD + 6]
    assert ids is not None and ids.tokens == (3, 4, 5)
    assert batch is None and neither is None
    counts = router.ranker.counters
    assert counts["rendered"] == 2 and counts["unrendered"] == 1 and counts["unrendered_batch"] == 1
    assert counts["render_us_total"] > 0
    exported = {dict(tags)["outcome"]: v for tags, v in rec.named("raykv_router_renders").items()}
    assert exported == {"rendered": 2, "unrendered": 1}
    assert len([v for name, _, v in rec.observed if name == "raykv_router_render_seconds"]) == 2


def test_a_render_past_its_budget_or_a_failed_tokenizer_routes_by_load() -> None:
    def slow(_: str) -> PromptRenderer:
        import time

        time.sleep(1.0)
        raise OSError("no tokenizer in the model directory")

    tokens = RequestTokens("model-dir", budget_s=0.05, loader=slow)
    request = {"messages": [{"role": "user", "content": "w1"}]}
    assert asyncio.run(tokens.tokens(request)) is None and tokens.counters["render_timeouts"] == 1
    tokens.budget_s = 5.0
    assert asyncio.run(tokens.tokens(request)) is None and tokens.counters["render_errors"] == 1
    assert RequestTokens(None).counters == collections.Counter()
    tokens.close()


def test_renderable_requests_and_the_tokenizer_source() -> None:
    assert renderable(({"messages": []},), {}) == {"messages": []}
    assert renderable((), {"request": {"prompt": "text"}}) == {"prompt": "text"}
    assert renderable(({"prompt": [1, 2]},), {}) is None
    loading = SimpleNamespace(model_source="/models/a", tokenizer_source=None)
    assert tokenizer_source(SimpleNamespace(model_loading_config=loading)) == "/models/a"
    loading.tokenizer_source = "/tokenizers/a"
    assert tokenizer_source(SimpleNamespace(model_loading_config=loading)) == "/tokenizers/a"

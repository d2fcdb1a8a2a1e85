"""Token ids of OpenAI chat and text requests, rendered as vLLM renders them (pure; no ray).

A router keys a request by the token ids its engine will see. :class:`PromptRenderer` turns

- a ``/v1/chat/completions`` request's ``messages`` into ids the way vLLM 0.32's chat renderer
  does: the tokenizer's chat template (or the request's ``chat_template``) applied with
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` and ``tools``,
  the text tokenized with the request's ``add_special_tokens`` (False by default: the template
  writes the special tokens itself); message content given as text parts is joined with newlines;
- a ``/v1/completions`` text ``prompt`` (a str, or a batch of one) into
  ``tokenizer(prompt, add_special_tokens=...)`` (True by default), as vLLM tokenizes it.

Anything else it cannot render the same way (images or other non-text parts, a template error,
a batch of several prompts) raises :class:`Unrenderable`; the caller routes such a request by
load.

Prefix reuse: a multi-turn conversation re-sends its history, so most of a rendered prompt was
tokenized for the previous turn. Text splits cleanly at a special token (the tokenizer splits
added tokens out before anything else), so the renderer remembers, per rendered prompt, the ids
of its text up to the end of its last special token, and a later prompt whose text starts with
one of those texts tokenizes only the rest. Whether the tokenizer really splits this way is
checked when the renderer is built (a probe text, whole against split) and again on a sample of
reuses (every ``verify_every``-th, and the first few); a mismatch turns reuse off for good and is
logged. Thread-safe; ``stats`` counts rendered prompts, reused and tokenized characters, seconds.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

CACHE_CHARS = 32 << 20
"""Characters of rendered text kept for prefix reuse (least recently used first out)."""
TAIL = 64  # characters of a remembered text's end that find it (with its length)


class Unrenderable(ValueError):
    """The request cannot be rendered to the engine's token ids here (the reason is the
    message's first word: ``multimodal``, ``template``, ``batch``, ``kind``)."""


def _get(source: Any, name: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        return source.get(name, default)
    value = getattr(source, name, default)
    if value is default:  # a pydantic model's extra fields
        extra = getattr(source, "model_extra", None) or {}
        value = extra.get(name, default)
    return value


def _plain(value: Any) -> Any:
    """``value`` as plain dicts and lists (pydantic models dumped)."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def conversation(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI ``messages`` as the chat template sees them (vLLM's "string" content format): text
    parts joined with newlines; Unrenderable for a non-text part."""
    out = []
    for message in messages:
        m = dict(_plain(message))
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise Unrenderable(f"multimodal: a {kind} part")
                texts.append(str(part.get("text", "")))
            m["content"] = "\n".join(texts)
        out.append(m)
    return out


class PromptRenderer:
    """Renders requests for one tokenizer (module docstring). ``tokenizer``: a transformers
    tokenizer (fast ones give prefix reuse; others are rendered whole)."""

    def __init__(self, tokenizer: Any, cache_chars: int = CACHE_CHARS, verify_every: int = 64) -> None:
        self.tokenizer = tokenizer
        self.cache_chars = cache_chars
        self.verify_every = max(1, verify_every)
        # (add_special_tokens, length, last TAIL characters) -> (the text, its ids)
        self._cache: collections.OrderedDict[tuple[bool, int, str], tuple[str, tuple[int, ...]]] = (
            collections.OrderedDict()
        )
        self._chars = 0
        self._lock = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()
        specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", ())]
        specials = sorted({t for t in specials if t}, key=len, reverse=True)
        self._boundary = re.compile("|".join(re.escape(t) for t in specials)) if specials else None
        self.reuse = self._boundary is not None and self._splits_cleanly(specials)

    @classmethod
    def from_pretrained(cls, source: str, **kwargs: Any) -> PromptRenderer:
        """The renderer of the tokenizer in ``source`` (a model directory or hub name, as vLLM
        loads it: ``transformers.AutoTokenizer``). Raises what transformers raises."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(source), **kwargs)

    # ---- requests --------------------------------------------------------------------------------
    def request(self, request: Any) -> list[int]:
        """The prompt token ids of an OpenAI request (a pydantic request of vLLM or a mapping):
        chat ``messages`` or a text ``prompt``. Unrenderable when neither renders (module
        docstring)."""
        messages = _get(request, "messages")
        if messages is not None:
            return self.chat(
                messages,
                add_generation_prompt=bool(_get(request, "add_generation_prompt", True)),
                continue_final_message=bool(_get(request, "continue_final_message", False)),
                chat_template=_get(request, "chat_template"),
                chat_template_kwargs=_get(request, "chat_template_kwargs"),
                tools=_get(request, "tools"),
                add_special_tokens=bool(_get(request, "add_special_tokens", False)),
            )
        prompt = _get(request, "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.text(prompt, bool(_get(request, "add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            raise Unrenderable(f"batch: {len(prompt)} prompts in one request")
        raise Unrenderable("kind: neither chat messages nor a text prompt")

    def chat(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a chat (module docstring). Unrenderable for non-text content or when the
        template fails."""
        kwargs = dict(chat_template_kwargs or {})
        kwargs["add_generation_prompt"] = add_generation_prompt
        kwargs["continue_final_message"] = continue_final_message
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools:
            kwargs["tools"] = _plain(list(tools))
        try:
            text = self.tokenizer.apply_chat_template(conversation(messages), tokenize=False, **kwargs)
        except Unrenderable:
            raise
        except Exception as exc:
            raise Unrenderable(f"template: {type(exc).__name__}: {exc}") from None
        return self.text(str(text), add_special_tokens)

    def text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer(text, add_special_tokens=...)``'s ids, reusing a remembered prefix."""
        start = time.perf_counter()
        head, ids = self._longest_prefix(text, add_special_tokens) if self.reuse else (0, ())
        if head:
            rest = self._encode(text[head:], False)
            out = list(ids) + rest
            if self._should_verify() and out != self._encode(text, add_special_tokens):
                self.reuse = False
                log.warning("raykv: prefix reuse changed a prompt's token ids; reuse is off")
                out = self._encode(text, add_special_tokens)
        else:
            out = self._encode(text, add_special_tokens)
        self._remember(text, add_special_tokens, head, out)
        with self._lock:
            self.stats["rendered"] += 1
            self.stats["reused_chars"] += head
            self.stats["tokenized_chars"] += len(text) - head
            self.stats["render_us"] += int((time.perf_counter() - start) * 1e6)
        return out

    # ---- prefix reuse ----------------------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _ends(self, text: str) -> list[int]:
        assert self._boundary is not None
        return [m.end() for m in self._boundary.finditer(text)]

    def _longest_prefix(self, text: str, special: bool) -> tuple[int, tuple[int, ...]]:
        """(characters, ids) of the longest remembered text that ``text`` starts with, ending at
        one of ``text``'s special tokens; (0, ()) when none. A candidate is found by its length
        and last characters (no copy of the prefix), then compared in place."""
        ends = self._ends(text)
        with self._lock:
            for end in reversed(ends[-64:]):
                key = (special, end, text[max(0, end - TAIL) : end])
                entry = self._cache.get(key)
                if entry is not None and text.startswith(entry[0]):
                    self._cache.move_to_end(key)
                    return end, entry[1]
        return 0, ()

    def _remember(self, text: str, special: bool, head: int, ids: list[int]) -> None:
        """Remember the ids of ``text`` up to its last special token (found past ``head``)."""
        if not self.reuse:
            return
        ends = self._ends(text)
        end = ends[-1] if ends else 0
        if end <= head or end > self.cache_chars:
            return
        count = len(ids) - (len(self._encode(text[end:], False)) if end < len(text) else 0)
        key = (special, end, text[max(0, end - TAIL) : end])
        with self._lock:
            if key in self._cache and self._cache[key][0] == text[:end]:
                return
            self._cache[key] = (text[:end], tuple(ids[:count]))
            self._chars += end
            while self._chars > self.cache_chars and self._cache:
                _, (old, _ids) = self._cache.popitem(last=False)
                self._chars -= len(old)

    def _should_verify(self) -> bool:
        with self._lock:
            self.stats["reuses"] += 1
            n = self.stats["reuses"]
        return n <= 4 or n % self.verify_every == 0

    def _splits_cleanly(self, specials: Sequence[str]) -> bool:
        """Whether tokenizing a probe text whole equals tokenizing it in two parts split after a
        special token (with and without the tokenizer's own special tokens added)."""
        mark = specials[-1]
        head = f"a b{mark}"
        tail = " c d. e"
        try:
            for special in (False, True):
                whole = self._encode(head + tail, special)
                if whole != self._encode(head, special) + self._encode(tail, False):
                    return False
        except Exception:
            return False
        return True

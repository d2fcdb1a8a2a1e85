"""A small word-level tokenizer with a chat template, made locally (no download): what the
tests, ``raykv bench serve`` and the replay's chat family serve beside random-weight models.

Words ``w0`` .. ``w{n-1}`` are ids ``FIRST_WORD`` .. ; the special tokens come first. The chat
template is a plain role-tagged one (``<|system|>``, ``<|user|>``, ``<|assistant|>``, each message
ended by ``<|end|>``), with ``add_generation_prompt`` opening an assistant turn, as real
instruction-tuned models' templates do. ``transformers`` and ``tokenizers`` are imported inside
functions only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

SPECIAL = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
FIRST_WORD = len(SPECIAL)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_chat_tokenizer(vocab_size: int = 512) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` over ``vocab_size`` ids (special tokens, then
    words ``w0``, ``w1``, ...), whitespace pre-tokenized, with :data:`CHAT_TEMPLATE`; a BOS is added
    to plain text (``add_special_tokens``), as Llama's tokenizer does. ValueError for a vocab
    that leaves no word."""
    if vocab_size <= FIRST_WORD:
        raise ValueError(f"vocab_size must exceed {FIRST_WORD}, got {vocab_size}")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": FIRST_WORD + i for i in range(vocab_size - FIRST_WORD)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(SPECIAL[3:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_chat_tokenizer(path: str, vocab_size: int = 512) -> str:
    """Write :func:`build_chat_tokenizer` beside a model in ``path`` (unless a tokenizer is already
    there); returns ``path``."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        build_chat_tokenizer(vocab_size).save_pretrained(path)
    return path


def words(ids: Iterable[int]) -> str:
    """The text whose words tokenize to ``ids`` (word ids only: each ``>= FIRST_WORD``)."""
    return " ".join(f"w{i - FIRST_WORD}" for i in ids)

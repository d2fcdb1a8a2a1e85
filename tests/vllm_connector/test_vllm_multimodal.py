"""Multimodal requests get multimodal block keys: real vLLM ``Request`` objects carrying image
features (``MultiModalFeatureSpec`` with a ``PlaceholderRange``, as vLLM 0.32's input processor
builds them) go through raykv's SchedulerSide with a fake deployment link, and the keys its
lookup asks the link about are checked: blocks overlapping an image are keyed by the image's
identifier, blocks before it by their tokens only.

Then a real engine: a tiny random-weight BLIP-2 (its language model is the tests' tiny Llama, so
the session's deployment fits it; LLaVA, PaliGemma and the Qwen-VL models need torchvision,
which the test environment removes, README) built locally with a word-level tokenizer. Its 64
image placeholders open the prompt (blocks 0 and 1), so a different image changes every block.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import ray
from vllm import SamplingParams
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from raykv import InvalidArgumentError, KVLayout, ReuseScope, block_keys
from raykv.integrations.vllm.link import Match
from raykv.integrations.vllm.multimodal import feature_digest, mm_items
from raykv.integrations.vllm.scheduler import SchedulerSide

from .helpers import worker

TPB = 4
LAYOUT = KVLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=TPB, dtype="float32")
IMAGE_TOKEN = 7
# 2 text blocks, an image of 6 placeholders (tokens 8..13: blocks 2 and 3), text to 26 tokens:
# 6 full blocks and 2 tokens, 6 usable blocks
PROMPT = [1, 2, 3, 4, 5, 6, 8, 9] + [IMAGE_TOKEN] * 6 + list(range(20, 32))
IMAGE_AT, IMAGE_LEN = 8, 6


class KeyLink:
    """A DeploymentLink that records the keys of each lookup and holds nothing."""

    worker = "w0"
    layout = LAYOUT
    timeout_s = 10.0

    def __init__(self) -> None:
        self.looked_up: list[list[bytes]] = []

    def engine_link(self, inbox_bytes: int, listen_host: str) -> Any:
        return None

    def lookup(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        hint: Mapping[str, Any],
        mm_items: Sequence[Any] = (),
    ) -> Match:
        self.looked_up.append(list(keys))
        return Match(0)

    def poll(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def _feature(identifier: str, offset: int = IMAGE_AT, length: int = IMAGE_LEN) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,  # what the engine core gets for an item its processor cache holds
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
        mm_hash=identifier,
    )


def _request(req_id: str, *features: MultiModalFeatureSpec, prompt: list[int] = PROMPT) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=list(features),
    )


def _keys(request: Request) -> list[bytes]:
    """The keys the SchedulerSide's lookup of ``request`` asks the deployment about."""
    link = KeyLink()
    side = SchedulerSide(LAYOUT, link)  # type: ignore[arg-type]
    assert side.lookup(request, 0) == (0, False)
    assert len(link.looked_up) == 1
    return link.looked_up[0]


def test_different_images_differ_from_their_first_block_on() -> None:
    a = _keys(_request("a", _feature("image-a")))
    b = _keys(_request("b", _feature("image-b")))
    assert len(a) == len(b) == (len(PROMPT) - 1) // TPB == 6
    first = IMAGE_AT // TPB  # the first block overlapping the image
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))  # the chain carries it on
    text = [bytes(k) for k in block_keys(PROMPT, TPB)]
    assert a[:first] == text[:first]
    assert all(x != y for x, y in zip(a[first:], text[first:]))


def test_the_same_image_gives_the_same_keys() -> None:
    assert _keys(_request("a", _feature("image-a"))) == _keys(_request("b", _feature("image-a")))


def test_a_text_only_requests_keys_are_the_text_keys() -> None:
    request = _request("t")
    assert request.mm_features == []
    assert _keys(request) == [bytes(k) for k in block_keys(PROMPT, TPB, ReuseScope())][:6]
    assert mm_items(request, len(PROMPT)) == ()


def test_items_carry_the_placeholder_range_and_a_digest_of_modality_and_identifier() -> None:
    request = _request("a", _feature("image-b", 20, 2), _feature("image-a"))  # sorted by start
    items = mm_items(request, len(PROMPT))
    assert [(it.start, it.length) for it in items] == [(IMAGE_AT, IMAGE_LEN), (20, 2)]
    assert items[0].digest == feature_digest("image", "image-a")
    assert feature_digest("audio", "image-a") != items[0].digest
    keys = [bytes(k) for k in block_keys(PROMPT, TPB, None, items)]
    assert _keys(request) == keys[:6]


def test_an_image_reaching_into_the_partial_last_block_is_accepted() -> None:
    request = _request("a", _feature("image-a", 24, 2))  # tokens 24..25: past the last full block
    assert _keys(request) == [bytes(k) for k in block_keys(PROMPT, TPB)][:6]


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ((_feature("image-a", 20, 10),), "outside the prompt"),
        ((_feature("image-a", 8, 6), _feature("image-b", 12, 4)), "overlap"),
        ((_feature("", 8, 6),), "identifier"),
    ],
)
def test_bad_features_are_refused(features: tuple[MultiModalFeatureSpec, ...], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        mm_items(_request("x", *features), len(PROMPT))
    side = SchedulerSide(LAYOUT, KeyLink())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=message):
        side.lookup(_request("y", *features), 0)


# ---- a real engine -------------------------------------------------------------------------------
IMAGE_TOKENS = 64  # BLIP-2's query tokens: the placeholders of one image, at the prompt's start
WORDS = 79  # text tokens after them: a 143-token prompt, 4 full blocks of 32 (all usable)


def _save_tiny_blip2(path: str) -> str:
    """A random-weight Blip2ForConditionalGeneration whose language model is the tests' tiny Llama
    (testing.MODEL_FIELDS), with a word-level tokenizer (``t0`` .. ``t499``, ``<image>``) and a
    112x112 BlipImageProcessor: 64 image tokens per image."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )

    from raykv.integrations.vllm import testing

    vocab = {f"t{i}": i for i in range(500)}
    vocab.update({"<unk>": 500, "<s>": 501, "</s>": 502, "<pad>": 503, "<image>": 505})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    vision = Blip2VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=112
    )
    qformer = Blip2QFormerConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        encoder_hidden_size=64,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=LlamaConfig(**testing.MODEL_FIELDS).to_dict(),
        num_query_tokens=IMAGE_TOKENS,
        image_token_index=vocab["<image>"],
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Blip2ForConditionalGeneration(config).eval().save_pretrained(path)
    image_processor = BlipImageProcessor(size={"height": 112, "width": 112})
    Blip2Processor(image_processor, tokenizer, num_query_tokens=IMAGE_TOKENS).save_pretrained(path)
    return path


def _image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def mm_engine(tmp_path_factory: pytest.TempPathFactory, deployment: Any, ray_address: str) -> Iterator[Any]:
    """The BLIP-2 engine with the connector (kv_both, paired with worker 0)."""
    from vllm import LLM

    from raykv.integrations.vllm import testing

    model = _save_tiny_blip2(str(tmp_path_factory.mktemp("tiny-blip2")))
    saved = testing.pin_engine_threads()
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    kwargs = testing.engine_kwargs(model, skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1})
    kwargs["kv_transfer_config"] = testing.connector_config(deployment.namespace, ray_address, worker=0)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        testing.shutdown_engine(llm)
        testing.restore_env(saved)
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline


def _run(llm: Any, image_seed: int, cache_salt: str) -> Any:
    """One greedy request: the fixed text after an image drawn from ``image_seed``."""
    from vllm import SamplingParams

    from raykv.integrations.vllm.testing import Result

    text = " ".join(f"t{i}" for i in range(1, WORDS + 1))
    request = {"prompt": text, "multi_modal_data": {"image": _image(image_seed)}, "cache_salt": cache_salt}
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
    out = llm.generate([request], params, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == IMAGE_TOKENS + WORDS
    done = out.outputs[0]
    steps = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in done.logprobs or ())
    raykv = (out.kv_transfer_params or {}).get("raykv", {})
    return Result(tuple(done.token_ids), steps, raykv, int(out.num_cached_tokens or 0))


def _stored(deployment: Any, llm: Any, image_seed: int, cache_salt: str, blocks: int = 4) -> Any:
    """:func:`_run`, then wait until worker 0 imported the ``blocks`` new blocks it stores (counted
    whatever their keys: the connector's scope includes the engine's model fingerprint)."""
    handle = worker(deployment, 0)
    before = ray.get(handle.stats.remote(), timeout=30).imported_blocks
    result = _run(llm, image_seed, cache_salt)
    deadline = time.monotonic() + 30
    while ray.get(handle.stats.remote(), timeout=30).imported_blocks < before + blocks:
        assert time.monotonic() < deadline, "the request's blocks never reached worker 0"
        time.sleep(0.05)
    return result


def _same(got: Any, want: Any) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs


@pytest.mark.timeout(600)
def test_an_engine_reuses_an_images_blocks_only_for_the_same_image(mm_engine: Any, deployment: Any) -> None:
    """Same text, another image: nothing of the first image's blocks is looked up as held or
    loaded, and the output is a full compute's (the same request alone in a fresh cache_salt,
    where nothing can match: what an engine without the connector computes). The first image
    again: its 4 blocks are loaded and the output is the first run's, bit for bit. (Keyed by
    tokens only, the second image's request loaded the first's KV and generated its tokens.)"""
    salt = f"mm-{uuid.uuid4().hex}"
    reference_b = _stored(deployment, mm_engine, 2, f"fresh-{uuid.uuid4().hex}")
    assert reference_b.cached_tokens == 0 and reference_b.raykv.get("hit_blocks", 0) == 0

    first = _stored(deployment, mm_engine, 1, salt)
    assert first.cached_tokens == 0
    assert first.tokens != reference_b.tokens  # the image decides the output

    other = _run(mm_engine, 2, salt)
    assert other.cached_tokens == 0
    assert other.raykv.get("hit_blocks", 0) == 0 and other.raykv.get("loaded_blocks", 0) == 0
    _same(other, reference_b)

    again = _run(mm_engine, 1, salt)
    assert again.cached_tokens == 4 * 32
    assert again.raykv["hit_blocks"] == 4 and again.raykv.get("load_errors", 0) == 0
    _same(again, first)

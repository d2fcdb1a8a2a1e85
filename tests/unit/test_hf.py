"""The Hugging Face adapter with a tiny random-weight Llama: KV reused from raykv (kept, demoted
to disk and promoted back, or transferred to another manager) gives exactly the tokens and final
logits of a full recompute (float32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from deps import require

torch = require("torch")
require("transformers")

from raykv import (  # noqa: E402
    CacheConfig,
    CacheManager,
    InvalidArgumentError,
    KVLayout,
    ReuseScope,
    TierConfig,
    TierKind,
)
from raykv.integrations.hf import (  # noqa: E402
    HFKVAdapter,
    generate,
    generate_from_blocks,
    greedy_generate,
    kv_layout,
    reusable_keys,
    tiny_llama,
)

TPB = 8
NEW = 5


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def layout(model) -> KVLayout:
    return kv_layout(model.config, TPB)


def manager(layout: KVLayout, host_pages: int = 64, disk_pages: int = 0) -> CacheManager:
    page = layout.page_bytes
    tiers = [TierConfig.host(host_pages * page, pin_memory=False)]
    if disk_pages:
        tiers.append(TierConfig.disk(disk_pages * page))
    return CacheManager(CacheConfig(layout, tuple(tiers)))


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def assert_same(got, want) -> None:
    """Same generated tokens and bit-identical final logits."""
    assert got.tokens == want.tokens
    assert got.logits.dtype == np.float32 and got.logits.shape == want.logits.shape
    assert np.array_equal(got.logits, want.logits)


def recompute(model, tokens: list[int]):
    return greedy_generate(model, tokens, NEW, TPB)


def test_layout_follows_the_model_config(model, layout) -> None:
    assert len(layout.layers) == model.config.num_hidden_layers
    k = layout.buffer_region(0, "k").spec
    assert k.shape == (2, 16) and k.dtype == "float32"  # 2 KV heads x head_dim 64/4
    assert layout.page_bytes == 2 * 2 * TPB * 2 * 16 * 4
    with pytest.raises(InvalidArgumentError):
        kv_layout(model.config, TPB, dtype="int8")
    # one rank's heads under tensor parallelism: 2 heads over 2 ranks, replicated over 4
    for ranks, heads in ((1, 2), (2, 1), (4, 1)):
        assert kv_layout(model.config, TPB, tensor_parallel_size=ranks).buffer_region(0, "k").spec.shape == (
            heads,
            16,
        )
    for bad in (3, 0):
        with pytest.raises(InvalidArgumentError):
            kv_layout(model.config, TPB, tensor_parallel_size=bad)
    odd = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=TPB, dtype="int8")
    with pytest.raises(InvalidArgumentError):
        HFKVAdapter(odd)


def test_chunked_recompute_matches_transformers_generate(model) -> None:
    tokens = prompt(1, 45)
    ours = recompute(model, tokens)
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([tokens]),
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert list(ours.tokens) == ref.sequences[0, len(tokens) :].tolist()
    np.testing.assert_allclose(ours.logits, ref.logits[-1][0].numpy(), atol=1e-5)


def test_pages_hold_the_model_kv_block_by_block(model, layout) -> None:
    tokens = prompt(2, 3 * TPB + 3)
    with manager(layout) as mgr:
        gen = generate(model, mgr, tokens, NEW)
        assert gen.reused_tokens == 0 and gen.stored_blocks == 3
        (block,) = mgr.export_blocks(reusable_keys(tokens, TPB)[1:2])
        page = np.frombuffer(block.data, dtype=np.uint8)
        region = layout.buffer_region(1, "v")
        stored = page[region.offset : region.offset + region.nbytes].view(np.float32).reshape(TPB, 2, 16)
        want = gen.cache.layers[1].values[0, :, TPB : 2 * TPB, :].transpose(0, 1).numpy()
        assert np.array_equal(stored, want)


def test_reused_prefix_equals_full_recompute(model, layout) -> None:
    shared = prompt(3, 5 * TPB)
    first, second = shared + prompt(4, 11), shared + prompt(5, 6)
    with manager(layout) as mgr:
        g1 = generate(model, mgr, first, NEW)
        assert_same(g1, recompute(model, first))
        g2 = generate(model, mgr, second, NEW)
        assert g2.reused_tokens == 5 * TPB
        assert_same(g2, recompute(model, second))
        again = generate(model, mgr, first, NEW)  # the whole first prompt but its last token
        assert again.reused_tokens == (len(first) - 1) // TPB * TPB and again.stored_blocks == 0
        assert_same(again, g1)
        mgr.check_invariants()


def test_prompt_of_whole_blocks_recomputes_its_last_block(model, layout) -> None:
    tokens = prompt(6, 4 * TPB)
    with manager(layout) as mgr:
        assert generate(model, mgr, tokens, NEW).stored_blocks == 4
        again = generate(model, mgr, tokens, NEW)
        assert again.reused_tokens == 3 * TPB
        assert_same(again, recompute(model, tokens))


def test_demoted_then_promoted_prefix_equals_full_recompute(model, layout) -> None:
    shared = prompt(7, 4 * TPB)
    with manager(layout, host_pages=8, disk_pages=64) as mgr:
        generate(model, mgr, [*shared, 1, 2, 3], NEW)
        for seed in range(10, 14):  # unrelated traffic pushes the shared blocks down to disk
            generate(model, mgr, prompt(seed, 6 * TPB + 1), NEW)
        keys = reusable_keys([*shared, 0], TPB)
        assert mgr.probe(keys=keys).tiers == (TierKind.DISK,) * 4
        tokens = shared + prompt(8, 9)
        gen = generate(model, mgr, tokens, NEW)
        assert gen.reused_tokens == 4 * TPB
        assert_same(gen, recompute(model, tokens))
        assert mgr.probe(keys=keys).tiers == (TierKind.HOST,) * 4  # promoted on reuse
        mgr.check_invariants()


def test_transferred_prefix_equals_full_recompute(model, layout) -> None:
    scope = ReuseScope.from_cache_salt("tenant-a", lora_id=3)
    shared = prompt(9, 6 * TPB)
    with manager(layout) as src, manager(layout) as dst:
        generate(model, src, [*shared, 5], NEW, scope=scope)
        keys = reusable_keys([*shared, 5], TPB, scope)
        assert len(dst.import_blocks(src.export_blocks(keys)).imported) == 6
        tokens = shared + prompt(10, 7)
        assert generate(model, dst, tokens, NEW).reused_tokens == 0  # another scope: no reuse
        gen = generate(model, dst, tokens, NEW, scope=scope)
        assert gen.reused_tokens == 6 * TPB
        assert_same(gen, recompute(model, tokens))
        dst.check_invariants()


def test_generation_over_exported_blocks_and_storing_its_output(model, layout) -> None:
    adapter = HFKVAdapter(layout)
    shared = prompt(11, 3 * TPB)
    tokens = shared + prompt(12, 2 * TPB + 2)
    with manager(layout) as worker:
        generate(model, worker, [*shared, 7], NEW)
        fetched = worker.export_blocks(reusable_keys(tokens, TPB))
        gen, new = generate_from_blocks(model, adapter, tokens, NEW, fetched)
        assert gen.reused_tokens == 3 * TPB and len(new) == 2
        assert_same(gen, recompute(model, tokens))
        assert len(worker.import_blocks(new).imported) == 2  # parents are the reused blocks
        assert_same(generate(model, worker, tokens, NEW), gen)
        with manager(layout) as empty:
            gen0, new0 = generate_from_blocks(model, adapter, tokens, NEW, [])
            assert gen0.reused_tokens == 0 and len(new0) == 5
            assert len(empty.import_blocks(new0).imported) == 5
            assert_same(generate(model, empty, tokens, NEW), gen)


def test_a_full_cache_never_fails_generation(model, layout) -> None:
    tokens = prompt(13, 6 * TPB)
    with manager(layout, host_pages=2) as mgr:
        gen = generate(model, mgr, tokens, NEW)
        assert gen.stored_blocks == 0
        assert_same(gen, recompute(model, tokens))
        mgr.check_invariants()


def test_storing_generated_tokens_lets_the_next_turn_reuse_them(model, layout) -> None:
    turn1 = prompt(14, 2 * TPB + 3)
    with manager(layout) as mgr:
        g1 = generate(model, mgr, turn1, 2 * TPB, store_generated=True)
        assert g1.stored_blocks == (len(turn1) + 2 * TPB - 1) // TPB
        turn2 = turn1 + list(g1.tokens) + prompt(15, 4)
        g2 = generate(model, mgr, turn2, NEW)
        assert g2.reused_tokens == g1.stored_blocks * TPB
        # decode-step KV differs from a prefill of the same tokens in the last bits only
        np.testing.assert_allclose(g2.logits, recompute(model, turn2).logits, atol=1e-4)


def test_bad_arguments_are_rejected(model, layout) -> None:
    with pytest.raises(InvalidArgumentError):
        greedy_generate(model, [1, 2, 3], 0, TPB)
    with pytest.raises(InvalidArgumentError):
        greedy_generate(model, [1, 2, 3], 1, TPB, start=3)
    adapter = HFKVAdapter(layout)
    short = greedy_generate(model, prompt(16, 5), 1, TPB)
    with pytest.raises(InvalidArgumentError):
        adapter.export(short.cache, reusable_keys(prompt(16, 20), TPB), ReuseScope().root_key(), 0, 1)
    other = KVLayout.uniform(num_layers=2, num_kv_heads=4, head_dim=16, tokens_per_block=TPB, dtype="float32")
    with manager(other) as mgr, pytest.raises(InvalidArgumentError):
        generate(model, mgr, prompt(17, 3 * TPB), 1)


def test_torch_page_views_round_trip_like_numpy_ones(model, layout) -> None:
    """A GPU top tier hands out torch uint8 pages; the adapter treats them like host pages."""
    adapter = HFKVAdapter(layout)
    gen = greedy_generate(model, prompt(18, 3 * TPB + 1), 1, TPB)
    as_torch = torch.zeros(3, layout.page_bytes, dtype=torch.uint8)
    as_numpy = np.zeros((3, layout.page_bytes), dtype=np.uint8)
    adapter.write_pages(gen.cache, list(as_torch), 0)
    adapter.write_pages(gen.cache, list(as_numpy), 0)
    assert np.array_equal(as_torch.numpy(), as_numpy)
    back = adapter.read_pages(list(as_torch))
    for i in range(len(layout.layers)):
        assert torch.equal(back.layers[i].keys, gen.cache.layers[i].keys[:, :, : 3 * TPB])
        assert torch.equal(back.layers[i].values, gen.cache.layers[i].values[:, :, : 3 * TPB])

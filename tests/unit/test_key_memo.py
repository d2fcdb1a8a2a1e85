"""raykv.native._chain.KeyMemo and SessionKeys over it: the keys block_keys gives, whatever the memo
holds (hits, misses, evictions, colliding buckets), and the same errors for bad token ids."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from raykv import native
from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import ReuseScope, block_keys
from raykv.routing.session_keys import SessionKeys

compiled = pytest.mark.skipif(native.load("_chain") is None, reason="raykv.native._chain was not built")
TPB = 16


def _prompts(seed: int, count: int) -> list[np.ndarray]:
    """Prompts that share prefixes (a system prompt, documents, earlier turns) and diverge."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 2**31 - 1, 3 * TPB + 5).astype(np.uint32)
    docs = [rng.integers(0, 2**31 - 1, int(rng.integers(1, 12)) * TPB).astype(np.uint32) for _ in range(4)]
    out, history = [], system
    for _ in range(count):
        kind = rng.integers(0, 3)
        if kind == 0:
            history = np.concatenate([history, rng.integers(0, 2**31 - 1, int(rng.integers(0, 40)))]).astype(
                np.uint32
            )
            out.append(history)
        elif kind == 1:
            doc = docs[int(rng.integers(0, len(docs)))]
            out.append(
                np.concatenate([system, doc, rng.integers(0, 50, int(rng.integers(0, 30)))]).astype(np.uint32)
            )
        else:
            edited = history.copy()
            if len(edited):
                edited[int(rng.integers(0, len(edited)))] ^= 1  # one token changed: its block on differs
            out.append(edited)
    return out


@compiled
@pytest.mark.parametrize("slots", [2, 8, 1 << 12])
def test_memo_keys_equal_block_keys_through_hits_misses_and_evictions(slots):
    memo = native.load("_chain").KeyMemo(TPB, slots, hashlib.sha256)
    scopes = [ReuseScope(), ReuseScope(salt=7), ReuseScope(lora_id=0)]
    for i, tokens in enumerate(_prompts(slots, 150)):
        scope = scopes[i % 3]
        assert memo.chain(scope.root_key(), tokens, 0) == block_keys(tokens, TPB, scope)
    assert memo.misses > 0 and (memo.hits > 0 if slots > 8 else True)
    tokens = _prompts(1, 1)[0]
    keys = block_keys(tokens, TPB)
    assert memo.chain(keys[1], tokens, 2) == keys[2:]  # from a later block, chained from its parent
    assert memo.chain(keys[0], tokens[: TPB - 1], 0) == []  # no full block


@compiled
def test_colliding_buckets_never_lend_a_key():
    """Blocks that share the sampled tokens but differ elsewhere, or share every token under
    another parent, get their own keys."""
    memo = native.load("_chain").KeyMemo(TPB, 2, hashlib.sha256)  # one bucket: everything collides
    root = ReuseScope().root_key()
    base = np.arange(TPB, dtype=np.uint32)
    for pos in range(1, TPB - 1):
        if pos == TPB // 2:
            continue
        variant = base.copy()
        variant[pos] += 1000
        assert memo.chain(root, variant, 0) == block_keys(variant, TPB)
        assert memo.chain(root, base, 0) == block_keys(base, TPB)
    for scope in (ReuseScope(salt=1), ReuseScope(), ReuseScope(lora_id=3), ReuseScope(salt=1)):
        assert memo.chain(scope.root_key(), base, 0) == block_keys(base, TPB, scope)  # same tokens


@compiled
def test_bad_ids_raise_wherever_they_are():
    memo = native.load("_chain").KeyMemo(TPB, 64, hashlib.sha256)
    root = ReuseScope().root_key()
    good = np.arange(3 * TPB + 4, dtype=np.uint32)
    memo.chain(root, good, 0)
    for pos in (0, TPB + 3, 3 * TPB + 1):  # a hashed block, a block after a hit, the partial tail
        bad = good.copy()
        bad[pos] = 2**31
        with pytest.raises(ValueError):
            memo.chain(root, bad, 0)
    with pytest.raises(ValueError):
        memo.chain(root[:31], good, 0)
    with pytest.raises(ValueError):
        native.load("_chain").KeyMemo(TPB, 6, hashlib.sha256)  # not a power of two


@pytest.mark.parametrize("memo_bytes", [0, 1 << 16])
def test_session_keys_give_block_keys_with_and_without_the_memo(memo_bytes):
    keys = SessionKeys(TPB, memo_bytes=memo_bytes)
    for i, tokens in enumerate(_prompts(3, 80)):
        scope = ReuseScope(salt=i % 2)
        given = tokens if i % 3 else tokens.tolist()  # arrays and lists give the same keys
        assert keys.keys(given, scope, session=i % 5 if i % 4 else None) == block_keys(tokens, TPB, scope)
    assert keys.reused_blocks > 0
    for bad in ([1, 2**31] * TPB, [-1] * TPB, np.full(TPB, 2**31, dtype=np.uint32), np.full(TPB, -1)):
        with pytest.raises(InvalidArgumentError):
            keys.keys(bad, None, session=1)


@compiled
def test_a_block_used_again_outlives_newer_ones_in_its_bucket():
    """One bucket of 8 slots: a hit makes a block the most recently used, so the next miss
    replaces the least recently used block, not it."""
    memo = native.load("_chain").KeyMemo(TPB, 8, hashlib.sha256)
    root = ReuseScope().root_key()
    blocks = [np.full(TPB, i, dtype=np.uint32) for i in range(10)]
    for b in blocks[:8]:
        memo.chain(root, b, 0)
    assert (memo.hits, memo.misses) == (0, 8)
    memo.chain(root, blocks[0], 0)  # a hit: block 0 is now the most recent, block 1 the oldest
    memo.chain(root, blocks[8], 0)  # a miss: replaces block 1
    assert (memo.hits, memo.misses) == (1, 9)
    assert memo.chain(root, blocks[0], 0) == block_keys(blocks[0], TPB)  # still held
    assert memo.hits == 2
    assert memo.chain(root, blocks[1], 0) == block_keys(blocks[1], TPB)  # gone: hashed again
    assert (memo.hits, memo.misses) == (2, 10)

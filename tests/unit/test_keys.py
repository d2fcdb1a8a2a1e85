"""Block keys: exact bytes (reference implementation from DESIGN.md), validation, multimodal
domain separation, prefix properties, independence from PYTHONHASHSEED."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.core.keys import MM_MARKER, MultimodalItem, ReuseScope, block_keys

REPO_ROOT = Path(__file__).resolve().parents[2]
U64_MAX = 2**64 - 1
MAX_TOKEN = 2**31 - 1


# ----------------------------------------------------------------------------- reference (DESIGN.md)
def ref_root(lora_id: int | None = None, salt: int | None = None) -> bytes:
    mask = (1 if lora_id is not None else 0) | (2 if salt is not None else 0)
    data = bytes([mask])
    for value in (lora_id, salt):
        if value is not None:
            data += value.to_bytes(8, "little")
    return hashlib.sha256(data).digest()


def ref_block_keys(tokens: list[int], tpb: int, root: bytes | None = None) -> list[bytes]:
    prev = ref_root() if root is None else root
    keys = []
    for b in range(len(tokens) // tpb):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[b * tpb : (b + 1) * tpb])
        prev = hashlib.sha256(prev + body).digest()
        keys.append(prev)
    return keys


def ref_mm_block_key(parent: bytes, tokens: list[int], start: int, items: list[MultimodalItem]) -> bytes:
    """The multimodal encoding documented in raykv/core/keys.py's module docstring."""
    body = MM_MARKER
    for i, tok in enumerate(tokens):
        pos = start + i
        item = next((it for it in items if it.start <= pos < it.start + it.length), None)
        if item is None:
            body += b"\x00" + tok.to_bytes(4, "little")
        else:
            body += b"\x01" + item.digest + (pos - item.start).to_bytes(4, "little")
    return hashlib.sha256(parent + body).digest()


def tokens_spelling(data: bytes) -> list[int]:
    assert len(data) % 4 == 0
    return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]


# ----------------------------------------------------------------------------- hard-coded vectors
ROOT_DEFAULT = "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
ROOT_LORA0 = "a536aa3cede6ea3c1f3e0357c3c60e0f216a8c89b853df13b29daa8f85065dfb"
ROOT_SALT0 = "4322fd2bc0a137d1375b37b3b2e2b4715b3d3dd7ca9682438d4fea0f8437fad3"
ROOT_L7_S11 = "9e22dbfea623bd030eb7ae4a0d71a7a6beb3cbf25797bcc31ddd0acc5513d3a3"
RANGE8_TPB4 = [
    "7b894451a88bc03088bd0c44f01139922b089a1ab691d157c273185c78ca83b2",
    "181684b4f09a9fc1689624a565bc5c9ed96cede3e0863cf373463b1a93c45369",
]


def test_hard_coded_roots():
    assert ReuseScope().root_key().hex() == ROOT_DEFAULT
    assert ReuseScope().root_key() == hashlib.sha256(b"\x00").digest()
    assert ReuseScope(lora_id=0).root_key().hex() == ROOT_LORA0
    assert ReuseScope(lora_id=0).root_key() == hashlib.sha256(b"\x01" + bytes(8)).digest()
    assert ReuseScope(salt=0).root_key().hex() == ROOT_SALT0
    assert ReuseScope(lora_id=7, salt=11).root_key().hex() == ROOT_L7_S11


def test_hard_coded_block_keys():
    keys = block_keys(list(range(8)), 4)
    assert [k.hex() for k in keys] == RANGE8_TPB4
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert block_keys(list(range(8)), 4, ReuseScope()) == keys


@pytest.mark.parametrize(
    "lora_id, salt",
    [(None, None), (0, None), (None, 0), (0, 0), (7, 11), (2**63, None), (None, U64_MAX), (U64_MAX, 2**63)],
)
def test_root_matches_reference(lora_id, salt):
    scope = ReuseScope(lora_id=lora_id, salt=salt)
    assert scope.root_key() == ref_root(lora_id, salt)


@pytest.mark.parametrize("tpb", [1, 3, 4, 16, 64])
@pytest.mark.parametrize("scope", [ReuseScope(), ReuseScope(lora_id=3), ReuseScope(5, U64_MAX)])
def test_block_keys_match_reference(tpb, scope):
    rng = np.random.default_rng(tpb)
    tokens = [int(t) for t in rng.integers(0, MAX_TOKEN + 1, size=5 * tpb + tpb // 2)]
    tokens[0] = MAX_TOKEN  # the largest id is valid
    expected = ref_block_keys(tokens, tpb, ref_root(scope.lora_id, scope.salt))
    assert block_keys(tokens, tpb, scope) == expected
    assert len(expected) == 5


# ----------------------------------------------------------------------------- scopes
def test_scope_full_u64_range_distinct():
    keys = {
        ReuseScope(salt=2**63).root_key(),
        ReuseScope(salt=U64_MAX).root_key(),
        ReuseScope(lora_id=2**63).root_key(),
        ReuseScope(lora_id=U64_MAX).root_key(),
    }
    assert len(keys) == 4
    toks = list(range(16))
    assert block_keys(toks, 4, ReuseScope(salt=2**63)) != block_keys(toks, 4, ReuseScope(salt=U64_MAX))
    assert block_keys(toks, 4, ReuseScope(lora_id=2**63)) != block_keys(toks, 4, ReuseScope(lora_id=U64_MAX))


def test_none_and_zero_scopes_distinct():
    scopes = [ReuseScope(), ReuseScope(lora_id=0), ReuseScope(salt=0), ReuseScope(0, 0), ReuseScope(7, 11)]
    roots = [s.root_key() for s in scopes]
    assert len(set(roots)) == len(scopes)
    first_blocks = [block_keys([1, 2, 3, 4], 4, s)[0] for s in scopes]
    assert len(set(first_blocks)) == len(scopes)
    # lora and salt are not interchangeable
    assert ReuseScope(lora_id=5).root_key() != ReuseScope(salt=5).root_key()
    assert ReuseScope(1, 2).root_key() != ReuseScope(2, 1).root_key()


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, True, False, 1.0, float("nan"), "1", b"\x01", [1]])
@pytest.mark.parametrize("field", ["lora_id", "salt"])
def test_scope_rejects_bad_fields(field, bad):
    with pytest.raises(ValueError):
        ReuseScope(**{field: bad})


def test_scope_frozen_hashable_equal_pickles():
    a, b = ReuseScope(7, 2**63 + 5), ReuseScope(lora_id=7, salt=2**63 + 5)
    assert a == b and hash(a) == hash(b)
    assert a != ReuseScope(7, 2**63 + 6)
    assert len({a, b, ReuseScope()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.salt = 1  # type: ignore[misc]
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        c = pickle.loads(pickle.dumps(a, protocol=proto))
        assert c == a and type(c) is ReuseScope
        assert c.root_key() == a.root_key()


@pytest.mark.parametrize("text", ["", "tenant-a", "ünïcødé ☃", "x" * 1000])
def test_from_cache_salt(text):
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    scope = ReuseScope.from_cache_salt(text)
    assert scope.salt == int.from_bytes(digest[:8], "little")
    assert scope.lora_id is None
    assert ReuseScope.from_cache_salt(text, lora_id=9) == ReuseScope(9, scope.salt)


@pytest.mark.parametrize("bad", [b"tenant", 123, None, ["a"]])
def test_from_cache_salt_rejects_non_str(bad):
    with pytest.raises(ValueError):
        ReuseScope.from_cache_salt(bad)


# ----------------------------------------------------------------------------- block_keys inputs
def test_only_full_blocks_keyed():
    assert block_keys(list(range(3)), 4) == []
    assert len(block_keys(list(range(4)), 4)) == 1
    assert len(block_keys(list(range(11)), 4)) == 2
    assert block_keys(list(range(11)), 4) == block_keys(list(range(8)), 4)
    assert block_keys([], 4) == []
    assert block_keys(np.array([], dtype=np.int64), 4) == []


def test_sequence_types_give_identical_keys():
    ids = [0, 1, 5, 70000, MAX_TOKEN, 42, 3, 9]
    expected = ref_block_keys(ids, 4)
    assert block_keys(ids, 4) == expected
    assert block_keys(tuple(ids), 4) == expected
    assert block_keys(np.array(ids, dtype=np.int32), 4) == expected
    assert block_keys(np.array(ids, dtype=np.int64), 4) == expected
    # a non-contiguous view and a big-endian array hold the same ids
    wide = np.array([[t, -7] for t in ids], dtype=np.int64)
    assert block_keys(wide[:, 0], 4) == expected
    assert block_keys(np.array(ids, dtype=">i8"), 4) == expected


@pytest.mark.parametrize("bad", [-1, 2**31, 2**32, 2**40, 1.0, 2.5, "3", None])
def test_bad_token_list(bad):
    with pytest.raises(ValueError):
        block_keys([1, 2, bad, 4], 4)
    with pytest.raises(ValueError):
        block_keys((1, 2, bad, 4), 4)


@pytest.mark.parametrize("bad", [-1, 2**31, 2**40])
def test_bad_token_numpy(bad):
    with pytest.raises(ValueError):
        block_keys(np.array([1, 2, bad, 4], dtype=np.int64), 4)


def test_bad_token_numpy_negative_int32_and_float():
    with pytest.raises(ValueError):
        block_keys(np.array([1, -1, 2, 3], dtype=np.int32), 4)
    with pytest.raises(ValueError):
        block_keys(np.array([1.0, 2.0, 3.0, 4.0]), 4)


def test_bad_token_in_partial_block_still_rejected():
    with pytest.raises(ValueError):
        block_keys([1, 2, 3, 4, -1], 4)


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, "4", None])
def test_bad_tokens_per_block(bad):
    with pytest.raises(ValueError):
        block_keys([1, 2, 3, 4], bad)


@pytest.mark.parametrize("bad", [(None, 1), "scope", 0, ReuseScope().root_key()])
def test_bad_scope(bad):
    with pytest.raises(ValueError):
        block_keys([1, 2, 3, 4], 4, bad)


# ----------------------------------------------------------------------------- PYTHONHASHSEED
_CHILD = """
from raykv.core.keys import ReuseScope, block_keys
out = []
for scope in (ReuseScope(), ReuseScope(7, 2**64 - 1), ReuseScope.from_cache_salt("tenant")):
    out.append(scope.root_key().hex())
    out += [k.hex() for k in block_keys(list(range(37)), 8, scope)]
print(",".join(out))
"""


def test_keys_identical_across_hash_seeds():
    outputs = []
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO_ROOT))
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.strip())
    assert outputs[0] == outputs[1] == outputs[2]
    expected = []
    for scope in (ReuseScope(), ReuseScope(7, 2**64 - 1), ReuseScope.from_cache_salt("tenant")):
        expected.append(scope.root_key().hex())
        expected += [k.hex() for k in ref_block_keys(list(range(37)), 8, scope.root_key())]
    assert outputs[0] == ",".join(expected)
    assert outputs[0].split(",")[0] == ROOT_DEFAULT


# ----------------------------------------------------------------------------- multimodal
DIGEST = hashlib.sha256(b"an image").digest()


@pytest.mark.parametrize(
    "digest", [DIGEST[:31], DIGEST + b"\x00", b"", bytearray(DIGEST), DIGEST.hex(), None]
)
def test_mm_item_bad_digest(digest):
    with pytest.raises(ValueError):
        MultimodalItem(digest, 0, 4)


@pytest.mark.parametrize(
    "start, length", [(-1, 4), (0, 0), (0, -1), (1.0, 4), (0, 4.0), (True, 4), (0, True)]
)
def test_mm_item_bad_start_length(start, length):
    with pytest.raises(ValueError):
        MultimodalItem(DIGEST, start, length)


def test_mm_item_valid_and_from_content():
    item = MultimodalItem(DIGEST, 0, 1)
    assert item.end == 1
    a = MultimodalItem.from_content(b"pixels", 2, 5)
    assert len(a.digest) == 32 and a.start == 2 and a.length == 5
    assert a == MultimodalItem.from_content(b"pixels", 2, 5)
    assert a.digest != MultimodalItem.from_content(b"pixelz", 2, 5).digest
    assert pickle.loads(pickle.dumps(a)) == a


def test_mm_items_overlap_or_past_tokens_rejected():
    toks = list(range(16))
    with pytest.raises(ValueError):
        block_keys(toks, 4, mm_items=[MultimodalItem(DIGEST, 0, 5), MultimodalItem(DIGEST, 4, 2)])
    with pytest.raises(ValueError):  # overlap detected regardless of order
        block_keys(toks, 4, mm_items=[MultimodalItem(DIGEST, 6, 2), MultimodalItem(DIGEST, 2, 5)])
    with pytest.raises(ValueError):
        block_keys(toks, 4, mm_items=[MultimodalItem(DIGEST, 12, 5)])
    with pytest.raises(ValueError):
        block_keys(toks, 4, mm_items=[MultimodalItem(DIGEST, 16, 1)])
    # adjacent items and an item ending exactly at the end are fine
    keys = block_keys(toks, 4, mm_items=[MultimodalItem(DIGEST, 0, 4), MultimodalItem(DIGEST, 4, 12)])
    assert len(keys) == 4


def test_mm_items_not_items_rejected():
    with pytest.raises(ValueError):
        block_keys(list(range(8)), 4, mm_items=[(DIGEST, 0, 4)])


def test_mm_block_key_differs_from_text_and_matches_encoding():
    toks = [7] * 4 + [99] * 6 + [1, 2, 3, 4, 5, 6]  # placeholder 99 at positions 4..9
    item = MultimodalItem(DIGEST, 4, 6)
    text = block_keys(toks, 4)
    mm = block_keys(toks, 4, mm_items=[item])
    assert mm[0] == text[0]  # block 0 covers no item: plain text key
    assert mm[1] != text[1] and mm[2] != text[2]
    assert mm[3] != text[3]  # chained from a different parent
    # exact bytes of the documented encoding
    k1 = ref_mm_block_key(mm[0], toks[4:8], 4, [item])
    k2 = ref_mm_block_key(k1, toks[8:12], 8, [item])
    k3 = hashlib.sha256(k2 + b"".join(t.to_bytes(4, "little") for t in toks[12:16])).digest()
    assert mm[1:] == [k1, k2, k3]
    # placeholder ids are ignored, the digest is not
    other_placeholders = toks[:4] + [5] * 6 + toks[10:]
    assert block_keys(other_placeholders, 4, mm_items=[item]) == mm
    other_item = MultimodalItem(hashlib.sha256(b"another image").digest(), 4, 6)
    assert block_keys(toks, 4, mm_items=[other_item])[1] != mm[1]
    # the item-local offset is hashed: shifting the item changes keys
    assert block_keys(toks, 4, mm_items=[MultimodalItem(DIGEST, 5, 5)])[1] != mm[1]


def test_mm_marker_breaks_preimage():
    assert MM_MARKER[:4] == b"\xff\xff\xff\xff"
    assert MM_MARKER[3] & 0x80  # last byte of the first 4-byte group: impossible in a text token
    assert int.from_bytes(MM_MARKER[:4], "little") > MAX_TOKEN
    # so a text block cannot spell a multimodal preimage body: its first "token" is out of range
    body = MM_MARKER + b"".join(b"\x00" + t.to_bytes(4, "little") for t in (1, 2, 3, 4))
    assert len(body) % 4 == 0
    with pytest.raises(ValueError):
        block_keys(tokens_spelling(body), len(body) // 4)


# A digest whose every 4-byte group has its last byte < 0x80: a text block can spell it exactly.
CRAFTED = bytes(b if i % 4 != 3 else b & 0x7F for i, b in enumerate(hashlib.sha256(b"img").digest()))


@pytest.mark.parametrize("tpb", [1, 2, 4, 8, 9, 16, 32])
def test_crafted_text_block_does_not_collide(tpb):
    spelled = tokens_spelling(CRAFTED)
    assert len(spelled) == 8 and all(0 <= t <= MAX_TOKEN for t in spelled)
    n = ((8 + tpb - 1) // tpb) * tpb
    pad = [0] * (n - 8)
    text_toks = spelled + pad
    item = MultimodalItem(CRAFTED, 0, 8)
    text = block_keys(text_toks, tpb)
    mm = block_keys([0] * 8 + pad, tpb, mm_items=[item])
    assert len(text) == len(mm) == n // tpb
    assert set(text).isdisjoint(mm)
    if tpb == 8:
        # A scheme splicing the raw digest with no tag (TensorRT-LLM) WOULD collide here:
        naive = hashlib.sha256(ReuseScope().root_key() + CRAFTED).digest()
        assert naive == text[0]
        assert mm[0] != naive


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(1, 3),
    data=st.data(),
)
def test_random_text_never_equals_mm_of_its_byte_image(blocks, data):
    tpb = 8  # one block of text is exactly 32 bytes: one digest
    toks = data.draw(st.lists(st.integers(0, MAX_TOKEN), min_size=tpb * blocks, max_size=tpb * blocks))
    raw = b"".join(t.to_bytes(4, "little") for t in toks)
    items = [MultimodalItem(raw[32 * b : 32 * (b + 1)], tpb * b, tpb) for b in range(blocks)]
    text = block_keys(toks, tpb)
    mm = block_keys(toks, tpb, mm_items=items)
    assert set(text).isdisjoint(mm)
    length = data.draw(st.integers(1, tpb * blocks))
    mm_one = block_keys(toks, tpb, mm_items=[MultimodalItem(raw[:32], 0, length)])
    assert mm_one[0] != text[0]


# ----------------------------------------------------------------------------- prefix properties
token_lists = st.lists(st.integers(0, MAX_TOKEN), min_size=0, max_size=80)


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, tpb=st.integers(1, 16), data=st.data())
def test_prefix_stability(tokens, tpb, data):
    full = block_keys(tokens, tpb)
    assert len(full) == len(tokens) // tpb
    k = data.draw(st.integers(0, len(full)))
    assert block_keys(tokens[: k * tpb], tpb) == full[:k]
    extra = data.draw(st.lists(st.integers(0, MAX_TOKEN), max_size=20))
    assert block_keys(tokens + extra, tpb)[: len(full)] == full


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, MAX_TOKEN), min_size=1, max_size=80),
    tpb=st.integers(1, 16),
    data=st.data(),
)
def test_changing_a_token_changes_its_block_and_later(tokens, tpb, data):
    keys = block_keys(tokens, tpb)
    if not keys:
        return
    pos = data.draw(st.integers(0, len(keys) * tpb - 1))
    new = data.draw(st.integers(0, MAX_TOKEN).filter(lambda t: t != tokens[pos]))
    changed = list(tokens)
    changed[pos] = new
    keys2 = block_keys(changed, tpb)
    j = pos // tpb
    assert keys2[:j] == keys[:j]
    assert all(a != b for a, b in zip(keys[j:], keys2[j:]))
    assert len(set(keys + keys2)) == len(keys) + len(keys2) - j

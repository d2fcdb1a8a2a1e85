"""Block keys: byte-identical in every process, on every node, in every run.

Scope (root) key
    ``ReuseScope(lora_id, salt, model)``: ``lora_id`` and ``salt`` are unsigned 64-bit ints,
    ``model`` a 32-byte model fingerprint (what decides a block's bytes besides its tokens: the
    weights, dtypes, page layout; :mod:`raykv.integrations.vllm.identity` computes it for vLLM
    engines). The root key is ``SHA-256(mask || fields)``: ``mask`` is one byte with bit 0 set
    when ``lora_id`` is present, bit 1 when ``salt`` is present and bit 2 when ``model`` is,
    followed by each present field in that order: ``lora_id`` and ``salt`` as 8 bytes
    little-endian unsigned, ``model`` as its 32 bytes. ``ReuseScope()`` ->
    ``SHA-256(b"\\x00")``. None and 0 are different. A scope without ``model`` serializes as
    TensorRT-LLM's does (bits 0 and 1 only).

Text block key
    ``key_i = SHA-256(key_{i-1} || t_0 || ... || t_{n-1})`` with ``key_{-1}`` the root key and each
    token ``t`` as 4 bytes little-endian unsigned (tokens must be in ``0 ..= 2**31 - 1``). This is
    byte-compatible with TensorRT-LLM KVCacheManagerV2's ``sequence_to_blockchain_keys``.

Multimodal block key (raykv's domain separation)
    A block that overlaps any multimodal item is hashed as
    ``SHA-256(key_{i-1} || MM_MARKER || entry_0 || ... || entry_{n-1})`` where
    ``MM_MARKER = b"\\xff\\xff\\xff\\xffraykv-mm-v1\\x00"`` and each position's entry is either
    ``b"\\x00" || token (4 bytes LE)`` for a text position, or
    ``b"\\x01" || digest (32 bytes) || item-local offset (4 bytes LE)`` for a multimodal position.
    Why this can never equal a text block's input: in a text preimage every 4-byte group after
    the 32-byte parent is a token below ``2**31``, so its last byte has the high bit clear. The
    multimodal preimage's first group after the parent is ``ff ff ff ff``: its last byte has the
    high bit set. The two preimage sets are disjoint, so equal keys would need a SHA-256 collision.
    (TensorRT-LLM splices the raw digest among the tokens with no tag; a crafted text block can
    collide with an image block there.)

SHA-256 is a security invariant: the global index is shared across tenants and matches by digest
equality alone, so keys are never truncated nor replaced by a non-cryptographic hash.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Union

import numpy as np
import numpy.typing as npt

from raykv.core.errors import InvalidArgumentError
from raykv.core.types import BLOCK_KEY_BYTES, MAX_TOKEN_ID, BlockKey, check_u64

MM_MARKER: Final = b"\xff\xff\xff\xffraykv-mm-v1\x00"
_MM_CONTENT_DOMAIN: Final = b"raykv-mm-content-v1\x00"

TokenSeq = Union[Sequence[int], npt.NDArray[np.integer]]  # noqa: UP007


@dataclass(frozen=True)
class ReuseScope:
    """A reuse namespace: blocks only match within the same scope (LoRA adapter, cache salt,
    model).

    ``lora_id`` and ``salt`` are None or an unsigned 64-bit int (full range: salts >= 2**63 are
    normal); ``model`` is None or a 32-byte fingerprint of the model whose KV the blocks hold.
    Raises ValueError (InvalidArgumentError) for negative, too large, bool or non-int ids and a
    ``model`` that is not 32 bytes. Hashable, pickles, compares by value.
    """

    lora_id: int | None = None
    salt: int | None = None
    model: bytes | None = None

    def __post_init__(self) -> None:
        if self.lora_id is not None:
            check_u64("lora_id", self.lora_id)
        if self.salt is not None:
            check_u64("salt", self.salt)
        if self.model is not None and (type(self.model) is not bytes or len(self.model) != BLOCK_KEY_BYTES):
            raise InvalidArgumentError("model", "a model fingerprint is exactly 32 bytes")

    @classmethod
    def from_cache_salt(cls, text: str, lora_id: int | None = None, model: bytes | None = None) -> ReuseScope:
        """Scope whose salt is the low 8 bytes (little-endian) of SHA-256 of the UTF-8 text."""
        if not isinstance(text, str):
            raise InvalidArgumentError("text", f"cache salt must be a str, got {type(text).__name__}")
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        return cls(lora_id=lora_id, salt=int.from_bytes(digest[:8], "little"), model=model)

    def with_model(self, model: bytes | None) -> ReuseScope:
        """This scope for the model of fingerprint ``model`` (None: no model named)."""
        return ReuseScope(self.lora_id, self.salt, model)

    def to_bytes(self) -> bytes:
        """The serialized scope: mask byte, each present id as u64 little-endian, the model's
        32 bytes."""
        mask = (1 if self.lora_id is not None else 0) | (2 if self.salt is not None else 0)
        mask |= 4 if self.model is not None else 0
        out = bytes([mask])
        if self.lora_id is not None:
            out += self.lora_id.to_bytes(8, "little")
        if self.salt is not None:
            out += self.salt.to_bytes(8, "little")
        if self.model is not None:
            out += self.model
        return out

    def root_key(self) -> BlockKey:
        """SHA-256 of :meth:`to_bytes`: the parent key of block 0."""
        return BlockKey(hashlib.sha256(self.to_bytes()).digest())


DEFAULT_SCOPE: Final = ReuseScope()


@dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input (image, audio...) occupying ``length`` token positions from ``start``.

    ``digest`` (32 bytes) identifies the content; use :meth:`from_content` to derive it from raw
    bytes. The placeholder token ids at those positions are ignored by the key: the digest and the
    item-local offset are hashed instead.
    """

    digest: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != BLOCK_KEY_BYTES:
            raise InvalidArgumentError("digest", "multimodal digest must be exactly 32 bytes")
        for name in ("start", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(name, f"must be an int >= 0, got {value!r}")
        if self.length < 1:
            raise InvalidArgumentError("length", "a multimodal item covers at least one token")

    @classmethod
    def from_content(cls, content: bytes, start: int, length: int) -> MultimodalItem:
        """Item whose digest is SHA-256 of a raykv domain tag followed by ``content``."""
        digest = hashlib.sha256(_MM_CONTENT_DOMAIN + bytes(content)).digest()
        return cls(digest=digest, start=start, length=length)

    @property
    def end(self) -> int:
        return self.start + self.length


def tokens_to_array(tokens: TokenSeq | Iterable[int], name: str = "tokens") -> npt.NDArray[np.uint32]:
    """Validate token ids and return them as a little-endian uint32 array.

    Accepts lists, tuples and one-dimensional numpy integer arrays (equal ids give equal arrays).
    Raises InvalidArgumentError (a ValueError) for an id outside ``0 ..= 2**31 - 1``, a
    non-integer, an array of another rank, or ``bytes``/``str``-like input (never read as ids).
    """
    if isinstance(tokens, (bytes, bytearray, memoryview, str)):
        raise InvalidArgumentError(name, f"must be a sequence of token ids, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidArgumentError(name, f"must be one-dimensional, got shape {tokens.shape}")
        arr = tokens
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(name, f"token ids must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
            raise InvalidArgumentError(name, "token ids must be in 0..2**31-1")
        return arr.astype("<u4", copy=False)
    try:
        packed = array.array("I", tokens)  # type: ignore[arg-type]
    except (OverflowError, TypeError) as exc:
        raise InvalidArgumentError(name, f"token ids must be ints in 0..2**31-1 ({exc})") from None
    out = np.frombuffer(packed, dtype=np.uint32) if packed.itemsize == 4 else np.asarray(packed)
    if out.size and int(out.max()) > MAX_TOKEN_ID:
        raise InvalidArgumentError(name, "token ids must be in 0..2**31-1")
    return out.astype("<u4", copy=False)


def _check_tokens_per_block(tokens_per_block: object) -> int:
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise InvalidArgumentError("tokens_per_block", f"must be an int, got {tokens_per_block!r}")
    if tokens_per_block < 1:
        raise InvalidArgumentError("tokens_per_block", f"must be >= 1, got {tokens_per_block}")
    return tokens_per_block


def check_mm_items(items: Iterable[MultimodalItem], num_tokens: int | None) -> tuple[MultimodalItem, ...]:
    """Validate multimodal items: right type, sorted by start, non-overlapping, inside the tokens."""
    try:
        listed = tuple(items)
    except TypeError:
        raise InvalidArgumentError("mm_items", f"must be an iterable, got {type(items).__name__}") from None
    if not all(isinstance(item, MultimodalItem) for item in listed):
        raise InvalidArgumentError("mm_items", "every item must be a MultimodalItem")
    out = tuple(sorted(listed, key=lambda it: it.start))
    prev_end = 0
    for item in out:
        if item.start < prev_end:
            raise InvalidArgumentError("mm_items", "multimodal items overlap")
        if num_tokens is not None and item.end > num_tokens:
            raise InvalidArgumentError("mm_items", "a multimodal item extends past the tokens")
        prev_end = item.end
    return out


def clip_mm_items(items: tuple[MultimodalItem, ...], num_tokens: int) -> tuple[MultimodalItem, ...]:
    """``items`` as seen by the first ``num_tokens`` tokens: those starting past them dropped, one
    reaching past them cut short. The keys of the blocks within ``num_tokens`` are unchanged (a
    multimodal position hashes its item's digest and its offset from the item's start)."""
    return tuple(
        it if it.end <= num_tokens else MultimodalItem(it.digest, it.start, num_tokens - it.start)
        for it in items
        if it.start < num_tokens
    )


def _mm_block_bytes(tokens: npt.NDArray[np.uint32], start: int, items: tuple[MultimodalItem, ...]) -> bytes:
    parts = [MM_MARKER]
    pos_to_item: dict[int, tuple[MultimodalItem, int]] = {}
    end = start + len(tokens)
    for item in items:
        for pos in range(max(item.start, start), min(item.end, end)):
            pos_to_item[pos] = (item, pos - item.start)
    for i, tok in enumerate(tokens.tolist()):
        hit = pos_to_item.get(start + i)
        if hit is None:
            parts.append(b"\x00" + int(tok).to_bytes(4, "little"))
        else:
            parts.append(b"\x01" + hit[0].digest + hit[1].to_bytes(4, "little"))
    return b"".join(parts)


def chain_keys(
    parent: bytes,
    tokens: npt.NDArray[np.uint32],
    tokens_per_block: int,
    first_block: int = 0,
    mm_items: tuple[MultimodalItem, ...] = (),
    allow_partial: bool = False,
) -> list[BlockKey]:
    """Keys of blocks ``first_block, first_block + 1, ...`` chained from ``parent``.

    ``tokens`` is the whole sequence (validated uint32); ``parent`` is the key of block
    ``first_block - 1`` (the root key when ``first_block`` is 0). Only full blocks are keyed unless
    ``allow_partial``, which also keys a trailing partial block (never shared; used for content
    ids of private pages).
    """
    n_tokens = len(tokens)
    last = n_tokens // tokens_per_block
    if allow_partial and n_tokens % tokens_per_block:
        last += 1
    if mm_items:
        return _chain_keys_mm(parent, tokens, tokens_per_block, first_block, last, mm_items)
    step = tokens_per_block * 4
    lo = first_block * tokens_per_block
    data = tokens[lo : last * tokens_per_block].astype("<u4", copy=False).tobytes()
    keys: list[BlockKey] = []
    append = keys.append
    prev = parent
    sha = hashlib.sha256
    for off in range(0, len(data), step):
        prev = sha(prev + data[off : off + step]).digest()
        append(prev)  # type: ignore[arg-type]
    return keys


def _chain_keys_mm(
    parent: bytes,
    tokens: npt.NDArray[np.uint32],
    tokens_per_block: int,
    first_block: int,
    last: int,
    mm_items: tuple[MultimodalItem, ...],
) -> list[BlockKey]:
    """The per-block loop for sequences with multimodal items (see the module docstring)."""
    n_tokens = len(tokens)
    keys: list[BlockKey] = []
    prev = parent
    for b in range(first_block, last):
        lo = b * tokens_per_block
        hi = min(lo + tokens_per_block, n_tokens)
        if any(it.start < hi and it.end > lo for it in mm_items):
            body = _mm_block_bytes(tokens[lo:hi], lo, mm_items)
        else:
            body = tokens[lo:hi].astype("<u4", copy=False).tobytes()
        prev = hashlib.sha256(prev + body).digest()
        keys.append(BlockKey(prev))
    return keys


def block_keys(
    tokens: TokenSeq,
    tokens_per_block: int,
    scope: ReuseScope | None = None,
    mm_items: Iterable[MultimodalItem] = (),
) -> list[BlockKey]:
    """The 32-byte keys of the full blocks of ``tokens`` (a trailing partial block gets none).

    Lists, tuples and numpy int32/int64 arrays of the same ids give identical keys. Raises
    ValueError (InvalidArgumentError) for a token outside ``0 ..= 2**31 - 1``, tokens_per_block
    < 1, a bad scope or bad multimodal items.
    """
    tpb = _check_tokens_per_block(tokens_per_block)
    if scope is None:
        scope = DEFAULT_SCOPE
    elif not isinstance(scope, ReuseScope):
        raise InvalidArgumentError("scope", f"must be a ReuseScope, got {type(scope).__name__}")
    arr = tokens_to_array(tokens)
    items = check_mm_items(mm_items, len(arr))
    return chain_keys(scope.root_key(), arr, tpb, 0, items)


LORA_NAME_DOMAIN = b"raykv-lora-name\x00"


def lora_id_from_name(name: str) -> int:
    """A stable unsigned 64-bit LoRA id for an adapter known by name: the low 8 bytes
    (little-endian) of SHA-256 over a fixed domain prefix and the UTF-8 name. The same in every
    process; the engine and the router must both use it (or both pass the same int).
    Raises InvalidArgumentError for a non-str or empty name."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("lora name", f"must be a non-empty str, got {name!r}")
    digest = hashlib.sha256(LORA_NAME_DOMAIN + name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def key_hex(key: bytes) -> str:
    """Short printable form of a key for logs (first 8 bytes in hex)."""
    return bytes(key[:8]).hex()

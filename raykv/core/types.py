"""Typed ids shared by every raykv layer.

All ids are plain Python values at run time (``NewType`` costs nothing), so they pickle and cross
actor boundaries unchanged; the names exist for readers and for mypy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import NewType

from raykv import native
from raykv.core.errors import InvalidArgumentError

BlockKey = NewType("BlockKey", bytes)
"""A 32-byte SHA-256 block digest (see :mod:`raykv.core.keys`)."""

TokenId = NewType("TokenId", int)
"""A text token id in ``0 ..= 2**31 - 1``."""

PageId = NewType("PageId", int)
"""A slot index inside one tier's page pool; on the top tier, the index an engine uses."""

TierLevel = NewType("TierLevel", int)
"""Position of a tier in a manager's tier list: 0 is the top (warmest) tier."""

WorkerId = NewType("WorkerId", str)
"""Name of one CacheWorker in a deployment."""

RequestId = NewType("RequestId", int)
"""Caller-chosen request id: an unsigned 64-bit integer (full range)."""

Priority = NewType("Priority", int)
"""Eviction priority in ``0 ..= 100``: lower is evicted first."""

BLOCK_KEY_BYTES = 32
U64_MAX = 2**64 - 1
MAX_TOKEN_ID = 2**31 - 1
DEFAULT_PRIORITY = Priority(35)
MIN_PRIORITY = 0
MAX_PRIORITY = 100


class TierKind(enum.IntEnum):
    """The kind of storage a tier uses; lower values are warmer."""

    GPU = 0
    HOST = 1
    DISK = 2

    @classmethod
    def parse(cls, value: TierKind | str) -> TierKind:
        """Return the kind named by ``value`` ("gpu", "host", "disk" or a TierKind).

        Raises ValueError for any other value.
        """
        if isinstance(value, TierKind):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        raise ValueError(f"unknown tier kind {value!r}; expected one of gpu, host, disk")


def check_u64(name: str, value: object) -> int:
    """Return ``value`` if it is an int in ``0 ..= 2**64 - 1`` (not a bool); else raise
    InvalidArgumentError (a ValueError) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an int in 0..2**64-1, got {type(value).__name__}")
    if value < 0 or value > U64_MAX:
        raise InvalidArgumentError(name, f"must be in 0..2**64-1, got {value}")
    return value


def check_block_key(value: object, name: str = "key") -> BlockKey:
    """Return ``value`` as a BlockKey if it is exactly 32 bytes; else raise InvalidArgumentError
    (a ValueError) naming ``name``."""
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes) or len(value) != BLOCK_KEY_BYTES:
        shown = len(value) if isinstance(value, bytes) else type(value).__name__
        raise InvalidArgumentError(name, f"must be {BLOCK_KEY_BYTES} bytes, got {shown}")
    return BlockKey(value)


_all_keys: Callable[[list[object]], bool] | None = getattr(native.load("_chain"), "all_keys", None)


def check_block_keys(values: Iterable[object], name: str = "key") -> list[BlockKey]:
    """:func:`check_block_key` of each value (one fast pass when all are 32-byte ``bytes``: one
    C loop with the compiled ``raykv.native._chain``, else two C-level set passes). A single key
    (``bytes``) or a str in place of the sequence is refused: InvalidArgumentError ``keys``."""
    if isinstance(values, (bytes, bytearray, memoryview, str)):
        raise InvalidArgumentError("keys", f"must be a sequence of keys, got {type(values).__name__}")
    try:
        keys = list(values)
    except TypeError:
        raise InvalidArgumentError(
            "keys", f"must be a sequence of keys, got {type(values).__name__}"
        ) from None
    if len(keys) > 16:  # C-level passes; a loop for few keys (no set to build)
        if _all_keys is not None:
            if _all_keys(keys):
                return keys  # type: ignore[return-value]
        elif set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {BLOCK_KEY_BYTES}:  # type: ignore[arg-type]
            return keys  # type: ignore[return-value]
        return [check_block_key(k, name) for k in keys]
    for k in keys:
        if type(k) is not bytes or len(k) != BLOCK_KEY_BYTES:
            return [check_block_key(k, name) for k in keys]
    return keys  # type: ignore[return-value]


def check_priority(value: object) -> Priority:
    """Return ``value`` as a Priority if it is an int in 0..100 (not a bool); else
    InvalidArgumentError ``priority`` (a ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise InvalidArgumentError("priority", f"must be an int in 0..100, got {value!r}")
    return Priority(value)

"""The prefix index's table: which lanes hold each key, on which tier (see :mod:`raykv.index.prefix_index`).

:func:`new_holders` returns the compiled :class:`raykv.native._holders.Holders` when the extension
was built (and ``RAYKV_PURE_INDEX`` is not ``1``), else :class:`PyHolders`, its pure-Python twin.
Both give the same answers op for op (tests/unit/test_holders.py runs them side by side):

- ``apply(lane, data) -> (added, removed)``: a packed batch of one lane's ops, in order. ``added``
  counts keys the lane did not hold before a store, ``removed`` keys a remove or clear took from
  it. Raises ValueError and changes nothing when ``validate(data)`` is False.
- ``drop_lane(lane) -> int``: the lane leaves every key; returns how many keys it held.
- ``entries(keys)``: per key, the ``(all, gpu, host, disk)`` tuple of lane-spread masks (lane
  ``l``'s bit is ``1 << (16 * l)``), or None where nobody holds it.
- ``route(keys, names, match_type)`` (compiled only): :func:`raykv.index.route.route_held`'s answer.
- ``lane_blocks(lane)``: ``{key prefix: tier}`` of every key the lane holds.
- ``len(t)``: keys held by anyone; ``memory()``: bytes in use; ``stats()``; ``maintain(slots)``.

Keys are 32-byte ``bytes`` (a sequence of them, or one ``bytes`` of n x 32); anything else reads as
absent. The table keeps each key's first :data:`KEY_PREFIX` bytes (128 bits of a SHA-256 digest):
two live keys that agree on them would share an entry, with odds of about n^2 / 2^129 (1e-21 at a
billion keys), and the only effect would be a misroute: workers hold and verify full keys.

A packed batch is whole :data:`RECORD`-byte records ``op, tier, key[32]``: op 0 stores the key on
``tier`` (0 gpu, 1 host, 2 disk), op 1 removes it, op 2 clears the lane (tier and key unused).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from raykv import native
from raykv.index.route import LANE_BITS, Entry

KEY_BYTES = 32
KEY_PREFIX = 16
RECORD = 2 + KEY_BYTES
OP_STORE, OP_REMOVE, OP_CLEAR = 0, 1, 2
_BAD_RECORD = b"\xff\x00" + bytes(KEY_BYTES)  # packs an op that cannot be applied: the batch is malformed
_CLEAR_RECORD = bytes([OP_CLEAR, 0]) + bytes(KEY_BYTES)


class HoldersLike(Protocol):
    """What the index needs from its table (see the module docstring)."""

    def apply(self, lane: int, data: bytes) -> tuple[int, int]: ...
    def validate(self, data: bytes) -> bool: ...
    def drop_lane(self, lane: int) -> int: ...
    def entries(self, keys: Sequence[bytes] | bytes) -> list[Entry | None]: ...
    def lane_blocks(self, lane: int) -> dict[bytes, int]: ...
    def memory(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def maintain(self, slots: int) -> bool: ...
    def __len__(self) -> int: ...


def pack_ops(ops: Iterable[tuple[int, bytes, int]]) -> bytes:
    """``(op, key, tier)`` triples as a packed batch. A malformed op (unknown op, a key that is not
    32 bytes, a store's tier outside 0..2) packs as a record that fails validation."""
    out = []
    for op, key, tier in ops:
        if op == OP_CLEAR:
            out.append(_CLEAR_RECORD)
        elif (
            op in (OP_STORE, OP_REMOVE)
            and type(key) is bytes
            and len(key) == KEY_BYTES
            and (op == OP_REMOVE or (isinstance(tier, int) and 0 <= tier <= 2))
        ):
            out.append(bytes((op, int(tier) if op == OP_STORE else 0)) + key)
        else:
            out.append(_BAD_RECORD)
    return b"".join(out)


def unpack_ops(data: bytes) -> tuple[tuple[int, bytes, int], ...]:
    """The ``(op, key, tier)`` triples of a packed batch (a clear reads ``(OP_CLEAR, b"", 0)``)."""
    out = []
    for i in range(0, len(data) - len(data) % RECORD, RECORD):
        op = data[i]
        out.append((op, b"", 0) if op == OP_CLEAR else (op, data[i + 2 : i + RECORD], data[i + 1]))
    return tuple(out)


def has_clear(data: bytes) -> bool:
    """Whether a packed batch clears its lane."""
    return OP_CLEAR in data[::RECORD]


def split(data: bytes, num_shards: int) -> list[bytes]:
    """Each shard's records of a packed batch, in order (a clear goes to every shard); a record
    goes to ``int.from_bytes(key[:8], "big") % num_shards``, as ``shard_of``."""
    compiled = native.load("_holders")
    if compiled is not None:
        return compiled.split(data, num_shards)  # type: ignore[no-any-return]
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    parts: list[list[bytes]] = [[] for _ in range(num_shards)]
    for i in range(0, len(data) - len(data) % RECORD, RECORD):
        rec = data[i : i + RECORD]
        if rec[0] == OP_CLEAR:
            for part in parts:
                part.append(rec)
        else:
            parts[int.from_bytes(rec[2:10], "big") % num_shards].append(rec)
    return [b"".join(p) for p in parts]


def _valid(data: bytes) -> bool:
    if len(data) % RECORD:
        return False
    ops, tiers = data[::RECORD], data[1::RECORD]
    return all(op <= OP_CLEAR and (op != OP_STORE or tier <= 2) for op, tier in zip(ops, tiers))


def _key_list(keys: Sequence[bytes] | bytes) -> Sequence[Any]:
    if isinstance(keys, bytes):
        return [keys[i : i + KEY_BYTES] for i in range(0, len(keys) - len(keys) % KEY_BYTES, KEY_BYTES)]
    return keys


class PyHolders:
    """The pure-Python table: a dict from key prefix to an interned entry tuple. Slower than the
    compiled one (a Python object per key, a scan of every key to drop a lane), same answers."""

    def __init__(self, capacity: int = 0) -> None:
        del capacity  # a dict sizes itself
        self._t: dict[bytes, Entry] = {}
        self._canon: dict[Entry, Entry] = {}

    def _intern(self, entry: Entry) -> Entry:
        canon = self._canon.get(entry)
        if canon is None:
            if len(self._canon) >= 65_536:
                self._canon.clear()
            self._canon[entry] = canon = entry
        return canon

    def validate(self, data: bytes) -> bool:
        return _valid(data)

    def apply(self, lane: int, data: bytes) -> tuple[int, int]:
        _check_lane(lane)
        if not _valid(data):
            raise ValueError("malformed batch: records of 34 bytes, op 0..2, tier 0..2")
        bit = 1 << (LANE_BITS * lane)
        added = removed = 0
        t, intern = self._t, self._intern
        for i in range(0, len(data), RECORD):
            op = data[i]
            if op == OP_CLEAR:
                removed += self.drop_lane(lane)
                continue
            key = data[i + 2 : i + 2 + KEY_PREFIX]
            e = t.get(key)
            if op == OP_STORE:
                tier = data[i + 1]
                if e is None:
                    e, added = (0, 0, 0, 0), added + 1
                elif not e[0] & bit:
                    added += 1
                keep = ~bit
                masks = [e[0] | bit, e[1] & keep, e[2] & keep, e[3] & keep]
                masks[1 + tier] |= bit
                t[key] = intern((masks[0], masks[1], masks[2], masks[3]))
            elif e is not None and e[0] & bit:
                removed += 1
                self._set(key, e, ~bit)
        return added, removed

    def _set(self, key: bytes, e: Entry, keep: int) -> None:
        held = e[0] & keep
        if held:
            self._t[key] = self._intern((held, e[1] & keep, e[2] & keep, e[3] & keep))
        else:
            del self._t[key]

    def drop_lane(self, lane: int) -> int:
        _check_lane(lane)
        bit = 1 << (LANE_BITS * lane)
        held = [(k, e) for k, e in self._t.items() if e[0] & bit]
        for key, e in held:
            self._set(key, e, ~bit)
        return len(held)

    def entries(self, keys: Sequence[bytes] | bytes) -> list[Entry | None]:
        get = self._t.get
        return [
            get(k[:KEY_PREFIX]) if type(k) is bytes and len(k) == KEY_BYTES else None for k in _key_list(keys)
        ]

    def lane_blocks(self, lane: int) -> dict[bytes, int]:
        _check_lane(lane)
        bit = 1 << (LANE_BITS * lane)
        return {k: (0 if e[1] & bit else 1 if e[2] & bit else 2) for k, e in self._t.items() if e[0] & bit}

    def memory(self) -> int:
        """The dict's own size plus its keys and distinct entries (a lower bound: small ints and
        the allocator's overhead are not counted)."""
        entries = {id(e): e for e in self._t.values()}
        size = sys.getsizeof(self._t) + sum(map(sys.getsizeof, self._t))
        return size + sum(sys.getsizeof(e) + sum(map(sys.getsizeof, e)) for e in entries.values())

    def stats(self) -> dict[str, Any]:
        return {"capacity": len(self._t), "filled": len(self._t), "moving": False, "moves": 0}

    def maintain(self, slots: int) -> bool:
        """Nothing to move: a dict grows all at once."""
        return False

    def __len__(self) -> int:
        return len(self._t)


def _check_lane(lane: int) -> None:
    if not 0 <= lane < 4096:
        raise ValueError(f"lane must be in 0..4095, got {lane}")


def new_holders(capacity: int = 0) -> HoldersLike:
    """An empty table (pre-sized for ``capacity`` keys when > 0): compiled when available."""
    compiled = native.load("_holders")
    if compiled is not None:
        return compiled.Holders(capacity)  # type: ignore[no-any-return]
    return PyHolders(capacity)


def compiled_route(table: HoldersLike) -> Callable[..., Any] | None:
    """The table's route walk in C (None for :class:`PyHolders`: the index routes in Python)."""
    return getattr(table, "route", None)


__all__ = [
    "KEY_PREFIX",
    "OP_CLEAR",
    "OP_REMOVE",
    "OP_STORE",
    "RECORD",
    "HoldersLike",
    "PyHolders",
    "has_clear",
    "new_holders",
    "pack_ops",
    "split",
    "unpack_ops",
]

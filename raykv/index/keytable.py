"""Tables from 32-byte block keys to objects, for the prefix index (:mod:`raykv.index.prefix_index`).

:func:`new_key_table` returns the compiled :class:`raykv.native._keytable.KeyTable` when the
extension was built (optional; see :mod:`raykv.native`), else
:class:`DictKeyTable`, a dict with the same interface. Both give: ``get(key, default=None)``,
``t[key]``, ``t[key] = value``, ``del t[key]``, ``key in t``, ``len(t)``, ``keys()``, ``clear()``,
``get_many(keys)`` (a list of values, None where absent; one call per route) and
``prefetch(keys)`` (no result; before a batch of stores). The compiled table also has
``route(keys, names, match_type)``: :func:`raykv.index.route.route_held`'s answer (same matches,
same order) in one call, for up to 64 lanes, or None when an entry is not the index's tuple of
lane masks; :class:`~raykv.index.prefix_index.PrefixIndex` then routes in Python, as it always
does with the dict.

Why a compiled table: a route looks up ~100 keys; at a million keys each dict lookup is SipHash
plus three dependent cache misses (docs/benchmarks.md, "Index"), and CPython runs them one after another. The
compiled table keeps each key's bytes next to its value, takes the slot from the digest's own bits
and prefetches every slot of a batch before resolving any, so the misses overlap.

A key is a ``bytes`` of exactly 32 bytes: lookups answer "absent" for anything else; the compiled
table refuses to store one (TypeError), the dict does not check (the index stores only keys it
validated, and a check in Python would slow every store).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from raykv import native

KEY_BYTES = 32


class KeyTableLike(Protocol):
    """What the index needs from a key table (see the module docstring)."""

    def get(self, key: bytes, default: Any = None) -> Any: ...
    def get_many(self, keys: Sequence[bytes]) -> list[Any]: ...
    def prefetch(self, keys: Sequence[bytes]) -> None: ...
    def keys(self) -> Any: ...
    def clear(self) -> None: ...
    def __getitem__(self, key: bytes) -> Any: ...
    def __setitem__(self, key: bytes, value: Any) -> None: ...
    def __delitem__(self, key: bytes) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...


class DictKeyTable(dict):  # type: ignore[type-arg]
    """The pure-Python key table: a dict whose ``get_many`` is one ``map`` of ``get``."""

    def get_many(self, keys: Sequence[bytes]) -> list[Any]:
        return list(map(self.get, keys))

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Nothing to warm in a dict (the compiled table loads the keys' slots)."""


def new_key_table() -> KeyTableLike:
    """An empty key table: the compiled one when available, else :class:`DictKeyTable`."""
    compiled = native.load("_keytable")
    if compiled is not None:
        return compiled.KeyTable()  # type: ignore[no-any-return]
    return DictKeyTable()

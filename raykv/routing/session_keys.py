"""Block keys of a session's prompts, reusing the keys of its previous prompt (pure; no ray).

A multi-turn or agent session re-sends its whole context each turn, so most of a prompt's blocks
were keyed for the session's previous prompt. :class:`SessionKeys` remembers, per session, the
last prompt's tokens and keys; a new prompt whose first blocks equal them (one vectorised compare)
reuses those keys and hashes only the blocks after them, chained from the last reused key (the
same keys :func:`raykv.core.keys.block_keys` gives). Sessions are forgotten least-recently-used
first past ``max_sessions``. A prompt without a session is hashed whole.

With the compiled ``raykv.native._chain`` (and a little-endian host) a memo of recently keyed
blocks replaces the per-session compare: any block whose parent key and tokens equal, in full, a
block keyed before (an earlier turn of any session, a shared document or system prompt) reuses
that block's key, and only the others are hashed, with SHA-256 as always (``KeyMemo``: it keeps
about ``memo_bytes`` of blocks in buckets of 8 slots, the least recently used replaced). The keys are
the same either way; ``reused_blocks`` then counts memo hits, ``hashed_blocks`` the blocks hashed.
A memo is shared by every scope, but a block's parent key carries its scope, so a hit never
crosses scopes. Not thread-safe.
"""

from __future__ import annotations

import collections
import hashlib
import sys
from collections.abc import Hashable
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv import native
from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import DEFAULT_SCOPE, ReuseScope, block_keys, chain_keys, tokens_to_array
from raykv.core.types import BlockKey

_Entry = tuple[npt.NDArray[np.uint32], list[BlockKey], ReuseScope]
MEMO_BYTES = 64 << 20
"""Default memory for the compiled memo of keyed blocks (tokens, parent and key per block)."""
MAX_ROOTS = 4096  # scopes whose root key is kept (then the table starts over)
_U32 = np.dtype("<u4")


class SessionKeys:
    """Per-session key reuse (module docstring)."""

    def __init__(self, tokens_per_block: int, max_sessions: int = 4096, memo_bytes: int = MEMO_BYTES) -> None:
        if tokens_per_block < 1 or max_sessions < 1:
            raise InvalidArgumentError("tokens_per_block", "tokens_per_block and max_sessions must be >= 1")
        self.tokens_per_block = tokens_per_block
        self.max_sessions = max_sessions
        self._last: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        self._memo = _new_memo(tokens_per_block, memo_bytes)
        self._roots: dict[ReuseScope, bytes] = {}
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def keys(
        self, tokens: object, scope: ReuseScope | None = None, session: Hashable | None = None
    ) -> list[BlockKey]:
        """The keys of ``tokens``' full blocks in ``scope`` (equal to ``block_keys``), reusing
        ``session``'s previous prompt's keys for the blocks they share. Raises ValueError
        (InvalidArgumentError) for bad tokens or scope, like ``block_keys``."""
        tpb = self.tokens_per_block
        scope = scope or DEFAULT_SCOPE
        if self._memo is not None:
            return self._memo_keys(tokens, scope)
        if session is None:
            keys = block_keys(tokens, tpb, scope)  # type: ignore[arg-type]
            self.hashed_blocks += len(keys)
            return keys
        arr = tokens_to_array(tokens)  # type: ignore[arg-type]
        prev = self._last.get(session)
        shared = _shared_blocks(arr, prev, scope, tpb) if prev is not None else 0
        if shared:
            assert prev is not None
            keys = prev[1][:shared] + chain_keys(prev[1][shared - 1], arr, tpb, shared)
        else:
            keys = chain_keys(scope.root_key(), arr, tpb)
        self.reused_blocks += shared
        self.hashed_blocks += len(keys) - shared
        self._last[session] = (arr, keys, scope)
        self._last.move_to_end(session)
        if len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        return keys

    def _memo_keys(self, tokens: object, scope: ReuseScope) -> list[BlockKey]:
        """:meth:`keys` through the compiled memo (module docstring)."""
        memo = self._memo
        root = self._roots.get(scope)
        if root is None:
            if not isinstance(scope, ReuseScope):
                raise InvalidArgumentError("scope", f"must be a ReuseScope, got {type(scope).__name__}")
            if len(self._roots) >= MAX_ROOTS:
                self._roots.clear()
            root = self._roots[scope] = scope.root_key()
        if isinstance(tokens, np.ndarray) and tokens.dtype == _U32 and tokens.ndim == 1:
            arr = tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
        else:  # the memo checks uint32 ids (< 2**31); anything else is checked and converted
            arr = tokens_to_array(tokens)  # type: ignore[arg-type]
        hits, misses = memo.hits, memo.misses
        try:
            keys: list[BlockKey] = memo.chain(root, arr, 0)
        except ValueError:
            raise InvalidArgumentError("tokens", "token ids must be in 0..2**31-1") from None
        self.reused_blocks += memo.hits - hits
        self.hashed_blocks += memo.misses - misses
        return keys


def _new_memo(tokens_per_block: int, memo_bytes: int) -> Any:
    """A compiled ``KeyMemo`` of about ``memo_bytes`` (a power of two slots, at least 2), or None
    without ``raykv.native._chain``, on a big-endian host or for ``memo_bytes`` 0."""
    compiled = native.load("_chain")
    if compiled is None or sys.byteorder != "little" or memo_bytes <= 0:
        return None
    slots = max(2, memo_bytes // (tokens_per_block * 4 + 64))
    return compiled.KeyMemo(tokens_per_block, 1 << (slots.bit_length() - 1), hashlib.sha256)


def _shared_blocks(arr: npt.NDArray[np.uint32], prev: _Entry, scope: ReuseScope, tpb: int) -> int:
    """How many leading full blocks ``arr`` shares with the previous prompt (0 across scopes)."""
    old, old_keys, old_scope = prev
    if old_scope != scope or not old_keys:
        return 0
    full = min(len(old_keys), len(arr) // tpb)
    n = full * tpb
    if np.array_equal(arr[:n], old[:n]):
        return full
    first = int(np.flatnonzero(arr[:n] != old[:n])[0])
    return first // tpb

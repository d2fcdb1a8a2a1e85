"""Block keys of a session's prompts, reusing the keys of its previous prompt (pure; no ray).

A multi-turn or agent session re-sends its whole context each turn, so most of a prompt's blocks
were keyed for the session's previous prompt. :class:`SessionKeys` remembers, per session, the
last prompt's tokens and keys; a new prompt whose first blocks equal them (one vectorised compare)
reuses those keys and hashes only the blocks after them, chained from the last reused key (the
same keys :func:`raykv.core.keys.block_keys` gives). Sessions are forgotten least-recently-used
first past ``max_sessions``. A prompt without a session is hashed whole. Not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import DEFAULT_SCOPE, ReuseScope, block_keys, chain_keys, tokens_to_array
from raykv.core.types import BlockKey

_Entry = tuple[npt.NDArray[np.uint32], list[BlockKey], ReuseScope]


class SessionKeys:
    """Per-session key reuse (module docstring)."""

    def __init__(self, tokens_per_block: int, max_sessions: int = 4096) -> None:
        if tokens_per_block < 1 or max_sessions < 1:
            raise InvalidArgumentError("tokens_per_block", "tokens_per_block and max_sessions must be >= 1")
        self.tokens_per_block = tokens_per_block
        self.max_sessions = max_sessions
        self._last: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
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

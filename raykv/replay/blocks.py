"""Growing token sequences in block ids, shared by the workload generators (pure; no ray).

The generators follow the Mooncake convention of :mod:`raykv.replay.trace`: one id per 512-token
block, and an id names the block *and* its whole prefix, so a sequence that grows past a partial
block gets a fresh id for that block (its content changed) while its full blocks keep theirs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from raykv.core.errors import InvalidArgumentError
from raykv.replay.trace import BLOCK_TOKENS

Range = tuple[int, int]


class BlockIds:
    """Fresh block ids (a new id = content never seen before), counting from 0."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        """``n`` ids never handed out before."""
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


@dataclass
class Doc:
    """A growing token sequence: its full blocks' ids and its length in tokens."""

    full: list[int]
    length: int

    def grown(self, ids: BlockIds, tokens: int) -> Doc:
        """A copy with ``tokens`` more tokens (the old partial block becomes a new block)."""
        length = self.length + tokens
        full_now = length // BLOCK_TOKENS
        return Doc(self.full + ids.take(full_now - len(self.full)), length)

    def hash_ids(self, ids: BlockIds) -> tuple[int, ...]:
        """The ids of a request with this prompt (a trailing partial block gets a fresh id)."""
        tail = ids.take(1) if self.length % BLOCK_TOKENS else []
        return tuple(self.full + tail)


def draw(rng: random.Random, span: Range) -> int:
    """A uniform integer in ``span`` (both ends included)."""
    return rng.randint(span[0], span[1])


def check_ranges(spec: object, names: tuple[str, ...]) -> None:
    """Raise InvalidArgumentError unless each named field of ``spec`` is a range 1 <= lo <= hi."""
    for name in names:
        lo, hi = getattr(spec, name)
        if not 1 <= lo <= hi:
            raise InvalidArgumentError(name, f"range must satisfy 1 <= lo <= hi, got {(lo, hi)}")

"""Page handles: one page = one block of every layer's KV, living in one tier slot.

A Page keeps its identity (``uid``) while it moves between tiers; ``level`` and ``slot`` say where
it is now. ``pins`` counts active requests using it (a pinned page sits on the top tier and is never
moved or dropped); ``holders`` counts requests (active or suspended) that reference it (a held page
may be demoted but never dropped). ``leases`` counts block leases (a sender reading the page in
place): a leased page is neither moved nor dropped until released. ``block`` is the committed tree
block it backs, or None for a page private to one request.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from raykv.types import PageId, Priority, TierLevel

if TYPE_CHECKING:
    from raykv.radix import Block

_uids = itertools.count(1)


class Page:
    __slots__ = ("block", "holders", "leases", "level", "pins", "priority", "queued", "slot", "uid")

    def __init__(self, level: TierLevel, slot: PageId, priority: Priority) -> None:
        self.uid = next(_uids)
        self.level = level
        self.slot = slot
        self.priority = priority
        self.block: Block | None = None
        self.pins = 0
        self.leases = 0
        self.holders = 0
        self.queued = False

    def __repr__(self) -> str:
        state = "committed" if self.block is not None else "private"
        return (
            f"Page(uid={self.uid}, level={self.level}, slot={self.slot}, {state}, "
            f"pins={self.pins}, holders={self.holders})"
        )

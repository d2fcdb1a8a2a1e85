"""Page handles: one page = one block of every layer's KV, living in one tier slot.

A Page keeps its identity (``uid``) while it moves between tiers; ``level`` and ``slot`` say where
it is now. ``pins`` counts active requests using it (a pinned page sits on the top tier and is never
moved or dropped); ``holders`` counts requests (active or suspended) that reference it (a held page
may be demoted but never dropped). ``leases`` counts block leases (a sender reading the page in
place): a leased page is neither moved nor dropped until released. ``block`` is the committed tree
block it backs, or None for a page private to one request.

:func:`new_pages` makes many pages at once; with the optional compiled ``raykv.native._chain`` (built by
``pip install``; ``RAYKV_PURE_CHAIN=1`` turns it off) it runs no bytecode per page, as
:meth:`raykv.core.radix.BlockRadixTree.insert_chain` runs none per block.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from raykv import native
from raykv.core.types import PageId, Priority, TierLevel

if TYPE_CHECKING:
    from raykv.core.radix import Block

log = logging.getLogger(__name__)
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


_chain: Any = native.load("_chain")


def bind_compiled(block_type: type) -> Any:
    """Bind ``raykv.native._chain`` to :class:`Page` and ``block_type``
    (:class:`raykv.core.radix.Block`, which calls this once at import); the module, or None when it
    is not built, turned off, or the classes' slots are not what it stores (then :func:`new_pages`
    stays Python too)."""
    global _chain
    if _chain is None:
        return None
    try:
        _chain.bind(Page, block_type)
    except TypeError as exc:
        log.warning("raykv.native._chain unusable (%s); building pages and blocks in Python", exc)
        _chain = None
    return _chain


def new_pages(level: TierLevel, slots: list[PageId], priority: Priority) -> list[Page]:
    """``[Page(level, slot, priority) for slot in slots]`` (each with the next uid), built by
    ``raykv.native._chain`` when it is bound. ``slots`` must be a list."""
    if _chain is not None:
        return _chain.make_pages(_uids, level, slots, priority)  # type: ignore[no-any-return]
    return [Page(level, slot, priority) for slot in slots]


def bound_chain() -> Any:
    """The bound ``raykv.native._chain`` module, or None when pages and blocks are built in Python."""
    return _chain

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
from collections.abc import Mapping
from typing import Any, Protocol

from raykv import native
from raykv.core.types import BlockKey, PageId, Priority, TierLevel

log = logging.getLogger(__name__)
_uids = itertools.count(1)


class BackedBlock(Protocol):
    """What a page knows of the committed block it backs (:class:`raykv.core.radix.Block` is
    the one implementation): its key, its parent node, its children and its depth."""

    @property
    def key(self) -> BlockKey: ...

    @property
    def parent(self) -> object: ...

    @property
    def children(self) -> Mapping[BlockKey, object]: ...

    @property
    def ordinal(self) -> int: ...


class Page:
    __slots__ = ("block", "holders", "leases", "level", "pins", "priority", "queued", "slot", "uid")

    def __init__(self, level: TierLevel, slot: PageId, priority: Priority) -> None:
        self.uid = next(_uids)
        self.level = level
        self.slot = slot
        self.priority = priority
        self.block: BackedBlock | None = None
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


compiled_chain: Any = native.load("_chain")
"""The compiled ``raykv.native._chain`` once bound (:func:`bind_compiled`), or None: then pages
(:func:`new_pages`), chains of blocks (``BlockRadixTree.insert_chain``) and queued chains
(``PriorityLRU.add_many``) are built in Python. Each of them reads it at every call, so setting it
to None (tests do) switches all three to Python."""


def bind_compiled(block_type: type) -> Any:
    """Bind ``raykv.native._chain`` to :class:`Page` and ``block_type``
    (:class:`raykv.core.radix.Block`, which calls this once at import); the module, or None when it
    is not built, turned off, or the classes' slots are not what it stores (then
    :data:`compiled_chain` becomes None: everything is built in Python)."""
    global compiled_chain
    if compiled_chain is None:
        return None
    try:
        compiled_chain.bind(Page, block_type)
    except TypeError as exc:
        log.warning("raykv.native._chain unusable (%s); building pages and blocks in Python", exc)
        compiled_chain = None
    return compiled_chain


def new_pages(level: TierLevel, slots: list[PageId], priority: Priority) -> list[Page]:
    """``[Page(level, slot, priority) for slot in slots]`` (each with the next uid), built by
    ``raykv.native._chain`` when it is bound. ``slots`` must be a list."""
    if compiled_chain is not None:
        return compiled_chain.make_pages(_uids, level, slots, priority)  # type: ignore[no-any-return]
    return [Page(level, slot, priority) for slot in slots]

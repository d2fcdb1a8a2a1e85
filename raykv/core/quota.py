"""Per-salt block quotas: at most ``CacheConfig.max_blocks_per_salt`` committed blocks per salt.

A salt (``ReuseScope.salt``, from a request's ``cache_salt``) is a tenant. The quota counts one
manager's committed blocks of a salt over all its tiers together: a block demoted to host or disk
still holds its tenant's share, so the limit is what users configure (one number per worker), and
only a drop (never a demotion) brings a tenant back under it. Blocks with no salt (salt None) are
one group of their own, limited like any salt.

A block's group is fixed when it is cached: a block under another block takes its parent's group;
a block under a scope root takes the salt of that scope, which the manager learns when a request
opens the scope (:meth:`SaltQuota.note_scope`). A block imported under a scope root no request
here has opened yet has no known salt: it counts in a group of its own, one per scope root, so a
peer's pages never use up, or evict from, another tenant's share.

Enforcement happens in ``PageStore.cache_blocks``: before a batch is cached, each group that would
exceed the limit drops its own least valuable blocks (:meth:`SaltQuota.plan_drops`: the eviction
policy's order, coldest tier first, restricted to the group's droppable leaves: committed, no
children, no holder, pin or lease). If the group cannot make enough room, its blocks that do not
fit (the last of the batch) are not cached, the same outcome as a block whose key is already
cached: a request keeps them as private pages, an import reports them as not imported. Another
group's blocks are never touched by the quota. The global eviction (a full tier) is unchanged; it
stays out of a tenant's way as long as the sum of the quotas (plus the pages requests hold) fits
the tiers.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

from raykv.core.eviction import EvictionPolicy
from raykv.core.page import Page
from raykv.core.radix import Block
from raykv.core.types import BlockKey

Group = Hashable
"""A quota group: a salt (int), None (no salt), or ``("scope", root_key)`` for an unknown scope."""


class SaltQuota:
    """The committed blocks of every group and the planning of quota drops (changes nothing in
    the tree or the policy itself; the store executes the drops)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.scopes: dict[BlockKey, int | None] = {}  # scope root key -> its salt
        self.group_of: dict[int, Group] = {}  # page uid -> group, one per committed block
        self.members: dict[Group, dict[int, Page]] = {}

    def note_scope(self, root_key: BlockKey, salt: int | None) -> None:
        """A request opened the scope whose root key is ``root_key`` (salt ``salt``)."""
        self.scopes[root_key] = salt

    def root_group(self, root_key: BlockKey) -> Group:
        """The group of a block cached directly under the scope root ``root_key``."""
        if root_key in self.scopes:
            return self.scopes[root_key]
        return ("scope", root_key)

    def group_of_page(self, page: Page) -> Group:
        return self.group_of[page.uid]

    def count(self, group: Group) -> int:
        members = self.members.get(group)
        return len(members) if members else 0

    def add(self, page: Page, group: Group) -> None:
        """``page`` now backs a committed block of ``group``."""
        self.group_of[page.uid] = group
        self.members.setdefault(group, {})[page.uid] = page

    def forget(self, page: Page) -> None:
        """``page`` no longer backs a committed block (no-op when it did not)."""
        group = self.group_of.pop(page.uid, _MISSING)
        if group is _MISSING:
            return
        members = self.members[group]
        del members[page.uid]
        if not members:
            del self.members[group]

    def clear(self) -> None:
        """Every block left the tree (the learned scopes stay)."""
        self.group_of.clear()
        self.members.clear()

    def plan_drops(
        self, group: Group, need: int, policy: EvictionPolicy, num_levels: int, keep: set[int]
    ) -> list[Page]:
        """Up to ``need`` of ``group``'s pages to drop, in execution order (a child before its
        parent): the policy's order on the coldest tier first, restricted to droppable leaves of
        the group and never a page whose uid is in ``keep``. A parent passed over because it had
        children follows as soon as its last child is planned."""
        members = self.members.get(group)
        if need <= 0 or not members:
            return []
        dropped: list[Page] = []
        gone: collections.Counter[int] = collections.Counter()  # id(block) -> children planned
        passed: dict[int, Page] = {}  # uid -> page walked over because it had children
        for page in _walk(policy, num_levels):
            if page.uid not in members or page.uid in keep:
                continue
            if not _droppable(page, gone):
                if page.block is not None and page.block.children:
                    passed[page.uid] = page
                continue
            next_page: Page | None = page
            while next_page is not None:
                dropped.append(next_page)
                if len(dropped) >= need:
                    return dropped
                next_page = _next_parent(next_page, gone, passed)
        return dropped


_MISSING = object()


def group_batch(
    quota: SaltQuota,
    blocks: Mapping[BlockKey, Block],
    keys: Sequence[BlockKey],
    parent_keys: Sequence[BlockKey],
) -> dict[Group, list[int]]:
    """The positions of a batch's new blocks (not cached, the first of a repeated key) by group,
    in batch order. A block's parent is cached (``blocks``), earlier in the batch, or a root."""
    batch: dict[BlockKey, Group] = {}
    out: dict[Group, list[int]] = {}
    for i, (key, parent_key) in enumerate(zip(keys, parent_keys)):
        if key in blocks or key in batch:
            continue
        parent = blocks.get(parent_key)
        if parent is not None:
            group = quota.group_of[parent.page.uid]
        elif parent_key in batch:
            group = batch[parent_key]
        else:
            group = quota.root_group(parent_key)
        batch[key] = group
        out.setdefault(group, []).append(i)
    return out


def _walk(policy: EvictionPolicy, num_levels: int) -> Iterator[Page]:
    for level in range(num_levels - 1, -1, -1):
        yield from policy.candidates(level)


def _droppable(page: Page, gone: collections.Counter[int]) -> bool:
    block = page.block
    if block is None or page.holders or page.pins or page.leases:
        return False
    return len(block.children) - gone[id(block)] == 0


def _next_parent(page: Page, gone: collections.Counter[int], passed: dict[int, Page]) -> Page | None:
    """Count ``page`` as planned to drop; its parent's page when that was passed over and is now
    a droppable leaf, else None."""
    assert page.block is not None
    parent = page.block.parent
    gone[id(parent)] += 1
    parent_page = getattr(parent, "page", None)
    if parent_page is None or parent_page.uid not in passed or not _droppable(parent_page, gone):
        return None
    del passed[parent_page.uid]
    return parent_page  # type: ignore[no-any-return]


def check(quota: SaltQuota, blocks: Iterable[Block]) -> None:
    """Raise AssertionError unless every committed block is counted once in its parent's group
    and no group holds more than the limit. ``blocks``: the tree's blocks."""
    seen = 0
    for block in blocks:
        page = block.page
        group = quota.group_of.get(page.uid, _MISSING)
        assert group is not _MISSING, f"{page!r}: committed block not counted in a quota group"
        assert quota.members[group].get(page.uid) is page, f"{page!r}: not a member of its group"
        parent = block.parent
        if isinstance(parent, Block):
            parent_page = parent.page
            assert quota.group_of.get(parent_page.uid) == group, f"{page!r}: group differs from its parent's"
        seen += 1
    assert seen == len(quota.group_of), f"{len(quota.group_of) - seen} quota entries for no block"
    for group, members in quota.members.items():
        assert 0 < len(members) <= quota.limit, f"group {group!r} holds {len(members)} > {quota.limit} blocks"

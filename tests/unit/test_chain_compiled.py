"""raykv.native._chain (compiled) builds imported pages and chains of blocks exactly as Python does.

Each test runs with the compiled builder (when it was built, as ``pip install`` does) and with
the Python one, and compares what comes out field by field; the builder's own refusals (a class
whose slots it cannot store, mismatched lists) change nothing.
"""

from __future__ import annotations

import gc
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import raykv.core.page as page_mod
from raykv.core.page import Page, new_pages
from raykv.core.radix import Block, BlockRadixTree, Root
from raykv.core.types import BlockKey, PageId, Priority, TierLevel

try:
    from raykv.native import _chain  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - CI builds it
    _chain = None

PAGE_FIELDS = ("level", "slot", "priority", "block", "pins", "leases", "holders", "queued")


@pytest.fixture(params=["compiled", "python"])
def builder(request, monkeypatch):
    if request.param == "compiled":
        if _chain is None:
            pytest.skip("raykv.native._chain was not built")
        assert page_mod.compiled_chain is _chain
    else:
        monkeypatch.setattr(page_mod, "compiled_chain", None)
    return request.param


def _keys(n: int, seed: int = 0) -> list[BlockKey]:
    return [BlockKey(bytes([seed, i % 256, i // 256]) + bytes(29)) for i in range(n)]


def _shape(block: Block) -> tuple:
    parent = block.parent.key
    return (
        block.key,
        parent,
        block.ordinal,
        block.num_tokens,
        block.checksum,
        list(block.children),
        block.page.slot,
    )


def test_new_pages_are_pages_as_init_makes_them(builder) -> None:
    slots = [PageId(s) for s in (7, 3, 9)]
    made = new_pages(TierLevel(1), slots, Priority(70))
    ref = [Page(TierLevel(1), s, Priority(70)) for s in slots]
    assert all(type(p) is Page and gc.is_tracked(p) for p in made)
    for a, b in zip(made, ref):
        assert [getattr(a, f) for f in PAGE_FIELDS] == [getattr(b, f) for f in PAGE_FIELDS]
    uids = [p.uid for p in made] + [p.uid for p in ref]
    assert uids == list(range(uids[0], uids[0] + 6))  # one counter, no uid twice
    assert new_pages(TierLevel(0), [], Priority(1)) == []


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), under_block=st.booleans())
def test_insert_chain_builds_the_same_tree_either_way(lengths: list[int], under_block: bool) -> None:
    trees = []
    for compiled in (True, False):
        saved = page_mod.compiled_chain
        page_mod.compiled_chain = saved if compiled else None
        try:
            tree = BlockRadixTree()
            root = tree.parent_node(BlockKey(bytes(32)), create_root=True)
            parent: Root | Block = root  # type: ignore[assignment]
            if under_block:
                parent = tree.insert(
                    parent, _keys(1, seed=200)[0], new_pages(TierLevel(0), [PageId(999)], 5)[0], 4
                )
            for i, n in enumerate(lengths):
                keys, pages = (
                    _keys(n, seed=i),
                    new_pages(TierLevel(0), [PageId(100 * i + j) for j in range(n)], 5),
                )
                tokens = [4] * (n - 1) + [i + 1]
                tree.insert_chain(
                    parent, tuple(keys) if i % 2 else keys, pages, tuple(tokens) if i % 2 else tokens
                )
                assert all(p.block is tree.blocks[k] for k, p in zip(keys, pages))
            trees.append(tree)
        finally:
            page_mod.compiled_chain = saved
    a, b = trees
    assert list(a.blocks) == list(b.blocks) and list(a.roots) == list(b.roots)
    assert [_shape(x) for x in a.blocks.values()] == [_shape(x) for x in b.blocks.values()]
    assert all(type(x) is Block and gc.is_tracked(x) for x in a.blocks.values())


def test_chains_are_freed_with_the_tree(builder) -> None:
    """No reference leaks: keys, pages and blocks go when the tree does."""
    keys = _keys(50)
    base = [sys.getrefcount(k) for k in keys]
    tree = BlockRadixTree()
    root = tree.parent_node(BlockKey(bytes(32)), create_root=True)
    tree.insert_chain(root, keys, new_pages(TierLevel(0), list(range(50)), 5), [4] * 50)  # type: ignore[arg-type]
    assert all(sys.getrefcount(k) > b for k, b in zip(keys, base))
    del tree, root
    gc.collect()
    assert [sys.getrefcount(k) for k in keys] == base


@pytest.mark.skipif(_chain is None, reason="raykv.native._chain was not built")
def test_the_builder_refuses_what_it_cannot_build() -> None:
    class NoQueued:
        __slots__ = ("block", "holders", "leases", "level", "pins", "priority", "slot", "uid")

    class WithDict:
        pass

    for bad in (NoQueued, WithDict):
        with pytest.raises(TypeError):
            _chain.bind(bad, Block)
    _chain.bind(Page, Block)  # still bound to the real classes after the refusals
    root = Root(BlockKey(bytes(32)))
    pages = new_pages(TierLevel(0), [PageId(1), PageId(2)], 5)
    with pytest.raises(ValueError):
        _chain.link_chain(root, _keys(2), pages, [4], 0)
    with pytest.raises(TypeError):
        _chain.link_chain(root, _keys(2), [pages[0], object()], [4, 4], 0)
    with pytest.raises(RuntimeError):
        _chain.make_pages(iter(()), TierLevel(0), [PageId(1)], 5)  # the uids ran out
    assert root.children == {} and all(p.block is None for p in pages)


class _Bytes(bytes):
    pass


key_items = st.one_of(
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=0, max_size=40),
    st.binary(min_size=32, max_size=32).map(bytearray),
    st.binary(min_size=32, max_size=32).map(_Bytes),
    st.text(min_size=32, max_size=32),
    st.integers(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(key_items, max_size=40), st.sampled_from([list, tuple, iter]))
def test_all_keys_checks_keys_as_the_set_passes_and_check_block_keys_agrees(items, kind) -> None:
    """``all_keys`` (check_block_keys' fast pass) is True exactly for a list or tuple of exact
    32-byte bytes; check_block_keys gives the same keys or the same ValueError either way."""
    from raykv.core import types

    if _chain is None:
        pytest.skip("raykv.native._chain was not built")
    seq = kind(items)
    plain = kind in (list, tuple) and all(type(k) is bytes and len(k) == 32 for k in items)
    assert _chain.all_keys(seq) is plain
    answers = []
    for fast in (_chain.all_keys, None):
        old, types._all_keys = types._all_keys, fast
        try:
            answers.append(types.check_block_keys(list(items)))
        except ValueError as exc:
            answers.append(str(exc))
        finally:
            types._all_keys = old
    assert answers[0] == answers[1]


def _state(policy) -> list:
    """Every queue of every level, (level, priority, [slots in queue order]), and the counts."""
    queues = [
        (level, priority, [p.slot for p in queue.values()])
        for level, by_priority in enumerate(policy._levels)
        for priority, queue in sorted(by_priority.items())
    ]
    return [queues, list(policy._counts)]


def test_a_chain_is_queued_for_eviction_as_page_by_page(builder) -> None:
    """PriorityLRU.add_many (raykv.native._chain.queue_chain when compiled): the same queues, order and
    counts as adding each page; mixed levels or priorities go where each page belongs; a page
    already queued raises ValueError with nothing queued (no empty queue left either)."""
    from raykv.core.eviction import PriorityLRU

    def pages(level: int, first: int, n: int, priority: int = 50) -> list[Page]:
        return new_pages(TierLevel(level), [PageId(first + i) for i in range(n)], Priority(priority))

    many, one = PriorityLRU(2), PriorityLRU(2)
    batches = [
        pages(0, 0, 5),
        pages(1, 10, 3, 20),
        pages(0, 20, 2, 80),
        [*pages(0, 30, 2), *pages(1, 40, 2)],  # two levels
        [*pages(0, 50, 2, 10), *pages(0, 60, 2, 90)],  # two priorities
    ]
    for batch in batches:
        many.add_many(batch)
        for page in batch:
            one.add(Page(page.level, page.slot, page.priority))
        assert all(p.queued for p in batch)
        assert _state(many) == _state(one)
    assert [p.slot for p in many.candidates(0)][:4] == [50, 51, 0, 1]  # priority 10 first, then LRU
    before = _state(many)
    fresh = pages(0, 70, 3, 33)  # a priority with no queue yet
    with pytest.raises(ValueError):
        many.add_many([*fresh, batches[0][0]])  # the last one is queued already
    assert _state(many) == before and not any(p.queued for p in fresh)

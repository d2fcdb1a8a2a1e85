"""Shortcuts for the usual batch, one request's chain of blocks: each must give exactly the
general path's answer, and bad input must still be refused with nothing changed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from import_support import chain, toks

import raykv.core.page as page_mod
from raykv import ImportRejectedError
from raykv.core.errors import StateError
from raykv.core.page import Page
from raykv.core.radix import BlockRadixTree, Root
from raykv.core.tiers.cuda_copy import one_run
from raykv.core.types import BlockKey, PageId, Priority, TierLevel, check_block_keys


def _pages(n: int) -> list[Page]:
    return [Page(TierLevel(0), PageId(i), Priority(50)) for i in range(n)]


def _keys(n: int, seed: int = 0) -> list[BlockKey]:
    return [BlockKey(bytes([seed, i]) * 16) for i in range(n)]


def test_insert_chain_builds_what_insert_one_by_one_builds() -> None:
    keys, pages = _keys(5), _pages(5)
    chained, single = BlockRadixTree(), BlockRadixTree()
    chained.insert_chain(Root(BlockKey(bytes(32))), keys, pages, [4] * 5)
    node: object = single.parent_node(BlockKey(bytes(32)), create_root=True)
    for key, page in zip(keys, _pages(5)):
        node = single.insert(node, key, page, 4)  # type: ignore[arg-type]
    assert list(chained.blocks) == list(single.blocks) and list(chained.roots) == list(single.roots)
    for key in keys:
        a, b = chained.blocks[key], single.blocks[key]
        assert (a.parent_key, a.ordinal, a.num_tokens, list(a.children)) == (
            b.parent_key,
            b.ordinal,
            b.num_tokens,
            list(b.children),
        )
        assert a.page.block is a
    assert [b.key for b in chained.match(BlockKey(bytes(32)), keys)] == keys


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("problem", ["present", "twice", "backed", "backed, new root", "lengths"])
def test_insert_chain_refuses_bad_chains_changing_nothing(
    problem: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused with StateError, the tree (its roots too) and the pages as they were, whichever
    builder links the chain (the compiled one checks the pages itself)."""
    if pure:
        monkeypatch.setattr(page_mod, "compiled_chain", None)
    tree, keys, pages = BlockRadixTree(), _keys(4), _pages(4)
    root = tree.parent_node(BlockKey(bytes(32)), create_root=True)
    assert root is not None
    tree.insert(root, _keys(1, seed=9)[0], _pages(1)[0], 4)
    if problem == "backed, new root":
        root = Root(BlockKey(bytes([7]) * 32))  # not in the tree yet: insert_chain would add it
    tokens = [4] * 4
    if problem == "present":
        keys[2] = _keys(1, seed=9)[0]
    elif problem == "twice":
        keys[3] = keys[1]
    elif problem.startswith("backed"):
        pages[1].block = tree.blocks[_keys(1, seed=9)[0]]
    else:
        tokens = [4] * 3
    before = (dict(tree.blocks), dict(tree.roots), dict(root.children), [p.block for p in pages])
    with pytest.raises(StateError):
        tree.insert_chain(root, keys, pages, tokens)
    assert (dict(tree.blocks), dict(tree.roots), dict(root.children), [p.block for p in pages]) == before


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        ([3], True),
        ([3, 4, 5], True),
        ([5, 4, 3], False),
        ([3, 5, 4], False),
        ([3, 4, 4, 5], False),
        ([], False),
    ],
)
def test_one_run_only_for_lists_in_ascending_steps_of_one(slots: list[int], expected: bool) -> None:
    assert one_run(slots) is expected
    assert one_run(tuple(slots)) is False  # anything but a list goes the general way


def test_key_lists_check_every_key_not_the_total_length() -> None:
    good = _keys(3)
    assert check_block_keys(good) == good and check_block_keys([]) == []
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        check_block_keys([b"x" * 31, b"y" * 33])  # 64 bytes together
    converted = check_block_keys([*good[:2], bytearray(good[2])])  # bytes-like: made bytes
    assert converted == good and type(converted[2]) is bytes
    with pytest.raises(ValueError, match="got str"):
        check_block_keys([*good[:2], "k" * 32])


def test_an_import_with_compensating_key_sizes_is_rejected(make_manager, run_request, state_of) -> None:
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 12))
    keys = list(records.keys)
    keys[1], keys[2] = keys[1][:31], keys[2] + b"!"  # still 96 bytes in all
    parents = [records.parent_keys[0], keys[0], keys[1]]
    bad = dataclasses.replace(records, keys=keys, parent_keys=parents)
    before = state_of(dst)
    with pytest.raises(ImportRejectedError, match="record 1"):
        dst.import_pages(bad, data, None, verify=False)
    assert state_of(dst) == before


def test_policy_add_many_queues_as_add_one_by_one() -> None:
    from raykv.core.eviction import PriorityLRU

    one, many = PriorityLRU(2), PriorityLRU(2)
    first, second = _pages(6), _pages(6)
    for a, b in zip(first[:2], second[:2]):
        one.add(a)
        many.add(b)
    for page in first[2:]:
        one.add(page)
    many.add_many(second[2:])
    assert [p.slot for p in one.candidates(0)] == [p.slot for p in many.candidates(0)]
    assert one.count(0) == many.count(0) == 6 and all(p.queued for p in second)
    mixed = [Page(TierLevel(1), PageId(i), Priority(90 - 40 * (i % 2))) for i in range(4)]
    many.add_many(mixed)  # two priorities: queued one by one
    assert [p.slot for p in many.candidates(1)] == [1, 3, 0, 2] and many.count(1) == 4
    fresh = _pages(2)
    with pytest.raises(ValueError):
        many.add_many([*fresh, second[0]])  # one already queued: nothing queued
    assert not any(p.queued for p in fresh) and many.count(0) == 6


def test_slot_events_forget_an_event_known_complete() -> None:
    """``completed(event)`` drops that event (its slots count as ready, no query), others stay."""
    from raykv.core.tiers.cuda_util import SlotEvents

    class Event:
        def __init__(self) -> None:
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            return False

    events, a, b = SlotEvents(), Event(), Event()
    events.set([0, 1, 2], a)
    events.set([3], b)
    events.completed(a)
    assert len(events) == 1 and events.pending([0, 1, 2]) == [] and a.queries == 0
    assert events.pending([2, 3]) == [b]
    events.completed(Event())  # not one of its events: nothing changes
    assert len(events) == 1


slot_batches = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 40), st.integers(0, 12)).map(lambda ab: list(range(ab[0], ab[0] + ab[1]))),
        st.lists(st.integers(0, 60), max_size=8, unique=True),  # scattered, any order
        st.lists(st.integers(0, 60), max_size=8, unique=True).map(lambda s: np.asarray(s, dtype=np.int64)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(slot_batches, st.lists(st.integers(0, 11), max_size=4), st.lists(st.integers(0, 60), max_size=10))
def test_slot_events_follow_the_latest_event_of_each_slot(batches, done, asked) -> None:
    """``set`` of runs (a slice), scattered lists and arrays (an index array), growing the token
    array as slots appear: ``pending`` always names the distinct latest events of the slots asked
    about that are not known complete, in the order they were set (a plain dict model)."""
    from raykv.core.tiers.cuda_util import SlotEvents

    class Event:
        def query(self) -> bool:
            return False

    events, latest, made = SlotEvents(), {}, []
    for slots in batches:
        made.append(Event())
        events.set(slots, made[-1])
        latest.update({int(s): len(made) - 1 for s in slots})
    finished = {i for i in done if i < len(made)}
    for i in finished:
        events.completed(made[i])
    want = sorted({latest[s] for s in asked if s in latest} - finished)
    assert events.pending(asked) == [made[i] for i in want]


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.data())
def test_gpu_read_picks_source_slots_as_the_plain_loop(slots, data) -> None:
    """gpu_read's source slots of a chunk's records: one slice for a run of records, else the loop."""
    from raykv.transfer.paths.gpu_read import pick_slots

    lo = data.draw(st.integers(0, len(slots) - 1))
    run = list(range(lo, data.draw(st.integers(lo, len(slots)))))
    some = sorted(data.draw(st.sets(st.integers(0, len(slots) - 1))))
    for new in (run, some, []):
        assert pick_slots(slots, new) == [slots[i] for i in new]

"""raykv.index.keytable: the compiled KeyTable behaves as the dict-based one, op for op.

Random programs of stores, overwrites, deletes, lookups (single and batched, with malformed keys
among them), clears and listings run against both tables and a plain dict; every answer and the
final contents must agree. Growth, tombstone reuse and reference counts are checked directly.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv import native
from raykv.index.keytable import DictKeyTable, new_key_table

compiled = pytest.mark.skipif(native.load("_keytable") is None, reason="raykv.native._keytable was not built")

POOL = [bytes([i]) * 32 for i in range(12)] + [os.urandom(32) for _ in range(12)]
BAD = [b"short", b"x" * 33, "a str of 32 characters long....", bytearray(32), 7, None, (1,)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(POOL), st.integers(0, 5)),
        st.tuples(st.just("del"), st.sampled_from(POOL), st.just(0)),
        st.tuples(st.just("get"), st.sampled_from(POOL + BAD), st.just(0)),
        st.tuples(st.just("many"), st.lists(st.sampled_from(POOL + BAD), max_size=80), st.just(0)),
        st.tuples(st.just("prefetch"), st.lists(st.sampled_from(POOL + BAD), max_size=80), st.just(0)),
        st.tuples(st.just("clear"), st.just(b""), st.just(0)),
    ),
    max_size=120,
)


def _apply(table, op, key, value):
    if op == "set":
        table[key] = ("v", value)
        return None
    if op == "del":
        try:
            del table[key]
        except KeyError:
            return "missing"
        return None
    if op == "get":
        if not _hashable(key):  # the dict raises here; the compiled table answers "absent"
            return (None, "d", False) if isinstance(table, DictKeyTable) else _absent(table, key)
        return (table.get(key), table.get(key, "d"), key in table)
    if op == "many":
        return table.get_many(key)
    if op == "prefetch":  # warms slots only: changes nothing, answers nothing
        return table.prefetch(key)
    table.clear()
    return None


def _absent(table, key):
    return (table.get(key), table.get(key, "d"), key in table)


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        return False
    return True


@compiled
@settings(max_examples=150, deadline=None)
@given(ops)
def test_compiled_table_matches_the_dict_table(program):
    fast, slow = new_key_table(), DictKeyTable()
    for op, key, value in program:
        if op == "many":
            assert fast.get_many(key) == [slow.get(k) if _hashable(k) else None for k in key]
            continue
        assert _apply(fast, op, key, value) == _apply(slow, op, key, value)
        assert len(fast) == len(slow)
    assert sorted(fast.keys()) == sorted(slow.keys())
    assert all(fast[k] == slow[k] for k in slow)


@compiled
def test_growth_and_tombstones_keep_every_key():
    table = new_key_table()
    keys = [os.urandom(32) for _ in range(20_000)]
    for i, k in enumerate(keys):
        table[k] = i
    for k in keys[::2]:
        del table[k]
    for i, k in enumerate(keys[::2]):  # reuse tombstones
        table[k] = -i
    assert len(table) == len(keys)
    assert table.get_many(keys[:4]) == [0, 1, -1, 3]
    assert table.get_many(keys) == [(-(i // 2) if i % 2 == 0 else i) for i in range(len(keys))]
    table.clear()
    assert len(table) == 0 and table.get(keys[0]) is None and table.keys() == []


@compiled
def test_references_are_released():
    table = new_key_table()
    value = object()
    base = sys.getrefcount(value)
    keys = [os.urandom(32) for _ in range(300)]
    for k in keys:
        table[k] = value
    assert sys.getrefcount(value) == base + 300
    table.get_many(keys)  # the returned list is dropped at once
    for k in keys[:100]:
        del table[k]
    table[keys[100]] = 5  # overwrite drops the old reference
    assert sys.getrefcount(value) == base + 199
    table.clear()
    assert sys.getrefcount(value) == base
    for k in keys:
        table[k] = value
    del table
    gc.collect()
    assert sys.getrefcount(value) == base


@compiled
def test_bad_keys_are_refused_or_absent():
    table = new_key_table()
    for bad in BAD:
        assert table.get(bad) is None and table.get(bad, 1) == 1
        assert bad not in table
        with pytest.raises(KeyError):
            table[bad]
        with pytest.raises(KeyError):
            del table[bad]
        with pytest.raises(TypeError):
            table[bad] = 1
    assert table.get_many(BAD) == [None] * len(BAD)
    with pytest.raises(TypeError):
        table.get_many(5)
    with pytest.raises(TypeError):
        table.prefetch(5)
    assert table.prefetch(BAD) is None
    with pytest.raises(TypeError):
        type(table)(1)
    assert len(table) == 0


def test_pure_fallback_has_the_same_interface(monkeypatch):
    monkeypatch.setenv("RAYKV_PURE_INDEX", "1")
    table = new_key_table()
    assert isinstance(table, DictKeyTable)
    key = os.urandom(32)
    table[key] = 1
    assert table.get_many([key, b"x"]) == [1, None] and list(table.keys()) == [key]


def _random_index(rng, lanes, chain):
    """A PrefixIndex whose workers hold random prefixes of ``chain`` on random tiers."""
    from raykv.index.prefix_index import OP_STORE, EventBatch, PrefixIndex

    ix = PrefixIndex()
    for i, lane in enumerate(lanes):
        ix.register_worker(f"w{i}", lane, 1)
        end = rng.randrange(0, len(chain) + 1)
        held = [k for k in chain[:end] if rng.random() < 0.95]
        if held:
            ops = tuple((OP_STORE, k, rng.choice((0, 0, 0, 1, 2))) for k in held)
            ix.apply_batch(EventBatch(f"w{i}", 1, 1, 1, ops))
    return ix


@compiled
@pytest.mark.parametrize("seed", range(12))
def test_compiled_route_equals_the_python_walk_order_included(seed, monkeypatch):
    """PrefixIndex.route through the compiled walk gives what the Python walk (a dict table)
    gives: the same matches in the same order (a decision's tie between equal prefixes follows
    the order), up to 64 lanes, sparse and dense."""
    import random

    chain = [os.urandom(32) for _ in range(random.Random(seed).randrange(1, 200))]
    lanes = ([0, 1], list(range(8)), random.Random(seed).sample(range(64), 12), list(range(64)))[seed % 4]
    fast_ix = _random_index(random.Random(seed), lanes, chain)
    monkeypatch.setenv("RAYKV_PURE_INDEX", "1")
    slow_ix = _random_index(random.Random(seed), lanes, chain)
    gap = [*chain[: len(chain) // 2], os.urandom(32), *chain[len(chain) // 2 :]]
    for keys in (chain, chain[:1], chain[1:], gap, [], chain):
        fast, slow = fast_ix.route(keys), slow_ix.route(keys)
        assert fast == slow and list(fast) == list(slow)
        fast.clear()  # the caller owns its answer: a remembered one comes back whole
        again = fast_ix.route(keys)
        assert again == slow and list(again) == list(slow)


@compiled
def test_compiled_route_leaves_unreadable_entries_to_python():
    """An entry that is not the index's tuple of lane masks, or lanes past 64: None (Python routes)."""
    table = new_key_table()
    key = POOL[0]
    names = ("a", "b")
    table[key] = (1, 1, 0, 0)
    assert table.route([key], names, tuple) == {"a": (("a", 1, 1, 0, 0, 0))}
    for bad in ((1, 1, 0), (1 << 40, 0, 0, 0), (3, 3, 0, 0), (-1, 0, 0, 0), [1, 1, 0, 0]):
        table[key] = bad
        assert table.route([key], names, tuple) is None
    table[key] = (1, 1, 0, 0)
    assert table.route([key], ("a",) * 65, tuple) is None
    assert table.route([POOL[1]], names, tuple) == {}

"""raykv.index.holders: the compiled table answers as its pure-Python twin, op for op.

Random programs of packed batches (stores, removes, clears, malformed records), lane drops,
lookups, routes and listings run against both tables; every answer must agree, including the
order of a route's matches. Growth is checked while a move is under way (both tables read), and
the packed-batch helpers (pack, unpack, split) against their definitions.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv import native
from raykv.index.holders import (
    KEY_PREFIX,
    OP_CLEAR,
    OP_REMOVE,
    OP_STORE,
    RECORD,
    PyHolders,
    pack_ops,
    split,
    unpack_ops,
)
from raykv.index.prefix_index import EventBatch, PrefixIndex, RouteMatch, shard_of
from raykv.index.route import FIRST_LOOKUPS, route_held, unpack_rows

compiled_mod = native.load("_holders")
compiled = pytest.mark.skipif(compiled_mod is None, reason="raykv.native._holders was not built")

POOL = [bytes([i]) * 32 for i in range(10)] + [os.urandom(32) for _ in range(14)]
LANES = [0, 1, 2, 5, 63, 64, 700, 4095]

op_st = st.one_of(
    st.tuples(st.just(OP_STORE), st.sampled_from(POOL), st.integers(0, 2)),
    st.tuples(st.just(OP_REMOVE), st.sampled_from(POOL), st.just(0)),
    st.tuples(st.just(OP_CLEAR), st.just(b""), st.just(0)),
)
step_st = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(LANES), st.lists(op_st, max_size=30)),
    st.tuples(st.just("bad"), st.sampled_from(LANES), st.lists(op_st, max_size=5)),
    st.tuples(st.just("drop"), st.sampled_from(LANES), st.just([])),
)


def _names(lanes: list[int]) -> tuple:
    top = max(lanes) + 1
    return tuple(f"w{lane}" if lane in lanes else None for lane in range(top))


def _py_route(table: PyHolders, keys: list[bytes], names: tuple) -> dict:
    lane_names = {lane: n for lane, n in enumerate(names) if n is not None}
    n = len(keys)
    return route_held(table.entries(keys[:FIRST_LOOKUPS]), n, lane_names, keys, table.entries) if n else {}


def _same(a, b, chains: list[list[bytes]], names: tuple) -> None:
    assert len(a) == len(b)
    assert a.entries(POOL) == b.entries(POOL)
    assert a.entries(b"".join(POOL)) == b.entries(POOL)
    for lane in LANES:
        assert a.lane_blocks(lane) == b.lane_blocks(lane)
    for chain in chains:
        want = _py_route(b, chain, names)
        got = a.route(chain, names, RouteMatch)
        assert list(got.items()) == list(want.items())  # same matches, same order
        assert unpack_rows(a.route_rows(b"".join(chain)), dict(enumerate(names))) == want


@compiled
@settings(max_examples=150, deadline=None)
@given(steps=st.lists(step_st, max_size=25), seed=st.integers(0, 2**16))
def test_compiled_table_matches_python_op_for_op(steps, seed):
    rng = random.Random(seed)
    chains = [rng.sample(POOL, rng.randint(1, len(POOL))) for _ in range(4)] + [POOL[:10], []]
    c, p = compiled_mod.Holders(), PyHolders()
    names = _names(LANES)
    for kind, lane, ops in steps:
        data = pack_ops(ops)
        if kind == "bad":  # one malformed record anywhere: refused whole, nothing changes
            data += pack_ops([(OP_STORE, b"short", 0)]) + data
            for t in (c, p):
                assert not t.validate(data)
                with pytest.raises(ValueError):
                    t.apply(lane, data)
        elif kind == "apply":
            assert c.validate(data) and p.validate(data)
            assert c.apply(lane, data) == p.apply(lane, data)
        else:
            assert c.drop_lane(lane) == p.drop_lane(lane)
        _same(c, p, chains, names)


@compiled
def test_growth_moves_a_few_slots_per_write_and_answers_throughout():
    rng = random.Random(7)
    keys = [rng.randbytes(32) for _ in range(20_000)]
    c, p = compiled_mod.Holders(), PyHolders()
    seen_moving = False
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        lane = start // 500 % 3
        data = pack_ops((OP_STORE, k, rng.randint(0, 2)) for k in chunk)
        assert c.apply(lane, data) == p.apply(lane, data)
        seen_moving |= c.stats()["moving"]
        probe = rng.sample(keys[: start + 500], 200)
        assert c.entries(probe) == p.entries(probe)  # answers stay right mid-move
    assert seen_moving and c.stats()["moves"] >= 5
    while c.maintain(1 << 12):
        pass
    assert not c.stats()["moving"] and c.entries(keys) == p.entries(keys) and len(c) == len(keys)
    stats = c.stats()
    assert 8 * stats["filled"] <= 7 * stats["capacity"]
    gone = c.drop_lane(0)
    assert gone == p.drop_lane(0) and len(c) == len(p) == len(keys) - gone
    # dropped keys free their slots at the next move
    more = pack_ops((OP_STORE, rng.randbytes(32), 0) for _ in range(30_000))
    assert c.apply(1, more) == p.apply(1, more)
    while c.maintain(1 << 16):
        pass
    assert c.entries(keys) == p.entries(keys) and len(c) == len(p)


def test_pack_unpack_and_split_follow_their_definitions():
    rng = random.Random(3)
    ops = [(OP_STORE, rng.randbytes(32), rng.randint(0, 2)) for _ in range(50)]
    ops += [(OP_REMOVE, rng.randbytes(32), 0), (OP_CLEAR, b"", 0)]
    rng.shuffle(ops)
    data = pack_ops(ops)
    assert len(data) == RECORD * len(ops) and unpack_ops(data) == tuple(ops)
    for n in (1, 2, 3, 8):
        parts = split(data, n)
        assert len(parts) == n
        for s, part in enumerate(parts):
            want = [op for op in ops if op[0] == OP_CLEAR or shard_of(op[1], n) == s]
            assert unpack_ops(part) == tuple(want)
    with pytest.raises(ValueError):
        split(data, 0)


def test_the_index_keeps_key_prefixes_and_both_tables_route_alike(monkeypatch):
    rng = random.Random(5)
    chain = [rng.randbytes(32) for _ in range(100)]
    indexes = [PrefixIndex()]
    monkeypatch.setenv("RAYKV_PURE_INDEX", "1")
    indexes.append(PrefixIndex())
    answers = []
    for ix in indexes:
        for lane in range(70):  # past 64 lanes
            ix.register_worker(f"w{lane}", lane, 1)
        for lane in range(0, 70, 3):
            ops = [(OP_STORE, k, (i + lane) % 3) for i, k in enumerate(chain[: 10 + lane])]
            ix.apply_batch(_batch(f"w{lane}", ops))
        answers.append((ix.route(chain), ix.route_rows(b"".join(chain)), ix.lookup(chain)))
        assert set(ix.worker_blocks("w3")) == {k[:KEY_PREFIX] for k in chain[:13]}
    assert answers[0] == answers[1]
    assert answers[0][0]["w69"] == RouteMatch("w69", 79, 27, 26, 26)


def _batch(worker: str, ops):
    from raykv.index.prefix_index import EventBatch

    return EventBatch(worker, 1, 1, len(ops), tuple(ops))


def test_a_presized_index_never_moves_and_config_checks_the_capacity():
    from actors.cache.settings import ConfigError, DeploymentConfig, settings_from_dict

    rng = random.Random(9)
    ix = PrefixIndex(capacity=50_000)
    ix.register_worker("w", 0, 1)
    ops = [(OP_STORE, rng.randbytes(32), 0) for _ in range(50_000)]
    ix.apply_batch(_batch("w", ops))
    stats = ix.table_stats()
    assert len(ix) == 50_000 and stats["moves"] == 0 and not stats["moving"]
    if compiled_mod is not None:
        assert 7 * stats["capacity"] >= 8 * 50_000
    assert settings_from_dict({"deployment": {"index_capacity": 10**9}}).deployment.index_capacity == 10**9
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError):
            DeploymentConfig(index_capacity=bad)


@compiled
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_moves_interleaved_with_removes_clears_and_drops_match_python(seed):
    """Random stores, removes, clears and lane drops over a few thousand keys, so the compiled
    table grows (and compacts) many times with writes, drops and reads in the middle of moves."""
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(3_000)]
    c, p = compiled_mod.Holders(), PyHolders()
    lanes = [0, 3, 64, 1000]
    names = _names(lanes)
    chains = [keys[i : i + 100] for i in range(0, 600, 100)]
    for step in range(60):
        lane = rng.choice(lanes)
        kind = rng.random()
        if kind < 0.05:
            assert c.drop_lane(lane) == p.drop_lane(lane)
        elif kind < 0.08:
            c.maintain(rng.choice([1, 7, 1 << 12]))
        else:
            n = rng.randint(1, 400)
            ops = []
            for _ in range(n):
                r = rng.random()
                if r < 0.7:
                    ops.append((OP_STORE, rng.choice(keys), rng.randint(0, 2)))
                elif r < 0.995:
                    ops.append((OP_REMOVE, rng.choice(keys), 0))
                else:
                    ops.append((OP_CLEAR, b"", 0))
            data = pack_ops(ops)
            assert c.apply(lane, data) == p.apply(lane, data), step
        assert len(c) == len(p), step
        probe = rng.sample(keys, 300)
        assert c.entries(probe) == p.entries(probe), step
        chain = rng.choice(chains)
        assert list(c.route(chain, names, RouteMatch).items()) == list(_py_route(p, chain, names).items())
    for lane in lanes:
        assert c.lane_blocks(lane) == p.lane_blocks(lane)
    assert c.stats()["moves"] > 0


def test_a_popular_prefix_answer_is_fresh_each_time_and_follows_changes():
    """Answers with many matches come from a memo keyed by their content: each call gets its own
    dict, and a change of the holders (or of the workers' names) gives the new answer."""
    rng = random.Random(4)
    chain = [rng.randbytes(32) for _ in range(50)]
    ix = PrefixIndex()
    for lane in range(20):
        ix.register_worker(f"w{lane}", lane, 1)
        ix.apply_batch(_batch(f"w{lane}", [(OP_STORE, k, lane % 3) for k in chain[: 30 + lane]]))
    first = ix.route(chain)
    assert len(first) == 20 and first["w7"] == RouteMatch("w7", 37, 0, 37, 0)
    first.pop("w7")
    again = ix.route(chain)
    assert len(again) == 20 and again is not first
    ix.apply_batch(EventBatch("w7", 1, 38, 38, ((OP_REMOVE, chain[5], 0),)))
    assert ix.route(chain)["w7"] == RouteMatch("w7", 5, 0, 5, 0)
    ix.remove_worker("w3")
    ix.register_worker("v3", 3, 1)  # same lane, another name: the answer names it
    after = ix.route(chain)
    assert "w3" not in after and "v3" not in after and len(after) == 19

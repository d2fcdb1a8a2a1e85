"""The compiled one-sided reader (``raykv.native._shmread``) answers exactly as the Python one.

Random directory states (binds, unbinds, duplicate keys, keys whose first 8 bytes read 0 or 1,
slots left mid-edit, table cells corrupted to point anywhere) are read by both readers: every
answer (where the keys were located, the pages, parents, flags, token counts, or None) must agree,
also when the owner changes a located slot between the copy and the re-check (``after_copy``).
Bad arguments raise typed errors and never crash or touch memory outside the buffers given.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import random
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.core import threads
from raykv.core.errors import InvalidArgumentError
from raykv.core.tiers import shm_directory
from raykv.core.tiers.shm_directory import DirectoryView, Located, ShmDirectory
from raykv.transfer.pages.results import PulledPages
from raykv.transfer.paths import shm_read

pytestmark = [
    pytest.mark.skipif(shm_read._shmread is None, reason="raykv.native._shmread was not built"),
    pytest.mark.skipif(not shm_directory.supported(), reason="one-sided reads need x86-64"),
]

SLOTS, PAGE = 40, 64
KEYS = [
    ((i + 2) * 0x9E3779B97F4A7C15 % (1 << 64) | 2).to_bytes(8, "little") + bytes([i]) * 24 for i in range(44)
]
TWINS = [k[:8] + bytes([200 + i]) * 24 for i, k in enumerate(KEYS[:6])]  # same tags: probing
UNINDEXED = [bytes(8) + b"\x07" * 24, (1).to_bytes(8, "little") + b"\x09" * 24]  # tags 0 and 1
POOL = [*KEYS, *TWINS, *UNINDEXED]
_names = itertools.count()


@contextlib.contextmanager
def _readers(base: str, num_slots: int = SLOTS, page: int = PAGE) -> Iterator[tuple[Any, Any, Any]]:
    """An owner's directory, and a pure and a compiled peer reading it and a random tier."""
    directory = ShmDirectory(os.path.join(base, f"raykv-tier-{next(_names)}"), num_slots, page)
    tier = np.random.default_rng(num_slots).integers(0, 256, (num_slots, page), dtype=np.uint8)
    view = DirectoryView(directory._mmap, num_slots)
    fast = shm_read.compiled_reader(directory._mmap, tier, num_slots, page, force=True)
    mapping = types.SimpleNamespace(array=tier)
    pure = types.SimpleNamespace(compiled=None, directory=view, mapping=mapping, page_bytes=page)
    compiled = types.SimpleNamespace(compiled=fast, directory=view, mapping=mapping, page_bytes=page)
    try:
        yield directory, pure, compiled
    finally:
        fast.release()
        view.release()
        directory.close()


def _apply(directory: ShmDirectory, op: tuple[Any, ...]) -> None:
    kind, a, b = op
    if kind == "fill":  # bind every slot from a (the usual state: chains in consecutive slots)
        for slot in range(a, SLOTS):
            directory.bind(slot, POOL[(slot + b) % len(POOL)], bytes([slot]) * 32, slot % 3 == 0, slot + 1)
    elif kind == "bind":
        directory.bind(a, POOL[b], bytes([b]) * 32, b % 2 == 0, 16 + b)
    elif kind == "unbind":
        directory.unbind([a])
    elif kind == "odd":  # the owner is mid-edit on the slot
        directory._gen[a] += 1
    elif kind == "cell":  # a corrupt table: a cell names any slot at all
        directory._cells[a % len(directory._cells)] = b
    elif kind == "tag":  # a tag copied into another cell (its slot holds another key)
        directory._tags[a % len(directory._tags)] = shm_directory._tag(POOL[b]) | 2


slots = st.integers(0, SLOTS - 1)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("fill"), st.integers(0, SLOTS // 2), st.integers(0, len(POOL))),
        st.tuples(st.sampled_from(["bind"]), slots, st.integers(0, len(POOL) - 1)),
        st.tuples(st.sampled_from(["unbind", "odd"]), slots, st.just(0)),
        st.tuples(st.just("cell"), st.integers(0, 127), st.sampled_from([-(2**63), -1, SLOTS, 2**62, 3, 0])),
        st.tuples(st.just("tag"), st.integers(0, 127), st.integers(0, len(POOL) - 1)),
    ),
    max_size=30,
)
queries = st.lists(
    st.one_of(
        st.tuples(st.just("run"), slots, st.integers(1, SLOTS)),
        st.tuples(st.just("keys"), st.lists(st.integers(0, len(POOL) - 1), max_size=40), st.just(0)),
        st.tuples(
            st.just("bound"),
            st.integers(0, 2**32),
            st.one_of(st.integers(1, 8), st.integers(shm_directory.VECTOR_MIN, SLOTS)),
        ),
    ),
    min_size=1,
    max_size=6,
)
CHANGES = ["none", "same key", "unbind", "odd", "elsewhere"]


def _query(directory: ShmDirectory, query: tuple[Any, ...]) -> list[bytes]:
    kind, a, b = query
    bound = directory.bound()
    if kind == "run":  # the keys bound from slot a on (a run, or broken where a slot is free)
        return [bound[s] for s in range(a, min(SLOTS, a + b)) if s in bound]
    if kind == "bound":  # b bound keys in a random order (scattered; from VECTOR_MIN on: numpy passes)
        keys = list(dict.fromkeys(bound.values()))
        return random.Random(a).sample(keys, min(b, len(keys)))
    return list(dict.fromkeys(POOL[i] for i in a))


def _same(pure: PulledPages | None, fast: PulledPages | None) -> None:
    assert (pure is None) == (fast is None)
    if pure is None or fast is None:
        return
    assert type(fast) is PulledPages
    for name in ("keys", "parent_keys", "parent_is_root", "num_tokens", "checksums", "missing", "path"):
        assert getattr(fast, name) == getattr(pure, name), name
        assert type(getattr(fast, name)) is type(getattr(pure, name)), name
    assert fast.verified and pure.verified and fast.seconds >= 0
    assert fast.data.shape == pure.data.shape and np.array_equal(fast.data, pure.data)


def _change(directory: ShmDirectory, located: Located | None, change: str, pick: int) -> None:
    """What the owner does to a located slot between a reader's copy and its re-check."""
    if located is None or not located.slots or change == "none":
        return
    slot = located.slots[pick % len(located.slots)]
    if change == "same key":
        directory._gen[slot] += 2
    elif change == "unbind":
        directory._gen[slot] += 1
        directory._key[slot] = 0
        directory._gen[slot] += 1
    elif change == "odd":
        directory._gen[slot] += 1
    else:  # a slot nobody located changes: nothing to notice
        others = sorted(set(range(SLOTS)) - set(located.slots))
        if others:
            directory._gen[others[pick % len(others)]] += 2


@contextlib.contextmanager
def _split_reads() -> Iterator[None]:
    """Every read as a large one (:func:`shm_read._read_steps`), copied in pieces of one page."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shm_read, "SPLIT_READ_BYTES", 0)
        mp.setattr(threads, "PIECE_BYTES", PAGE)
        yield


def _read(peer: Any, keys: list[bytes], hook: Any) -> PulledPages | None:
    """shm_read.read with ``hook`` as its ``after_copy``."""
    old = shm_read.after_copy
    shm_read.after_copy = hook
    try:
        return shm_read.read(peer, keys)
    finally:
        shm_read.after_copy = old


@settings(max_examples=120, deadline=None)
@given(st.integers(0, len(POOL)), ops, queries, st.sampled_from(CHANGES), st.integers(0, 1000))
def test_compiled_reader_answers_as_the_python_one(
    tmp_path_factory: pytest.TempPathFactory,
    fill: int,
    program: list[Any],
    asked: list[Any],
    change: str,
    pick: int,
) -> None:
    with _readers(str(tmp_path_factory.getbasetemp())) as (directory, pure, compiled):
        for op in [("fill", 0, fill), *program]:  # every slot bound, then changed at random
            _apply(directory, op)
        for query in asked:
            keys = _query(directory, query)
            located = pure.directory.locate(keys)
            got = compiled.compiled.locate(keys)
            assert (None if got is None else Located(*got)) == located
            if located is not None:
                assert compiled.compiled.unchanged(located.slots, located.gens, keys)
                assert pure.directory.unchanged(located, keys)
            first = shm_read.read(pure, keys)
            _same(first, shm_read.read(compiled, keys))
            if first is not None:
                assert located is not None
                assert np.array_equal(first.data, pure.mapping.array[located.slots])
            before = bytes(directory._mmap)

            def owner_changes(seen: Located | None = located) -> None:
                _change(directory, seen, change, pick)

            changed = _read(pure, keys, owner_changes)
            directory._mmap[:] = before  # the same state again for the compiled reader
            _same(changed, _read(compiled, keys, owner_changes))
            directory._mmap[:] = before
            with _split_reads():  # a large read: step by step, its copy in pieces over threads
                _same(first, shm_read.read(compiled, keys))
                _same(changed, _read(compiled, keys, owner_changes))
                directory._mmap[:] = before
            if located is not None and located.slots and change not in ("none", "elsewhere"):
                assert changed is None  # a located slot changed mid-read: never returned


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(POOL)), ops, queries)
def test_a_locate_only_reader_answers_as_the_full_one(
    tmp_path_factory: pytest.TempPathFactory, fill: int, program: list[Any], asked: list[Any]
) -> None:
    """``tier=None`` (a GPU tier's directory, :class:`shm_read.DirectoryLookup`): the same
    locate and unchanged answers without any tier buffer; ``read`` refuses."""
    with _readers(str(tmp_path_factory.getbasetemp())) as (directory, _pure, compiled):
        only = shm_read.compiled_reader(directory._mmap, None, SLOTS, PAGE, force=True)
        try:
            for op in [("fill", 0, fill), *program]:
                _apply(directory, op)
            for query in asked:
                keys = _query(directory, query)
                got = only.locate(keys)
                assert got == compiled.compiled.locate(keys)
                if got is not None and got[0]:
                    assert only.unchanged(got[0], got[1], keys)
                    directory._gen[got[0][0]] += 2  # the owner rebound the first slot meanwhile
                    assert not only.unchanged(got[0], got[1], keys)
            with pytest.raises(ValueError, match="no tier"):
                only.read(POOL[:1], np.zeros((1, PAGE), dtype=np.uint8))
        finally:
            only.release()
        with pytest.raises(ValueError, match="released"):
            only.locate(POOL[:1])


def test_runs_scattered_missing_and_unindexed_keys(tmp_path: Any) -> None:
    with _readers(str(tmp_path)) as (directory, pure, compiled):
        _apply(directory, ("fill", 0, 0))  # slot s holds POOL[s]
        directory.bind(5, UNINDEXED[0], bytes(32), True, 4)  # tag 0: found only as part of a run
        run, scattered = [*POOL[3:5], UNINDEXED[0], *POOL[6:9]], [POOL[9], POOL[2], POOL[30], POOL[31]]
        many = [POOL[s] for s in range(SLOTS - 1, 1, -1)]  # VECTOR_MIN or more, no run
        assert len(many) >= shm_directory.VECTOR_MIN
        for keys in (run, scattered, many, [UNINDEXED[0]], [*run, bytes(range(32))], []):
            fast, slow = shm_read.read(compiled, keys), shm_read.read(pure, keys)
            _same(slow, fast)
            located = compiled.compiled.locate(keys)
            assert (located is None) == (fast is None)
        assert shm_read.read(compiled, run) is not None and compiled.compiled.locate(run)[5] == 3
        assert compiled.compiled.locate(scattered)[5] == -1
        assert shm_read.read(compiled, [UNINDEXED[0]]) is None  # not in the table
        assert shm_read.read(compiled, [POOL[4], UNINDEXED[0]]) is not None  # the slot after POOL[4]
        directory._gen[4] += 1  # mid-edit: every read touching slot 4 gives up
        assert shm_read.read(compiled, run) is None and shm_read.read(pure, run) is None
        assert shm_read.read(compiled, POOL[6:9]) is not None


def test_corrupt_cells_never_read_outside_the_directory(tmp_path: Any) -> None:
    with _readers(str(tmp_path)) as (directory, pure, compiled):
        _apply(directory, ("fill", 0, 0))
        for bad in (-(2**63), -1, SLOTS, SLOTS + 1, 2**31, 2**62, 2**63 - 1):
            directory._cells[:] = bad  # every cell names a slot outside the tier
            for keys in (POOL[:1], POOL[:3], POOL[: shm_directory.VECTOR_MIN + 1]):
                assert shm_read.read(compiled, keys) is None and shm_read.read(pure, keys) is None
                assert compiled.compiled.locate(keys) is None
        directory._tags[:] = shm_directory._tag(POOL[0])  # a full table: every probe ends by count
        assert shm_read.read(compiled, POOL[1:2]) is None and shm_read.read(pure, POOL[1:2]) is None


BAD_OUTS = [
    np.zeros((4, PAGE), dtype=np.int8),
    np.zeros((4, PAGE), dtype=np.uint16),
    np.zeros((4, PAGE), dtype=bool),
    np.zeros(4 * PAGE, dtype=np.uint8),
    np.zeros((4, PAGE, 1), dtype=np.uint8),
    np.zeros((1, PAGE), dtype=np.uint8),  # too few rows for 2 keys
    np.zeros((4, PAGE + 1), dtype=np.uint8),
    np.zeros((4, 2 * PAGE), dtype=np.uint8)[:, ::2],
    np.zeros((8, PAGE), dtype=np.uint8)[::2],
    np.zeros((PAGE, 4), dtype=np.uint8).T,
    np.zeros((2, PAGE), dtype=np.uint8, order="F"),
    np.frombuffer(bytes(4 * PAGE), dtype=np.uint8).reshape(4, PAGE),  # read-only
    bytearray(4 * PAGE),
    memoryview(bytearray(4 * PAGE)).cast("B", (4, PAGE)),
    [[0] * PAGE] * 4,
    "out",
]
GOOD_OUTS = [
    np.zeros((2, PAGE), dtype=np.uint8),
    np.zeros((9, PAGE), dtype=np.uint8)[3:],
    np.zeros((2, PAGE), dtype=np.uint8).view(np.matrix),  # a subclass
    np.zeros((1, 3 * PAGE), dtype=np.uint8).reshape(3, PAGE),
    np.zeros((PAGE, 2), dtype=np.uint8).T.copy(),
]


@pytest.mark.parametrize("out", BAD_OUTS + GOOD_OUTS, ids=range(len(BAD_OUTS) + len(GOOD_OUTS)))
def test_out_is_checked_alike(tmp_path: Any, out: Any) -> None:
    with _readers(str(tmp_path)) as (directory, pure, compiled):
        _apply(directory, ("fill", 0, 0))
        answers = []
        for peer in (pure, compiled):
            try:
                got = shm_read.read(peer, POOL[:2], out)
            except InvalidArgumentError as exc:
                answers.append(str(exc))
            else:
                assert got is not None and np.shares_memory(got.data, out)
                answers.append(bytes(np.asarray(got.data)))
        assert answers[0] == answers[1]
        assert isinstance(answers[0], str) == any(out is bad for bad in BAD_OUTS)
        with contextlib.suppress(ValueError):  # the C call alone: a ValueError, never a crash
            compiled.compiled.read(POOL[:2], out)


def test_bad_keys_and_arguments_raise(tmp_path: Any) -> None:
    with _readers(str(tmp_path)) as (_directory, _pure, compiled):
        reader, out = compiled.compiled, np.zeros((2, PAGE), dtype=np.uint8)
        for keys in ("ab", [b"x" * 31], [bytearray(32)], (POOL[0], 5), iter(POOL[:1]), None):
            with pytest.raises(TypeError):
                reader.read(keys, out)
            with pytest.raises(TypeError):
                reader.locate(keys)
        with pytest.raises(TypeError):
            reader.read(POOL[:1])
        with pytest.raises(TypeError):
            reader.unchanged([0], [0])
        with pytest.raises(ValueError):
            reader.unchanged([SLOTS], [0], POOL[:1])  # a slot outside the directory
        assert reader.unchanged([0, 1], [0], POOL[:2]) is False  # not what was located
        with pytest.raises(TypeError):
            reader.set_result(PulledPages, (("keys",),))
        for unsafe in (dict, int, np.ndarray, type("WithNew", (), {"__new__": lambda cls: None})):
            with pytest.raises(TypeError):  # object.__new__ cannot make these
                reader.set_result(unsafe, ())
        assert shm_read.read(compiled, (POOL[0],)) is None  # a tuple is fine; nothing is bound


def test_constructor_checks_the_buffers(tmp_path: Any) -> None:
    size, _ = shm_directory._layout(SLOTS)
    (gen, key, parent, meta, tags, cells_at), cells = shm_directory.offsets(SLOTS)
    directory, tier = np.zeros(size, dtype=np.uint8), np.zeros((SLOTS, PAGE), dtype=np.uint8)
    reader = shm_read._shmread.Reader  # type: ignore[union-attr]
    args = [directory, tier, SLOTS, PAGE, cells, gen, key, parent, meta, tags, cells_at, 32, np.ndarray]
    reader(*args).release()
    for at, bad in (
        (0, directory[:-8]),  # the cells array does not fit
        (1, tier[:-1]),  # fewer pages than slots
        (2, -1),
        (3, 0),
        (4, cells + 1),  # not a power of two
        (4, 0),
        (5, gen + 4),  # misaligned generations
        (9, size),  # tags past the end
        (10, -8),
        (11, 0),
    ):
        with pytest.raises(ValueError):
            reader(*args[:at], bad, *args[at + 1 :])
    with pytest.raises(TypeError):
        reader(*args[:12], 5)
    with pytest.raises(TypeError):
        reader(*args[:4])


def test_release_and_a_large_copy_without_the_gil(tmp_path: Any) -> None:
    page = 256 << 10  # 4 pages: 1 MiB, copied without the GIL
    with _readers(str(tmp_path), 8, page) as (directory, pure, compiled):
        for slot in range(8):
            directory.bind(slot, POOL[slot], bytes(32), False, 4)
        fast = shm_read.read(compiled, POOL[2:6])
        _same(shm_read.read(pure, POOL[2:6]), fast)
        assert fast is not None and np.array_equal(fast.data, pure.mapping.array[2:6])
        reader = compiled.compiled
        assert _read(compiled, POOL[:4], reader.release) is None  # released mid-read: nothing
        with pytest.raises(ValueError):
            reader.read(POOL[:1], np.zeros((1, page), dtype=np.uint8))
        with pytest.raises(ValueError):
            reader.locate(POOL[:1])
        reader.release()  # idempotent
        assert shm_read.read(compiled, POOL[:2]) is not None  # the Python reader takes over


def test_a_compiled_result_equals_the_plain_constructor(tmp_path: Any) -> None:
    with _readers(str(tmp_path)) as (directory, _pure, compiled):
        _apply(directory, ("fill", 0, 0))
        got = shm_read.read(compiled, POOL[:2])
        assert got is not None
        plain = PulledPages(
            got.keys,
            got.parent_keys,
            got.parent_is_root,
            got.num_tokens,
            (),
            got.data,
            (),
            "shm_read",
            got.seconds,
        )
        assert got == plain and vars(got) == vars(plain) and repr(got) == repr(plain)
        whole = np.zeros((1, PAGE), dtype=np.uint8)
        assert compiled.compiled.read(POOL[:1], whole, None, True).data is whole  # no view


def test_release_while_another_thread_copies_waits_for_it(tmp_path: Any) -> None:
    page = 4 << 20  # 16 MiB per read: copied without the GIL for a few ms
    with _readers(str(tmp_path), 4, page) as (directory, pure, compiled):
        for slot in range(4):
            directory.bind(slot, POOL[slot], bytes(32), False, 4)
        reader, outcomes = compiled.compiled, []
        started = threading.Event()

        def reads() -> None:
            out = np.empty((4, page), dtype=np.uint8)
            for _ in range(50):
                started.set()
                try:
                    got = reader.read(POOL[:4], out)
                except ValueError:
                    outcomes.append("released")
                    return
                outcomes.append("none" if got is None else "pages")
                assert got is None or np.array_equal(got.data, pure.mapping.array)

        worker = threading.Thread(target=reads)
        worker.start()
        started.wait(5)
        time.sleep(0.005)
        reader.release()  # deferred while the worker copies; no read starts afterwards
        worker.join(30)
        assert not worker.is_alive() and outcomes[-1] == "released"
        assert set(outcomes) <= {"pages", "none", "released"}


def test_tally_counts_as_counter_increments() -> None:
    tally = shm_read._shmread.tally  # type: ignore[union-attr]
    fast = (collections.Counter({"a": 2}), collections.Counter(), collections.Counter({"b": 1}))
    slow = tuple(collections.Counter(c) for c in fast)
    for key, amounts in (("a", (1, 2, 3)), ("b", (0, 5, 1 << 40)), ("a", (7, 7, 7))):
        tally(fast, key, amounts)
        shm_read.tally_python(slow, key, amounts)
        assert fast == slow and all(type(c) is collections.Counter for c in fast)
    for bad in ((fast, "a"), ([*fast], "a", (1, 1, 1)), (fast, "a", (1, 1)), ((1, 2, 3), "a", (1, 1, 1))):
        with pytest.raises(TypeError):
            tally(*bad)
    with pytest.raises(TypeError):
        tally(fast, "a", ("x", 1, 1))  # 2 + "x"

    class Sneaky:
        def __radd__(self, other: int) -> int:
            del counts["k"]  # drops the dict's reference to the value being added
            return other + 1

    counts = collections.Counter({"k": 10**30})
    tally((counts,), "k", (Sneaky(),))
    assert counts == {"k": 10**30 + 1}


def test_a_chain_s_parents_are_the_keys_before_them(tmp_path: Any) -> None:
    """The compiled reader hands back the caller's key object as the parent of the block after it
    (a chain, the usual batch: no new bytes), a new equal bytes otherwise; same values as Python."""
    with _readers(str(tmp_path)) as (directory, pure, compiled):
        chain = [bytes(k) for k in POOL[:6]]  # fresh objects, equal to the bound keys
        directory.bind(10, chain[0], bytes(32), True, 16)
        for i in range(1, 6):
            parent = chain[i - 1] if i != 3 else POOL[20]  # one link broken: block 3 hangs elsewhere
            directory.bind(10 + i, chain[i], parent, False, 16)
        for got in (compiled.compiled.locate(chain), shm_read.read(compiled, chain)):
            assert got is not None
            parents = got[2] if isinstance(got, tuple) else got.parent_keys
            assert list(parents) == list(pure.directory.locate(chain).parents)
            assert [parents[i] is chain[i - 1] for i in range(1, 6)] == [True, True, False, True, True]
            assert parents[3] == POOL[20] and parents[0] == bytes(32)

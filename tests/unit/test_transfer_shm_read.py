"""One-sided same-node reads (``shm_read``) and the shared tier's slot directory.

After one request to a same-node owner, the client maps its shared tier and directory; pulls of
keys the directory lists are then served without asking the owner. Every test checks content with
the oracle, that a page changing mid-read is never returned or imported, and that the request
paths take over whenever the directory cannot answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import numpy as np
import pytest
from transfer_support import Pair, commit, host_pair, run, seq

from raykv import ContentOracle, KVLayout, TransferError, native
from raykv.core.errors import InvalidArgumentError, StateError
from raykv.core.tiers import shm_directory
from raykv.core.tiers.shm_directory import DirectoryReader, ShmDirectory
from raykv.transfer import TransferConfig, pull_into, pull_into_local
from raykv.transfer.paths import shm_read

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)
pytestmark = pytest.mark.skipif(not shm_directory.supported(), reason="one-sided reads need x86-64")


@pytest.fixture
def pair(layout: KVLayout) -> Iterator[Pair]:
    made = host_pair(layout, CFG, src_pages=16, disk_pages=16, dst_pages=32)
    yield made
    made.close()


def _check(oracle: ContentOracle, pulled: object, keys: list[bytes]) -> None:
    assert list(pulled.keys) == keys  # type: ignore[attr-defined]
    assert all(oracle.check(row, key) for key, row in zip(keys, pulled.data))  # type: ignore[attr-defined]


def test_second_pull_reads_one_sided_without_asking_the_owner(pair: Pair, oracle: ContentOracle) -> None:
    keys = commit(pair.src, oracle, seq(1, 6))
    first = pair.client.pull_sync(pair.address, keys)
    assert first.path == "shm"  # the first request maps the owner's tier and directory
    served = pair.server.stats.pulls.copy()
    for sub in (keys, keys[2:5], keys[::-1]):
        pulled = pair.client.pull_sync(pair.address, sub)
        assert pulled.path == "shm_read" and pulled.verified and not pulled.missing
        _check(oracle, pulled, sub)
        assert list(pulled.parent_keys[1:]) == list(sub[:-1]) or sub != keys
    out = np.zeros((8, pair.src.layout.page_bytes), dtype=np.uint8)
    pulled = run(pair.client.pull(pair.address, keys, out=out))
    assert pulled.path == "shm_read" and np.shares_memory(pulled.data, out)  # type: ignore[attr-defined]
    _check(oracle, pulled, keys)
    assert pair.server.stats.pulls == served  # the owner was not asked again
    assert pair.client.stats.pulls["shm_read"] == 4
    pair.settled()


def test_keys_the_directory_lacks_go_through_the_owner(pair: Pair, oracle: ContentOracle) -> None:
    keys = commit(pair.src, oracle, seq(2, 10))
    commit(pair.src, oracle, seq(3, 12))  # demotes part of the first chain to disk
    pair.client.pull_sync(pair.address, keys[:1])
    on_disk = [k for k, t in zip(keys, pair.src.probe(keys=keys).tiers) if t.name == "DISK"]
    assert on_disk
    pulled = pair.client.pull_sync(pair.address, keys)
    assert pulled.path == "shm,ucx" or pulled.path in ("shm", "ucx")  # asked: not all on the tier
    _check(oracle, pulled, keys)
    unknown = bytes(32)
    pulled = pair.client.pull_sync(pair.address, [keys[0], unknown])
    assert pulled.path != "shm_read" and list(pulled.missing) == [unknown]
    pair.settled()


def test_a_page_evicted_mid_read_is_never_returned(
    pair: Pair, oracle: ContentOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = commit(pair.src, oracle, seq(4, 4))
    pair.client.pull_sync(pair.address, keys)
    local = pair.client._local[pair.address.endpoint]

    def evict() -> None:  # between the copy and the re-check (either reader)
        with pair.src.locked():
            pair.src.clear_reusable()  # the owner drops every block (and unbinds the slots)
        commit(pair.src, oracle, seq(5, 4))  # and reuses the slots for other blocks

    monkeypatch.setattr(shm_read, "after_copy", evict)
    assert shm_read.read(local, keys) is None
    monkeypatch.setattr(shm_read, "after_copy", None)
    pulled = pair.client.pull_sync(pair.address, keys)  # falls back: the owner no longer has them
    assert pulled.path != "shm_read" and list(pulled.missing) == keys
    pair.settled()


def test_pull_into_lands_one_sided_and_a_stale_page_rejects_the_import(
    pair: Pair, oracle: ContentOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = commit(pair.src, oracle, seq(6, 5))
    pair.client.pull_sync(pair.address, keys[:1])
    outcome = run(pull_into(pair.client, pair.address, pair.dst, keys))
    assert outcome.path == "shm_read" and outcome.imported == tuple(keys)  # type: ignore[attr-defined]
    assert oracle.verify_manager(pair.dst) == 5
    pair.dst.clear_reusable()
    real_view = shm_read.view

    def view_then_evict(local: shm_read.LocalPeer, wanted: list[bytes]) -> object:
        got = real_view(local, wanted)
        pair.src.clear_reusable()  # every located slot changes before the import confirms
        return got

    monkeypatch.setattr(shm_read, "view", view_then_evict)
    outcome = run(pull_into(pair.client, pair.address, pair.dst, keys))
    assert outcome.imported == () and list(outcome.missing) == keys  # type: ignore[attr-defined]
    assert pair.dst.committed_blocks() == []
    pair.settled()


def test_pull_into_local_imports_in_the_calling_thread(
    pair: Pair, oracle: ContentOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = commit(pair.src, oracle, seq(8, 4))
    assert pull_into_local(pair.client, pair.address, pair.dst, keys) is None  # never connected yet
    pair.client.pull_sync(pair.address, keys[:1])
    outcome = pull_into_local(pair.client, pair.address, pair.dst, keys)
    assert outcome is not None and outcome.path == "shm_read" and outcome.imported == tuple(keys)
    assert oracle.verify_manager(pair.dst) == 4
    pair.dst.clear_reusable()
    real_view = shm_read.view

    def view_then_evict(local: shm_read.LocalPeer, wanted: list[bytes]) -> object:
        got = real_view(local, wanted)
        pair.src.clear_reusable()
        return got

    monkeypatch.setattr(shm_read, "view", view_then_evict)
    assert pull_into_local(pair.client, pair.address, pair.dst, keys) is None  # stale: nothing
    assert pair.dst.committed_blocks() == []
    pair.settled()


def test_switched_off_never_reads_one_sided(layout: KVLayout, oracle: ContentOracle) -> None:
    made = host_pair(layout, CFG.replace(use_shm_read=False), src_pages=16, disk_pages=16, dst_pages=32)
    try:
        keys = commit(made.src, oracle, seq(7, 3))
        for _ in range(3):
            assert made.client.pull_sync(made.address, keys).path == "shm"
        assert not made.client._local
    finally:
        made.close()


# ---- the directory itself -----------------------------------------------------------------------
def _key(i: int) -> bytes:
    """Distinct keys whose tags are never the empty (0) or deleted (1) marker."""
    return ((i + 2) * 0x9E3779B97F4A7C15 % (1 << 64) | 2).to_bytes(8, "little") + bytes([i % 251]) * 24


def test_directory_binds_unbinds_and_rebuilds(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "raykv-test-tier")
    directory = ShmDirectory(path, 64, 4096)
    try:
        reader = DirectoryReader(path, 64, 4096)
        expected: dict[int, bytes] = {}
        for round_ in range(6):  # churn: forces deleted cells and rebuilds
            for slot in range(64):
                key = _key(round_ * 64 + slot)
                directory.bind(slot, key, bytes(32), slot % 2 == 0, 16)
                expected[slot] = key
            directory.check(expected)
            for slot, key in expected.items():
                assert reader.find(key) == slot
            located = reader.locate([expected[3], expected[9]])
            assert located is not None and located.slots == [3, 9] and located.roots == [False, False]
            assert located.tokens == [16, 16]
            directory.unbind(list(range(0, 64, 3)))
            for slot in range(0, 64, 3):
                assert reader.find(expected.pop(slot)) is None
            directory.check(expected)
        assert reader.locate([expected[1], bytes(32)]) is None
        reader.close()
    finally:
        directory.close()
    assert not os.path.exists(path + ".dir")


@pytest.mark.parametrize("pure", [False, True])
def test_a_directory_lookup_locates_without_the_tier(
    tmp_path: object, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What gpu_read uses for an owner's GPU tier: its directory file alone (no tier file to
    map), located and re-checked by the compiled reader, or the Python view when pure."""
    if pure:
        monkeypatch.setenv("RAYKV_PURE_SHM_READ", "1")
    path = os.path.join(str(tmp_path), "raykv-test-gpu-tier")
    directory = ShmDirectory(path, 64, 1 << 20)  # a 64 MiB tier that is never created
    lookup = shm_read.DirectoryLookup(path, 64, 1 << 20)
    try:
        assert (lookup.compiled is None) == (pure or not (native.load("_shmread") is not None))
        keys = [_key(i) for i in range(40)]
        for slot, key in enumerate(keys):
            directory.bind(slot + 7, key, bytes(32) if slot == 0 else keys[slot - 1], slot == 0, 16)
        for wanted in (keys, keys[5:9], [keys[30], keys[2]], [keys[1], _key(99)]):
            got = shm_read.locate(lookup, wanted)
            assert got == lookup.directory.locate(wanted)
            if got is not None:
                assert got.slots == [keys.index(k) + 7 for k in wanted]
                assert shm_read.unchanged(lookup, got, wanted)
        located = shm_read.locate(lookup, keys)
        assert located is not None and located.first == 7
        directory.unbind([20])
        assert not shm_read.unchanged(lookup, located, keys) and shm_read.locate(lookup, keys) is None
        assert shm_read.unchanged(lookup, located.part(0, 13), keys[:13])  # the slots before it
    finally:
        lookup.close()
        directory.close()


def test_keys_whose_tag_reads_empty_are_bound_but_not_indexed(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "raykv-test-tier")
    directory = ShmDirectory(path, 8, 4096)
    try:
        odd = bytes(8) + b"\x07" * 24  # first 8 bytes are 0: the "empty" tag
        directory.bind(2, odd, bytes(32), True, 4)
        directory.check({2: odd})
        assert DirectoryReader(path, 8, 4096).find(odd) is None  # the owner serves it on request
    finally:
        directory.close()


def test_reader_refuses_a_foreign_or_mismatched_file(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "raykv-test-tier")
    directory = ShmDirectory(path, 8, 4096)
    try:
        with pytest.raises(StateError):
            DirectoryReader(path, 16, 4096)  # another size
        with open(path + ".dir", "r+b") as fh:
            fh.write(b"NOTRAYKV")
        with pytest.raises(StateError):
            DirectoryReader(path, 8, 4096)
    finally:
        directory.close()
    with pytest.raises(TransferError):
        shm_read.LocalPeer(type("Info", (), {"path": path, "num_slots": 8, "page_bytes": 4096})())  # type: ignore[arg-type]


@contextlib.contextmanager
def _directory_and_reader(tmp_path: object, num_slots: int) -> Iterator[tuple[ShmDirectory, DirectoryReader]]:
    """An owner's slot directory for a tier of ``num_slots`` 4 KiB pages and a reader of it."""
    path = os.path.join(str(tmp_path), "raykv-test-tier")
    directory = ShmDirectory(path, num_slots, 4096)
    reader = DirectoryReader(path, num_slots, 4096)
    try:
        yield directory, reader
    finally:
        reader.close()
        directory.close()


def test_many_keys_are_located_in_numpy_passes_like_one_at_a_time(tmp_path: object) -> None:
    with _directory_and_reader(tmp_path, 256) as (directory, reader):
        keys = [_key(i) for i in range(150)]
        twins = [k[:8] + bytes([255 - j]) * 24 for j, k in enumerate(keys[:50])]  # same tags: probing
        for slot, key in enumerate([*keys, *twins]):
            directory.bind(slot, key, bytes([slot % 256]) * 32, slot % 3 == 0, 16 + slot % 4)
        wanted = [*twins[::-1], *keys]
        assert len(wanted) >= shm_directory.VECTOR_MIN
        many = reader.locate(wanted)
        assert many is not None
        one_by_one = [reader.locate(wanted[i : i + 1]) for i in range(len(wanted))]
        assert many.slots == [o.slots[0] for o in one_by_one if o is not None]
        assert many.parents == [o.parents[0] for o in one_by_one if o is not None]
        assert many.roots == [o.roots[0] for o in one_by_one if o is not None]
        assert many.tokens == [o.tokens[0] for o in one_by_one if o is not None]
        assert reader.unchanged(many, wanted)
        directory.unbind([3])  # keys[3]'s slot: the generation moves, the key is gone
        assert not reader.unchanged(many, wanted)
        assert reader.locate(wanted) is None


# ---- runs of slots and scattered slots ----------------------------------------------------------
def _commit_interleaved(
    pair: Pair, oracle: ContentOracle, seeds: tuple[int, int], blocks: int
) -> list[list[bytes]]:
    """Two requests extended block by block in turn: each chain's pages sit in every other slot."""
    mgr, tpb = pair.src, pair.src.tokens_per_block
    tokens = [seq(s, blocks, tpb) for s in seeds]
    with mgr.create(tokens[0]) as a, mgr.create(tokens[1]) as b:
        caches = (a, b)
        for cache in caches:
            assert cache.resume()
        for i in range(blocks):
            for cache, toks in zip(caches, tokens):
                cache.extend(toks[i * tpb : (i + 1) * tpb])
        for cache in caches:
            oracle.fill_cache(cache)
            cache.commit()
        return [[bytes(c.block_key(i)) for i in range(blocks)] for c in caches]


def _local(pair: Pair, keys: list[bytes]) -> shm_read.LocalPeer:
    """Connect once (maps the owner's tier and directory) and return the mapped peer."""
    pair.client.pull_sync(pair.address, keys[:1])
    return pair.client._local[pair.address.endpoint]


def test_runs_and_scattered_slots_read_the_right_pages(pair: Pair, oracle: ContentOracle) -> None:
    chains = _commit_interleaved(pair, oracle, (21, 22), 4)
    run_keys = commit(pair.src, oracle, seq(23, 4))
    local = _local(pair, run_keys)
    located = local.directory.locate(run_keys)
    assert located is not None and located.first == located.slots[0]  # one run: the fast path
    assert located.slots == list(range(located.first, located.first + 4))
    scattered = local.directory.locate(chains[0])
    assert scattered is not None and scattered.first == -1  # every other slot
    for keys in (run_keys, chains[0], chains[1], [chains[0][0], *run_keys[1:3]], run_keys[::-1]):
        pulled = pair.client.pull_sync(pair.address, keys)
        assert pulled.path == "shm_read" and pulled.verified
        _check(oracle, pulled, keys)
        one_by_one = [local.directory.locate([k]) for k in keys]
        assert list(pulled.parent_keys) == [o.parents[0] for o in one_by_one if o is not None]
        assert list(pulled.num_tokens) == [o.tokens[0] for o in one_by_one if o is not None]
        assert list(pulled.parent_is_root) == [o.roots[0] for o in one_by_one if o is not None]
    outcome = pull_into_local(pair.client, pair.address, pair.dst, chains[1])  # gathered rows
    assert outcome is not None and outcome.path == "shm_read" and outcome.imported == tuple(chains[1])
    outcome = pull_into_local(pair.client, pair.address, pair.dst, run_keys)  # rows in place
    assert outcome is not None and outcome.imported == tuple(run_keys)
    assert oracle.verify_manager(pair.dst) == 8
    pair.settled()


@pytest.mark.parametrize("scattered", [False, True])
def test_a_slot_rebound_mid_read_is_never_returned_or_imported(
    pair: Pair, oracle: ContentOracle, monkeypatch: pytest.MonkeyPatch, scattered: bool
) -> None:
    chains = _commit_interleaved(pair, oracle, (31, 32), 4)
    keys = chains[0] if scattered else commit(pair.src, oracle, seq(33, 4))
    local = _local(pair, keys)
    directory = pair.src.pools[0].slot_directory
    assert directory is not None
    real_view = shm_read.view

    def rebind_same_key(located: shm_directory.Located) -> None:
        """The owner rebinds a located slot to the very same key: only the generation moves."""
        assert (located.first >= 0) is not scattered
        slot = located.slots[2]
        directory.bind(slot, keys[2], located.parents[2], located.roots[2], located.tokens[2])

    seen = shm_read.locate(local, keys)
    assert seen is not None
    monkeypatch.setattr(shm_read, "after_copy", lambda: rebind_same_key(seen))
    assert shm_read.read(local, keys) is None
    monkeypatch.setattr(shm_read, "after_copy", None)
    pulled = shm_read.read(local, keys)  # the new generation is stable: read as before
    assert pulled is not None
    _check(oracle, pulled, keys)

    def view_then_rebind(peer: shm_read.LocalPeer, wanted: list[bytes]) -> object:
        got = real_view(peer, wanted)
        assert got is not None
        rebind_same_key(got[1])
        return got

    monkeypatch.setattr(shm_read, "view", view_then_rebind)
    assert pull_into_local(pair.client, pair.address, pair.dst, keys) is None  # stale: nothing
    assert pair.dst.committed_blocks() == []
    pair.settled()


def test_pulled_pages_intact_equals_the_plain_constructor() -> None:
    data = np.arange(8, dtype=np.uint8).reshape(2, 4)
    args = ((b"a" * 32, b"b" * 32), (b"r" * 32, b"a" * 32), (True, False), (4, 4))
    fast = shm_read.PulledPages.intact(*args, data, "shm_read", 0.5)  # type: ignore[arg-type]
    plain = shm_read.PulledPages(*args, (), data, (), "shm_read", 0.5)  # type: ignore[arg-type]
    for field in dataclasses.fields(plain):
        assert getattr(fast, field.name) is getattr(plain, field.name) or (
            getattr(fast, field.name) == getattr(plain, field.name)
        ), field.name
    assert type(fast) is type(plain) and fast.verified and fast.nbytes == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.path = "x"  # type: ignore[misc]


def test_runs_are_located_like_one_key_at_a_time_and_checked_whole(tmp_path: object) -> None:
    with _directory_and_reader(tmp_path, 16) as (directory, reader):
        keys = [_key(i) for i in range(16)]
        for slot, key in enumerate(keys):  # slot i holds key i: any slice of keys is a run
            directory.bind(slot, key, bytes([slot]) * 32, slot % 2 == 0, 16 - slot % 3)
        for wanted in (keys[:1], keys[3:9], keys[12:], keys):
            run = reader.locate(wanted)
            assert run is not None and run.first == keys.index(wanted[0])
            singles = [reader.locate([k]) for k in wanted]
            assert all(s is not None for s in singles)
            for name in ("slots", "gens", "parents", "roots", "tokens"):
                assert getattr(run, name) == [getattr(s, name)[0] for s in singles], name
            assert reader.unchanged(run, wanted)
        partial = reader.locate([keys[5], keys[6], keys[2], keys[3]])  # two runs: key by key
        assert partial is not None and partial.first == -1 and partial.slots == [5, 6, 2, 3]
        run = reader.locate(keys[4:8])
        assert run is not None
        directory.bind(6, keys[6], bytes([6]) * 32, True, 16)  # same key, new generation
        assert not reader.unchanged(run, keys[4:8]) and not reader.unchanged(
            partial, [keys[5], keys[6], keys[2], keys[3]]
        )
        run = reader.locate(keys[4:8])
        assert run is not None and reader.unchanged(run, keys[4:8])
        directory._gen[5] += 1  # the owner is mid-edit on slot 5 (odd generation)
        assert reader.locate(keys[4:8]) is None and reader.locate([keys[5]]) is None
        assert not reader.unchanged(run, keys[4:8])
        directory._gen[5] += 1
        directory.bind(7, _key(99), bytes(32), True, 16)  # another key: the run is broken
        assert not reader.unchanged(run, keys[4:8]) and reader.locate(keys[4:8]) is None
        assert reader.locate(keys[4:7]) is not None  # the slots before it still form a run


def test_located_part_keeps_the_run_start() -> None:
    from raykv.core.tiers.shm_directory import Located

    run = Located(
        [5, 6, 7, 8], [2, 2, 4, 2], [b"a", b"b", b"c", b"d"], [True, False, False, False], [4] * 4, 5
    )
    assert run.part(1, 3) == Located([6, 7], [2, 4], [b"b", b"c"], [False, False], [4, 4], 6)
    scattered = run._replace(slots=[9, 2, 7, 1], first=-1)
    assert scattered.part(2, 4).first == -1 and scattered.part(2, 4).slots == [7, 1]


def test_a_chain_run_is_located_like_one_key_at_a_time(tmp_path: object) -> None:
    """A run committed as one chain (each block the parent of the next, only the first hanging
    from a root) is located through the chain shortcuts; the answer equals key-by-key lookups,
    and an odd generation anywhere in a long run still refuses it."""
    with _directory_and_reader(tmp_path, 64) as (directory, reader):
        keys = [_key(i) for i in range(40)]
        root = bytes([7]) * 32
        for slot, key in enumerate(keys):
            directory.bind(slot, key, keys[slot - 1] if slot else root, slot == 0, 16)
        for wanted in (keys, keys[5:30], keys[:2]):
            run = reader.locate(wanted)
            singles = [reader.locate([k]) for k in wanted]
            assert run is not None and all(s is not None for s in singles)
            for name in ("slots", "gens", "parents", "roots", "tokens"):
                assert getattr(run, name) == [getattr(s, name)[0] for s in singles], name  # type: ignore[index]
        assert reader.locate(keys[:3]).parents == [root, keys[0], keys[1]]  # type: ignore[union-attr]
        directory._gen[33] += 1  # mid-edit deep inside a long run
        assert reader.locate(keys) is None and reader.locate(keys[:33]) is not None
        directory._gen[33] += 1
        directory.bind(20, keys[20], root, True, 16)  # rebound under a root: no longer a chain
        run = reader.locate(keys)
        assert run is not None and run.parents[20] == root and run.roots[20] and not run.roots[21]


def test_compiled_and_python_readers_pull_the_same_pages(
    pair: Pair, oracle: ContentOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    chains = _commit_interleaved(pair, oracle, (41, 42), 4)
    run_keys = commit(pair.src, oracle, seq(43, 4))
    local = _local(pair, run_keys)
    assert (local.compiled is not None) == (native.load("_shmread") is not None)
    fast = local.compiled or shm_read.compiled_reader(
        local.directory._mmap, local.mapping._mmap, len(local.mapping.array), local.page_bytes, force=True
    )
    if fast is None:
        pytest.skip("raykv.native._shmread was not built")
    out = np.zeros((8, pair.src.layout.page_bytes), dtype=np.uint8)
    for keys in (run_keys, run_keys[1:2], chains[0], [chains[1][0], *run_keys[2:]], [bytes(32)]):
        answers = []
        for reader in (None, fast):
            monkeypatch.setattr(local, "compiled", reader)
            got = pair.client.pull_sync(pair.address, keys, out=out)
            _check(oracle, got, [k for k in keys if k not in got.missing])
            answers.append((got.path, got.parent_keys, got.parent_is_root, got.num_tokens, got.missing))
        assert answers[0] == answers[1], keys
        assert answers[0][0] == ("shm_read" if keys != [bytes(32)] else "shm")
    monkeypatch.setattr(local, "compiled", fast)
    with pytest.raises(InvalidArgumentError):
        pair.client.pull_sync(pair.address, run_keys, out=out[:2])  # too few rows
    with pytest.raises(InvalidArgumentError):
        pair.client.pull_sync(pair.address, run_keys, out=out.astype(np.int8))
    if fast is not local.compiled:
        fast.release()
    pair.settled()


def test_pure_reader_is_selected_by_the_environment(
    pair: Pair, oracle: ContentOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYKV_PURE_SHM_READ", "1")
    assert not (native.load("_shmread") is not None)
    keys = commit(pair.src, oracle, seq(44, 3))
    local = _local(pair, keys)
    assert local.compiled is None
    pulled = pair.client.pull_sync(pair.address, keys)
    assert pulled.path == "shm_read"
    _check(oracle, pulled, keys)
    pair.settled()

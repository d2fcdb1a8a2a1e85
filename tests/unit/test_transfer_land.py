"""Pulls that land in a manager (``pull_into`` / ``PageClient.pull_land``) and the shm defaults.

Over shm the pages carry no checksums unless asked: the client copies them out of the owner's
memory under a lease and the owner acknowledges that the lease lasted. ``pull_into`` imports
straight from the owner's mapping and makes nothing visible before that acknowledgement. Every
test checks content with the oracle, and that nothing leaks (leases, staged pages, invariants).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from transfer_support import Pair, commit, host_pair, run, seq

from raykv import KVLayout, TransferError
from raykv.transfer import PageClient, TransferConfig, pull_into
from raykv.transfer.pages import landing
from raykv.transfer.paths.importer import Lander, import_pulled

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)


@pytest.fixture
def make_pair(layout: KVLayout) -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def factory(config: TransferConfig = CFG, src_pages: int = 32) -> Pair:
        made.append(host_pair(layout, config, src_pages=src_pages))
        return made[-1]

    yield factory
    for pair in made:
        pair.close()


def test_shm_pull_carries_checksums_only_when_asked(make_pair, oracle) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(1, 6))
    plain = pair.client.pull_sync(pair.server.address, keys)
    assert plain.path == "shm" and plain.verified and plain.checksums == ()
    checked = pair.client.pull_sync(pair.server.address, keys, verify=True)
    assert checked.verified and len(checked.checksums) == 6
    strict = PageClient(pair.token, CFG.replace(verify_shm=True))
    try:
        assert len(strict.pull_sync(pair.server.address, keys).checksums) == 6
    finally:
        strict.close()
    for pulled in (plain, checked):
        assert all(oracle.check(row, key) for key, row in zip(keys, pulled.data))
    exported = plain.to_exported()  # checksums the shm path did not carry are computed
    assert [b.checksum for b in exported] == list(checked.checksums)
    pair.settled()


@pytest.mark.parametrize("prefer_shm", [True, False])
def test_pull_into_lands_scattered_pages_in_one_copy(make_pair, oracle, prefer_shm) -> None:
    pair = make_pair()
    tokens = seq(2, 6)
    first = commit(pair.src, oracle, tokens[:12])  # blocks 0-2 in one run of slots
    commit(pair.src, oracle, seq(3, 2))  # takes the next slots
    keys = commit(pair.src, oracle, tokens)  # blocks 3-5 after them: not one run
    assert keys[:3] == first
    outcome = run(pull_into(pair.client, pair.server.address, pair.dst, keys, prefer_shm))
    assert outcome.complete and outcome.imported == tuple(keys)
    assert outcome.path == ("shm" if prefer_shm else "ucx")
    assert oracle.verify_manager(pair.dst) == 6
    with pair.dst.create([*tokens, 1]) as cache:
        assert cache.num_reused_tokens == len(tokens) and cache.resume()
        oracle.verify_cache(cache)
    pair.settled()


def test_pull_into_over_several_batches_lands_once(make_pair, oracle) -> None:
    pair = make_pair(CFG.replace(max_keys=3))
    keys = commit(pair.src, oracle, seq(4, 8))
    for prefer_shm in (True, False):
        pair.dst.clear_reusable()
        outcome = run(pull_into(pair.client, pair.server.address, pair.dst, keys, prefer_shm))
        assert outcome.imported == tuple(keys) and oracle.verify_manager(pair.dst) == 8
    assert run(pull_into(pair.client, pair.server.address, pair.dst, [])).imported == ()
    pair.settled()


def test_lease_ending_early_imports_nothing(make_pair, oracle) -> None:
    """The owner drops the connection right after the header (ending its lease): without its
    acknowledgement the pages read from its memory may not be the leased ones. (One-sided reads
    off: they ask the owner nothing, see test_transfer_shm_read.py.)"""
    pair = make_pair(CFG.replace(use_shm_read=False))
    keys = commit(pair.src, oracle, seq(5, 4))
    pair.server.faults.drop_after_header = True
    with pytest.raises(TransferError) as info:
        run(pull_into(pair.client, pair.server.address, pair.dst, keys))
    assert info.value.reason in {"closed", "fault"}
    with pytest.raises(TransferError):
        pair.client.pull_sync(pair.server.address, keys)  # a plain pull waits for the ack too
    assert pair.dst.committed_blocks() == []
    pair.settled()
    pair.server.faults.drop_after_header = False
    assert run(pull_into(pair.client, pair.server.address, pair.dst, keys)).complete
    pair.settled()


@pytest.mark.parametrize("prefer_shm", [True, False])
def test_cancel_while_landing_imports_nothing(make_pair, oracle, prefer_shm) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(6, 4))
    entered, release = threading.Event(), threading.Event()

    def land(pulled, confirm):
        entered.set()
        release.wait(10)
        return import_pulled(pair.dst, pulled, confirm)

    async def cancel_mid_land() -> None:
        task = asyncio.ensure_future(pair.client.pull_land(pair.server.address, keys, land, prefer_shm))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # it waits for the worker thread (which may read the lease)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_mid_land())
    assert pair.dst.committed_blocks() == [] and pair.dst.top_pool.num_used == 0
    pair.settled()
    assert run(pull_into(pair.client, pair.server.address, pair.dst, keys, prefer_shm)).complete
    assert oracle.verify_manager(pair.dst) == 4
    pair.settled()


def test_unverified_ucx_pages_are_checked_at_import(make_pair, oracle) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(7, 4))
    pulled = pair.client.pull_sync(pair.server.address, keys, prefer_shm=False, verify=False)
    assert not pulled.verified and len(pulled.checksums) == 4
    spoilt = np.array(pulled.data)
    spoilt[2, 7] ^= 0xFF
    bad = type(pulled)(**{**pulled.__dict__, "data": spoilt})
    with pytest.raises(TransferError) as info:
        import_pulled(pair.dst, bad)
    assert info.value.reason == "integrity" and info.value.bad_keys == (keys[2],)
    assert pair.dst.committed_blocks() == []
    assert import_pulled(pair.dst, pulled).imported == tuple(keys)
    assert oracle.verify_manager(pair.dst) == 4
    pair.settled()


def test_spare_buffers_are_reused_within_their_limit() -> None:
    from raykv.transfer.pages.receive import SpareBuffers

    spare = SpareBuffers(limit=3 << 20)
    flat, rows = spare.take(4, 256 << 10)  # 1 MiB
    assert rows.shape == (4, 256 << 10) and np.shares_memory(flat, rows)
    spare.give(flat)
    again, rows = spare.take(2, 256 << 10)  # the smallest buffer that fits is reused
    assert again is flat and rows.shape == (2, 256 << 10)
    big, _ = spare.take(8, 1 << 20)  # 8 MiB: nothing fits, a new one
    spare.give(again)
    spare.give(big)  # over the limit: the largest goes
    assert spare.take(1, 1 << 20)[0] is again


def test_small_quick_ucx_landings_run_on_the_loop_the_rest_in_a_worker(
    make_pair, oracle, monkeypatch
) -> None:
    """pull_into's import (``quick``) of at most INLINE_LAND_BYTES lands on the loop over ucx; a
    land that may block, and a larger landing, run in a worker thread; every one imports."""
    pair = make_pair()
    where: list[str] = []

    class Recorded(Lander):
        def __call__(self, pulled, confirm):
            where.append(threading.current_thread().name)
            return super().__call__(pulled, confirm)

    def blocking(pulled, confirm):  # no ``quick``: may block
        where.append(threading.current_thread().name)
        return import_pulled(pair.dst, pulled, confirm)

    for i, land in enumerate([Recorded(pair.dst), blocking, Recorded(pair.dst)]):
        if i == 2:
            monkeypatch.setattr(landing, "INLINE_LAND_BYTES", 0)
        keys = commit(pair.src, oracle, seq(20 + i, 3))
        outcome = run(pair.client.pull_land(pair.server.address, keys, land, prefer_shm=False))
        assert outcome.imported == tuple(keys) and outcome.path == "ucx"
    assert where[0] == "raykv-transfer" and "raykv-transfer" not in where[1:]
    assert oracle.verify_manager(pair.dst) == 9
    pair.settled()

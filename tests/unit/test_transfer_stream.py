"""Streamed landings: a ucx ``pull_into`` of several chunks copies each run of rows into the
destination tier as soon as it arrived, and inserts the blocks only once the whole payload
arrived verified. Every test checks content with the oracle and that nothing leaks (leases,
staged pages, invariants) on any failure.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from transfer_support import Pair, commit, host_pair, run, seq

from raykv import ContentOracle, KVLayout, TransferError
from raykv.core.errors import OutOfPagesError, TransferFailure
from raykv.transfer import TransferConfig, pull_into
from raykv.transfer.pages import landing
from raykv.transfer.pages.landing import Arrivals

LAYOUT = KVLayout.uniform(num_layers=2, num_kv_heads=8, head_dim=128, tokens_per_block=16)  # 128 KiB
CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0, chunk_bytes=256 << 10)
PAGES = 16  # 2 MiB: chunks of 2 pages, streamed (more than INLINE_LAND_BYTES)


@pytest.fixture
def oracle() -> ContentOracle:
    return ContentOracle(LAYOUT)


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def factory(dst_pages: int = 64, config: TransferConfig = CFG) -> Pair:
        made.append(host_pair(LAYOUT, config, src_pages=32, dst_pages=dst_pages))
        return made[-1]

    yield factory
    for pair in made:
        pair.close()
    assert landing.STREAM_THREADS.busy == 0  # every landing gave its thread back


def keys_of(pair: Pair, oracle: ContentOracle, seed: int, blocks: int = PAGES) -> list[bytes]:
    return commit(pair.src, oracle, seq(seed, blocks, LAYOUT.tokens_per_block))


def nothing_imported(pair: Pair) -> None:
    assert pair.dst.committed_blocks() == [] and pair.dst.top_pool.num_used == 0
    pair.settled()


def test_rows_are_copied_while_later_chunks_arrive(make_pair, oracle, monkeypatch) -> None:
    """After the first chunk arrived, the loop waits until the landing copied it: the copy of
    arrived rows does not wait for the rest of the payload. Then every byte is checked."""
    pair = make_pair()
    keys = keys_of(pair, oracle, 1)
    copied = threading.Event()
    seen: list[tuple[int, bool]] = []
    write, arrived = pair.dst.copy.write, Arrivals.arrived

    def spy_write(level, slots, data):
        write(level, slots, data)
        copied.set()

    def spy_arrived(self, rows):
        arrived(self, rows)
        if not seen:
            seen.append((rows, copied.wait(5)))  # blocks the loop: only the landing's thread runs

    monkeypatch.setattr(pair.dst.copy, "write", spy_write)
    monkeypatch.setattr(Arrivals, "arrived", spy_arrived)
    outcome = run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False))
    assert outcome.imported == tuple(keys) and outcome.path == "ucx"
    assert seen == [(2, True)]  # the first chunk's 2 rows were copied before the rest arrived
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_streamed_and_whole_landings_import_the_same_bytes(make_pair, oracle, monkeypatch) -> None:
    pair = make_pair()
    first, second = keys_of(pair, oracle, 2, 12), keys_of(pair, oracle, 3, 12)
    assert run(pull_into(pair.client, pair.address, pair.dst, first, prefer_shm=False)).complete
    monkeypatch.setattr(landing, "streams", lambda header: False)
    assert run(pull_into(pair.client, pair.address, pair.dst, second, prefer_shm=False)).complete
    assert oracle.verify_manager(pair.dst) == 24
    pair.settled()


def test_landings_beyond_the_stream_threads_land_whole(make_pair, oracle, monkeypatch) -> None:
    pair = make_pair()
    keys = keys_of(pair, oracle, 9)
    threads = landing.STREAM_THREADS
    monkeypatch.setattr(threads, "busy", threads.size)  # every thread taken
    monkeypatch.setattr(Arrivals, "__init__", lambda *a: pytest.fail("streamed without a thread"))
    assert run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False)).complete
    assert threads.busy == threads.size
    monkeypatch.undo()
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_partly_cached_pulls_stream_only_the_new_rows(make_pair, oracle) -> None:
    pair = make_pair()
    keys = keys_of(pair, oracle, 4)
    assert run(pull_into(pair.client, pair.address, pair.dst, keys[:5], prefer_shm=False)).complete
    outcome = run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False))
    assert outcome.imported == tuple(keys[5:]) and outcome.already_present == tuple(keys[:5])
    again = run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False))
    assert again.imported == () and again.already_present == tuple(keys)
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_streamed_pull_without_its_first_parent_drops_every_block(make_pair, oracle) -> None:
    pair = make_pair()
    keys = keys_of(pair, oracle, 12)
    outcome = run(pull_into(pair.client, pair.address, pair.dst, keys[1:], prefer_shm=False))
    assert outcome.imported == () and outcome.dropped == tuple(keys[1:]) and not outcome.complete
    nothing_imported(pair)


@pytest.mark.parametrize("fault", ["corrupt_payload", "drop_after_header"])
def test_failed_streamed_payload_imports_nothing(make_pair, oracle, fault) -> None:
    """A corrupt chunk, or a peer gone before the payload: TransferError, nothing imported."""
    pair = make_pair()
    keys = keys_of(pair, oracle, 5)
    setattr(pair.server.faults, fault, True)
    with pytest.raises(TransferError) as info:
        run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False))
    assert info.value.reason in ({"integrity"} if fault == "corrupt_payload" else {"closed", "fault", "ucx"})
    nothing_imported(pair)
    setattr(pair.server.faults, fault, False)
    assert run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False)).complete
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_peer_gone_mid_payload_imports_nothing(make_pair, oracle, monkeypatch) -> None:
    """The server delivers 3 of 8 chunks and closes (receives posted after the header, so the
    chunks follow it): the rows that arrived were copied, and still nothing is imported."""
    pair = make_pair(config=CFG.replace(post_receives=False))
    keys = keys_of(pair, oracle, 11)
    arrived, original = [], Arrivals.arrived

    def spy(self, rows):
        original(self, rows)
        arrived.append(rows)

    monkeypatch.setattr(Arrivals, "arrived", spy)
    pair.server.faults.drop_after_chunks = 3
    with pytest.raises(TransferError) as info:
        run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False))
    assert info.value.reason in {"closed", "fault", "ucx"} and arrived[-1] == 6 < PAGES
    nothing_imported(pair)
    pair.server.faults.drop_after_chunks = 0
    assert run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False)).complete
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_cancel_after_the_first_chunk_imports_nothing(make_pair, oracle, monkeypatch) -> None:
    pair = make_pair()
    keys = keys_of(pair, oracle, 7)
    original = Arrivals.arrived
    tasks: list[asyncio.Task] = []

    def cancel_on_first(self, rows):
        original(self, rows)
        if rows < self.total:
            tasks[0].cancel()

    async def pull_and_cancel() -> None:
        tasks.append(asyncio.ensure_future(pull_into(pair.client, pair.address, pair.dst, keys, False)))
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]

    monkeypatch.setattr(Arrivals, "arrived", cancel_on_first)
    run(pull_and_cancel())
    nothing_imported(pair)
    monkeypatch.setattr(Arrivals, "arrived", original)
    assert run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False)).complete
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_concurrent_streamed_pulls_of_the_same_blocks_import_each_once(make_pair, oracle) -> None:
    """Both landings stage the blocks while their payloads arrive; the first to insert wins, the
    other gives its pages back (held stages race at insert, see transfer_blocks._commit)."""
    pair = make_pair()
    keys = keys_of(pair, oracle, 10)

    async def both() -> list:
        pulls = (pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False) for _ in range(3))
        return await asyncio.gather(*pulls)

    outcomes = run(both())
    imported = [k for outcome in outcomes for k in outcome.imported]
    assert sorted(imported) == sorted(keys)  # each block imported by exactly one pull
    assert all(set(o.imported) | set(o.already_present) == set(keys) for o in outcomes)
    assert pair.dst.top_pool.num_used == PAGES
    assert oracle.verify_manager(pair.dst) == PAGES
    pair.settled()


def test_import_refused_while_streaming_leaks_nothing(make_pair, oracle) -> None:
    pair = make_pair(dst_pages=8)  # room for 8 of the 16 pages
    keys = keys_of(pair, oracle, 8)
    with pytest.raises(OutOfPagesError):
        run(pull_into(pair.client, pair.address, pair.dst, keys, prefer_shm=False))
    nothing_imported(pair)
    assert run(pull_into(pair.client, pair.address, pair.dst, keys[:8], prefer_shm=False)).complete
    assert oracle.verify_manager(pair.dst) == 8
    pair.settled()


def test_only_large_payloads_of_several_chunks_stream(monkeypatch) -> None:
    def header(pages: int, chunks: int) -> SimpleNamespace:
        return SimpleNamespace(keys=[b""] * pages, page_bytes=128 << 10, layout=[pages // chunks] * chunks)

    roomy = 1 << 30
    assert landing.streams(header(16, 8), roomy)
    assert not landing.streams(header(16, 1), roomy)  # one chunk: nothing to overlap
    assert not landing.streams(header(8, 4), roomy)  # 1 MiB: lands on the loop (INLINE_LAND_BYTES)
    monkeypatch.setattr(landing, "usable_cores", lambda: 2)
    assert landing.streams(header(16, 8), 2 << 20)  # into a spare buffer
    assert not landing.streams(header(16, 8), 1 << 20)  # fresh memory, few cores: whole
    monkeypatch.setattr(landing, "usable_cores", lambda: landing.STREAM_FRESH_CORES)
    assert landing.streams(header(16, 8), 1 << 20)


# ---- Arrivals --------------------------------------------------------------------------------
def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    got: list[object] = []

    def target() -> None:
        try:
            got.append(work())
        except BaseException as exc:  # handed to the test
            got.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, got


def test_arrivals_wake_waiters_in_order() -> None:
    arrivals = Arrivals(8, timeout=5)
    thread, got = in_thread(lambda: arrivals.wait_rows(3))
    arrivals.arrived(2)
    time.sleep(0.05)
    assert thread.is_alive()  # row 3 has not arrived
    arrivals.arrived(6)
    thread.join(5)
    assert got == [6]
    arrivals.arrived(4)  # never backwards
    assert arrivals.wait_rows(5) == 6
    done, finished = in_thread(arrivals.wait_done)
    arrivals.arrived(8)
    time.sleep(0.05)
    assert done.is_alive()  # every row, but not verified yet
    arrivals.finish()
    done.join(5)
    assert finished == [None]


def test_arrivals_failure_and_timeout_raise_transfer_errors() -> None:
    arrivals = Arrivals(4, timeout=5)
    thread, got = in_thread(lambda: arrivals.wait_rows(0))
    error = TransferError("bad page", reason=TransferFailure.INTEGRITY, bad_keys=(b"k",))
    arrivals.fail(error)
    thread.join(5)
    (raised,) = got
    assert isinstance(raised, TransferError) and raised is not error and raised == error
    arrivals.fail(asyncio.CancelledError())  # the first failure stays
    with pytest.raises(TransferError, match="bad page"):
        arrivals.wait_done()
    cancelled = Arrivals(4, timeout=5)
    cancelled.fail(asyncio.CancelledError())
    with pytest.raises(TransferError) as info:
        cancelled.wait_rows(0)
    assert info.value.reason == "cancelled"
    late = Arrivals(4, timeout=0.05)
    with pytest.raises(TransferError) as info:
        late.wait_done()
    assert info.value.reason == "timeout"
    finished = Arrivals(4, timeout=5)
    finished.finish()
    finished.fail(error)  # after finish: nothing to fail
    finished.wait_done()

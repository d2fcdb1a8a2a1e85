"""PageServer + PageClient in one process over UCX (TCP loopback) and the shared-memory path.

Every test checks content with the oracle, and that nothing leaks: no lease left on the serving
manager, invariants hold on both managers, a failed pull imports nothing. Listeners bind
127.0.0.1; every server and client is closed at teardown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from transfer_support import commit, run, seq

from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig, TransferError
from raykv.core.records import page_checksum
from raykv.transfer import AuthToken, PageClient, PageServer, TransferConfig, get_runtime, pull_into
from raykv.transfer import client as client_module
from raykv.transfer.net import wire
from raykv.transfer.pages import receive
from raykv.transfer.paths.importer import import_pulled

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)


@dataclass
class Pair:
    src: CacheManager  # serving manager: shared host tier + disk
    dst: CacheManager  # pulling manager: plain host tier
    server: PageServer
    client: PageClient
    token: AuthToken

    def wait_no_leases(self) -> None:
        deadline = time.monotonic() + 5
        while (self.server.open_leases or self.src.store.leases) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.open_leases == 0 and not self.src.store.leases
        self.src.check_invariants()
        self.dst.check_invariants()


def manager(layout: KVLayout, host_pages: int, shared: bool, disk_pages: int = 0) -> CacheManager:
    tiers = [TierConfig.host(host_pages * layout.page_bytes, pin_memory=False, shared=shared)]
    if disk_pages:
        tiers.append(TierConfig.disk(disk_pages * layout.page_bytes))
    return CacheManager(CacheConfig(layout, tuple(tiers)))


@pytest.fixture
def make_pair(layout: KVLayout) -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def factory(
        config: TransferConfig = CFG,
        host_pages: int = 32,
        disk_pages: int = 32,
        page_layout: KVLayout = layout,
    ) -> Pair:
        token = AuthToken.generate()
        src = manager(page_layout, host_pages, shared=True, disk_pages=disk_pages)
        dst = manager(page_layout, 64, shared=False)
        server = PageServer(src, token, config)
        server.start()
        pair = Pair(src, dst, server, PageClient(token, config), token)
        made.append(pair)
        return pair

    yield factory
    for pair in made:
        pair.client.close()
        pair.server.close()
        assert pair.server.open_leases == 0 and not pair.src.store.leases
        pair.src.shutdown()
        pair.dst.shutdown()


def check_pages(oracle: ContentOracle, pulled: Any, keys: list[bytes]) -> None:
    assert list(pulled.keys) == keys
    for key, row in zip(pulled.keys, pulled.data):
        assert oracle.check(row, key)


# ---- happy paths ----------------------------------------------------------------------------------
def test_same_node_pull_uses_shared_memory(make_pair: Callable[..., Pair], oracle: ContentOracle) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(1, 10))
    pulled = pair.client.pull_sync(pair.server.address, keys)  # type: ignore[arg-type]
    assert pulled.path == "shm" and pulled.verified and not pulled.missing
    check_pages(oracle, pulled, keys)
    assert pair.client.stats.pulls["shm"] == 1 and pair.client.stats.bytes["shm"] == pulled.nbytes
    pair.wait_no_leases()
    assert pair.server.stats.pulls == {"shm": 1}


def test_ucx_pull_gathers_scattered_pages_from_every_tier(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    pair = make_pair(CFG.replace(chunk_bytes=2048), host_pages=8)  # 4 pages per chunk
    first = commit(pair.src, oracle, seq(1, 6))
    commit(pair.src, oracle, seq(2, 6))  # demotes part of the first chain to disk
    keys = first[::2] + first[1::2]  # not one contiguous run: the server stages them
    assert {t.name for t in pair.src.probe(keys=first).tiers} == {"HOST", "DISK"}
    pulled = pair.client.pull_sync(pair.server.address, keys, prefer_shm=False)  # type: ignore[arg-type]
    assert pulled.path == "ucx"
    check_pages(oracle, pulled, keys)
    assert pair.client.stats.pulls == {"ucx": 1}
    pair.wait_no_leases()


@pytest.mark.parametrize("prefer_shm", [True, False])
def test_large_pull_is_chunked_checksummed_in_pieces_and_verified(
    make_pair: Callable[..., Pair], prefer_shm: bool
) -> None:
    big = KVLayout.uniform(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=4)  # 64 KiB pages
    oracle = ContentOracle(big)
    pair = make_pair(host_pages=96, disk_pages=0, page_layout=big)
    keys = commit(pair.src, oracle, seq(14, 90))  # 5.6 MiB: several chunks, checksums in a trailer
    pulled = pair.client.pull_sync(pair.server.address, keys, prefer_shm, verify=True)  # type: ignore[arg-type]
    assert pulled.path == ("shm" if prefer_shm else "ucx") and pulled.verified
    check_pages(oracle, pulled, keys)
    pair.server.faults.corrupt_payload = True
    with pytest.raises(TransferError) as info:
        pair.client.pull_sync(pair.server.address, keys, prefer_shm, verify=True)  # type: ignore[arg-type]
    assert info.value.reason == "integrity" and keys[0] in info.value.bad_keys  # ucx: one per chunk
    pair.wait_no_leases()


def test_pull_into_imports_matchable_blocks(make_pair: Callable[..., Pair], oracle: ContentOracle) -> None:
    pair = make_pair()
    tokens = seq(3, 8)
    keys = commit(pair.src, oracle, tokens)
    for prefer_shm in (True, False):
        outcome = get_runtime().run(
            pull_into(pair.client, pair.server.address, pair.dst, keys, prefer_shm), 30
        )
        assert outcome.complete
        if prefer_shm:
            assert outcome.path == "shm" and len(outcome.imported) == 8
        else:
            assert outcome.path == "ucx" and len(outcome.already_present) == 8
    assert oracle.verify_manager(pair.dst) == 8
    stored = [e for e in pair.dst.drain_events() if type(e).__name__ == "BlockStored"]
    assert [e.key for e in stored] == keys
    with pair.dst.create([*tokens, 1]) as cache:  # a decode request reuses every pulled block
        assert cache.num_reused_tokens == len(tokens)
        assert cache.resume()
        oracle.verify_cache(cache)
    pair.wait_no_leases()


def test_out_buffer_and_batches_over_the_key_limit(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    pair = make_pair(CFG.replace(max_keys=3))
    keys = commit(pair.src, oracle, seq(4, 8))
    out = np.zeros((10, pair.src.layout.page_bytes), dtype=np.uint8)
    for shm in (True, False):
        pulled = pair.client.runtime.run(pair.client.pull(pair.server.address, keys, shm, out=out), 30)  # type: ignore[arg-type]
        assert pulled.data.base is out or np.shares_memory(pulled.data, out)
        check_pages(oracle, pulled, keys)
    pair.wait_no_leases()
    assert pair.server.stats.pulls == {"shm": 3, "ucx": 3}  # 8 keys in batches of 3
    with pytest.raises(ValueError):
        pair.client.runtime.run(pair.client.pull(pair.server.address, keys, out=out[:2]), 30)  # type: ignore[arg-type]
    pair.wait_no_leases()


def test_unknown_keys_are_reported_and_only_a_consistent_prefix_is_imported(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(5, 6))
    unknown = bytes(32)
    pulled = pair.client.pull_sync(pair.server.address, [unknown, *keys[:2]])  # type: ignore[arg-type]
    assert pulled.missing == (unknown,) and list(pulled.keys) == keys[:2]
    # Block 2 is missing on the peer side of this request: blocks 3.. cannot be imported.
    pulled = pair.client.pull_sync(pair.server.address, keys[:2] + keys[3:])  # type: ignore[arg-type]
    outcome = import_pulled(pair.dst, pulled)
    assert outcome.imported == tuple(keys[:2]) and outcome.dropped == tuple(keys[3:])
    assert not outcome.complete
    assert oracle.verify_manager(pair.dst) == 2
    empty = pair.client.pull_sync(pair.server.address, [])  # type: ignore[arg-type]
    assert empty.keys == () and empty.nbytes == 0
    with pytest.raises(ValueError):
        pair.client.pull_sync(pair.server.address, [keys[0], keys[0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pair.client.pull_sync(pair.server.address, [b"short"])  # type: ignore[arg-type]
    pair.wait_no_leases()


def test_concurrent_pulls_from_two_peers_with_backpressure(
    make_pair: Callable[..., Pair], oracle: ContentOracle, layout: KVLayout
) -> None:
    page = layout.page_bytes
    tight = CFG.replace(
        max_payload_bytes=4 * page, server_inflight_bytes=4 * page, client_inflight_bytes=4 * page
    )
    one, two = make_pair(tight), make_pair(tight)
    keys_one = commit(one.src, oracle, seq(6, 8))
    keys_two = commit(two.src, oracle, seq(7, 8))
    client = PageClient(one.token, tight)
    try:
        b = client
        c = PageClient(two.token, tight)

        async def both() -> list[Any]:
            jobs = [b.pull(one.server.address, keys_one[i : i + 4], prefer_shm=False) for i in (0, 4)]  # type: ignore[arg-type]
            jobs += [c.pull(two.server.address, keys_two[i : i + 4]) for i in (0, 4)]  # type: ignore[arg-type]
            jobs += [b.pull(one.server.address, keys_one)]  # type: ignore[arg-type]
            return await asyncio.gather(*jobs)

        results = get_runtime().run(both(), 60)
        for pulled, keys in zip(results, [keys_one[:4], keys_one[4:], keys_two[:4], keys_two[4:], keys_one]):
            check_pages(oracle, pulled, keys)
        assert one.server.peak_inflight_bytes <= 4 * page and two.server.peak_inflight_bytes <= 4 * page
        assert 0 < b.peak_inflight_bytes <= 4 * page
        c.close()
    finally:
        client.close()
    one.wait_no_leases()
    two.wait_no_leases()


def test_client_reconnects_after_the_server_restarts(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(15, 3))
    check_pages(oracle, pair.client.pull_sync(pair.server.address, keys), keys)  # type: ignore[arg-type]
    port = pair.server.address.port  # type: ignore[union-attr]
    pair.wait_no_leases()
    pair.server.close()  # drops the pooled connection
    pair.server = PageServer(pair.src, pair.token, CFG.replace(port=port))
    assert pair.server.start().port == port
    time.sleep(0.05)  # let the client's loop see the old connection's EOF
    check_pages(oracle, pair.client.pull_sync(pair.server.address, keys), keys)  # type: ignore[arg-type]
    pair.wait_no_leases()


# ---- refusals and failures ------------------------------------------------------------------------
def test_wrong_token_is_refused_and_never_logged(
    make_pair: Callable[..., Pair], oracle: ContentOracle, caplog: pytest.LogCaptureFixture
) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(8, 2))
    intruder = PageClient(AuthToken.generate(), CFG)
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(TransferError) as info:
            intruder.pull_sync(pair.server.address, keys)  # type: ignore[arg-type]
    finally:
        intruder.close()
    assert info.value.reason == "auth"
    assert pair.server.stats.preauth_rejected == 1 and pair.server.stats.pulls == {}
    secret = pair.token._secret
    everything = caplog.text + str(info.value) + repr(info.value) + repr(pair.server.__dict__)
    assert secret.hex() not in everything and repr(secret) not in everything
    pair.wait_no_leases()


@pytest.mark.parametrize("prefer_shm", [True, False])
def test_corrupt_payload_is_detected_and_nothing_is_imported(
    make_pair: Callable[..., Pair], oracle: ContentOracle, prefer_shm: bool
) -> None:
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(9, 4))
    pair.server.faults.corrupt_payload = True  # shm: only checksums can be spoilt; ask for them
    with pytest.raises(TransferError) as info:
        pair.client.pull_sync(pair.server.address, keys, prefer_shm, verify=True)  # type: ignore[arg-type]
    assert info.value.reason == "integrity" and info.value.bad_keys == (keys[0],)
    before = pair.dst.committed_blocks()
    with pytest.raises(TransferError) as info:  # the import path catches it too
        pull = pull_into(pair.client, pair.server.address, pair.dst, keys, prefer_shm, verify=True)  # type: ignore[arg-type]
        get_runtime().run(pull, 30)
    assert info.value.reason == "integrity"
    assert pair.dst.committed_blocks() == before == []
    pair.server.faults.corrupt_payload = False
    assert oracle.check(pair.client.pull_sync(pair.server.address, keys[:1], prefer_shm).data[0], keys[0])  # type: ignore[arg-type]
    assert oracle.verify_manager(pair.src) == 4  # the tier itself was never touched
    pair.wait_no_leases()


@pytest.mark.parametrize("prefer_shm", [True, False])
def test_peer_dropping_mid_transfer_fails_cleanly(make_pair: Callable[..., Pair], prefer_shm: bool) -> None:
    big = KVLayout.uniform(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=4)  # 64 KiB pages
    oracle = ContentOracle(big)
    pair = make_pair(host_pages=8, disk_pages=0, page_layout=big)
    keys = commit(pair.src, oracle, seq(10, 5))  # 320 KiB: checksums follow the header
    pair.server.faults.drop_after_header = True
    with pytest.raises(TransferError) as info:
        get_runtime().run(pull_into(pair.client, pair.server.address, pair.dst, keys, prefer_shm), 30)
    assert info.value.reason in {"closed", "fault", "ucx"}
    assert pair.dst.committed_blocks() == []
    pair.wait_no_leases()
    pair.server.faults.drop_after_header = False  # the server still serves, the client recovers
    check_pages(oracle, pair.client.pull_sync(pair.server.address, keys, prefer_shm), keys)  # type: ignore[arg-type]
    pair.wait_no_leases()


def test_small_shm_pull_needs_nothing_after_the_header(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    """A small payload's checksums ride in the header, so a same-node client has everything once
    the header is in: a server dropping the connection then cannot spoil the (verified) result."""
    pair = make_pair()
    keys = commit(pair.src, oracle, seq(13, 3))
    pair.server.faults.drop_after_header = True
    pulled = pair.client.pull_sync(pair.server.address, keys, verify=True)  # type: ignore[arg-type]
    assert pulled.path == "shm" and pulled.verified
    check_pages(oracle, pulled, keys)
    pair.wait_no_leases()


@pytest.mark.parametrize("prefer_shm", [True, False])
def test_cancel_and_timeout_release_everything(make_pair: Callable[..., Pair], prefer_shm: bool) -> None:
    big = KVLayout.uniform(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=4)  # 64 KiB pages
    pair = make_pair(host_pages=24, disk_pages=0, page_layout=big)
    keys = commit(pair.src, ContentOracle(big), seq(11, 20))  # 1.25 MiB: over INLINE_BYTES, the
    # checksums come after the stalled header (shm), the payload after it (ucx)
    pair.server.faults.stall_after_header_s = 30.0

    async def cancel_mid_pull() -> None:
        pull = pair.client.pull(pair.server.address, keys, prefer_shm, verify=True)  # type: ignore[arg-type]
        task = asyncio.ensure_future(pull)
        while not pair.server.open_leases:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    get_runtime().run(cancel_mid_pull(), 20)
    pair.wait_no_leases()
    with pytest.raises(TransferError) as info:
        get_runtime().run(pair.client.pull(pair.server.address, keys, prefer_shm, 0.3, verify=True), 20)  # type: ignore[arg-type]
    assert info.value.reason == "timeout"
    pair.wait_no_leases()
    assert pair.client.stats.failures["timeout"] == 1


def test_server_survives_oversized_and_malformed_requests(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    pair = make_pair(CFG.replace(max_keys=4))
    keys = commit(pair.src, oracle, seq(12, 6))
    host, port = pair.server.address.endpoint  # type: ignore[union-attr]

    async def raw(payload: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await wire.read_message(reader, 4096)  # hello
            writer.write(payload)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()

    for junk in [(1 << 31).to_bytes(4, "big"), (5).to_bytes(4, "big") + b"\xc1" * 5, b"\x00\x00\x00\x01\x80"]:
        get_runtime().run(raw(junk), 10)  # the server answers with an error (or closes) and moves on
    with pytest.raises(TransferError) as info:  # more keys than the server allows in one request
        bad = PageClient(pair.token, CFG.replace(max_keys=8, use_shm_read=False))
        try:
            bad.runtime.run(bad.checkout(pair.server.address.endpoint), 10)  # type: ignore[union-attr]
            conn = bad.runtime.run(bad.checkout(pair.server.address.endpoint), 10)  # type: ignore[union-attr]
            conn.max_keys = 8  # pretend the server allowed 8
            bad.checkin(conn.peer, conn)
            bad.pull_sync(pair.server.address, keys)  # type: ignore[arg-type]
        finally:
            bad.close()
    assert info.value.reason == "limit"
    # The junk came before authentication: one counter, no error reason; the key limit after it.
    assert pair.server.stats.preauth_rejected == 3 and pair.server.stats.errors == {"limit": 1}
    check_pages(oracle, pair.client.pull_sync(pair.server.address, keys), keys)  # type: ignore[arg-type]
    pair.wait_no_leases()


def test_client_refuses_a_server_that_sends_oversized_or_bogus_messages() -> None:
    token = AuthToken.generate()

    async def scenario(reply: bytes) -> TransferError:
        async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(reply)
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(fake, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = PageClient(token, CFG)
        try:
            await client.pull(("127.0.0.1", port), [bytes(32)])
        except TransferError as exc:
            return exc
        finally:
            await client.aclose()
            server.close()
        raise AssertionError("the bogus server was accepted")

    oversized = (1 << 30).to_bytes(4, "big") + b"x" * 100
    assert get_runtime().run(scenario(oversized), 20).reason == "protocol"
    assert get_runtime().run(scenario(wire.encode({"t": "welcome"}, 4096)), 20).reason == "protocol"
    # A server that does not know the token cannot prove it.
    hello = wire.encode({"t": "hello", "v": wire.VERSION, "nonce": bytes(32)}, 4096)
    welcome = wire.encode({"t": "welcome", "mac": bytes(32), "node": "x", "page_bytes": 1}, 4096)
    assert get_runtime().run(scenario(hello + welcome), 20).reason == "auth"


# ---- example and benchmark ------------------------------------------------------------------------
def test_pd_example_verifies_itself() -> None:
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "pd_disagg_core.py"
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")


def test_bench_rows_come_from_a_peer_process() -> None:
    from raykv.bench.transfer import TransferSettings, run_process_rows

    quick = TransferSettings((64 << 10,), (2,), repeats=1, warmup=0, short_factor=1, short_warmup=0)
    rows = run_process_rows(quick)
    assert [r.name for r in rows] == [
        "shm_read pull 2 x 64 KiB",
        "shm pull 2 x 64 KiB",
        "ucx pull 2 x 64 KiB",
    ]
    assert all(r.error is None and r.ours > 0 and r.baseline and r.baseline > 0 for r in rows)


def test_server_sees_a_peer_gone_by_eof_reset_or_closing_transport() -> None:
    """A reset while the server wrote leaves its reader an exception, not EOF: a stalled pull must
    still notice the peer is gone and end its lease (this once kept a lease for 30 s)."""
    from raykv.transfer.paths.serving import ServerConn

    class Writer:
        def __init__(self, closing: bool) -> None:
            self.closing = closing

        def is_closing(self) -> bool:
            return self.closing

    async def states() -> list[bool]:
        out = []
        for what in ("open", "eof", "reset", "closing"):
            reader = asyncio.StreamReader()
            if what == "eof":
                reader.feed_eof()
            elif what == "reset":
                reader.set_exception(ConnectionResetError())
            conn = ServerConn(reader, Writer(what == "closing"), "peer", None)  # type: ignore[arg-type]
            out.append(conn.peer_gone())
        return out

    assert get_runtime().run(states(), 5) == [False, True, True, True]


@pytest.mark.parametrize("size", ["small", "large"])
def test_sender_checksums_are_remembered_and_catch_damage_at_rest(
    make_pair: Callable[..., Pair], layout: KVLayout, size: str
) -> None:
    """A sender checksums a block's page once (in the header for a small payload, in a trailer
    for a large one) and keeps it with the block: later leases carry it, so a later pull sends it
    in the header without reading the page, and a page damaged in memory since then fails the
    receiver's check instead of being sent with a fresh checksum of the damaged bytes."""
    page_layout = layout if size == "small" else KVLayout.uniform(4, 8, 128, 4)  # 64 KiB pages
    oracle = ContentOracle(page_layout)
    pair = make_pair(host_pages=40, disk_pages=0, page_layout=page_layout)
    keys = commit(pair.src, oracle, seq(21, 32))  # 2 MiB of 64 KiB pages: over the inline limit
    lease = pair.src.lease_blocks(keys)
    assert all(b.checksum is None for b in lease.blocks)
    pair.src.release_lease(lease.lease_id)
    check_pages(oracle, pair.client.pull_sync(pair.server.address, keys, prefer_shm=False), keys)  # type: ignore[arg-type]
    pair.wait_no_leases()
    lease = pair.src.lease_blocks(keys)
    pages = [np.array(pair.src.leased_page(b)) for b in lease.blocks]
    assert [b.checksum for b in lease.blocks] == [page_checksum(memoryview(p)) for p in pages]
    pair.src.release_lease(lease.lease_id)
    again = pair.client.pull_sync(pair.server.address, keys[3:9], prefer_shm=False)  # type: ignore[arg-type]
    check_pages(oracle, again, keys[3:9])
    pair.src.pools[0].array[pair.src.tree.blocks[keys[5]].page.slot, 7] ^= 0x40  # type: ignore[attr-defined]
    with pytest.raises(TransferError) as info:
        pair.client.pull_sync(pair.server.address, keys, prefer_shm=False)  # type: ignore[arg-type]
    assert info.value.reason == "integrity" and info.value.bad_keys == (keys[5],)
    pair.wait_no_leases()


def test_a_recommitted_block_does_not_inherit_the_old_checksum(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    pair = make_pair(host_pages=8, disk_pages=0)
    keys = commit(pair.src, oracle, seq(5, 4))
    pair.client.pull_sync(pair.server.address, keys, prefer_shm=False)  # type: ignore[arg-type]
    pair.wait_no_leases()
    assert all(pair.src.tree.blocks[k].checksum is not None for k in keys)
    pair.src.clear_reusable()
    again = commit(pair.src, oracle, seq(5, 4))
    assert again == keys and all(pair.src.tree.blocks[k].checksum is None for k in keys)
    check_pages(oracle, pair.client.pull_sync(pair.server.address, keys, prefer_shm=False), keys)  # type: ignore[arg-type]
    pair.wait_no_leases()


@pytest.mark.parametrize(
    "posted,late,split",
    [
        (True, False, False),
        (True, True, False),
        (False, False, False),
        (True, False, True),
        (True, True, True),
    ],
)
def test_ucx_pages_land_in_the_right_rows_whatever_the_server_finds(
    make_pair: Callable[..., Pair],
    oracle: ContentOracle,
    layout: KVLayout,
    posted: bool,
    late: bool,
    split: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``post_receives`` the client posts chunk 0's receive with its request and the server
    sends that chunk before its header (an empty message when it found nothing); with ``split``
    (``early_split_bytes``) it posts chunk 1's too, chunk 0 taking the first three quarters of the
    requested pages (an empty message for a chunk that gets no page). All of the keys, some,
    none, or more than one chunk's worth must land in the right rows, and the connection must
    stay clean for the next pull (nothing stray arrives later). ``late``: every receive posts
    20 ms late, so the chunks arrive before their receives (UCX holds them)."""
    if late:
        post = receive.tag_recv

        async def late_post(endpoint: Any, buf: Any, tag: int) -> Any:
            await asyncio.sleep(0.02)
            return await post(endpoint, buf, tag)

        monkeypatch.setattr(receive, "tag_recv", late_post)
    splits: list[int] = []
    real_post_first = client_module.post_first

    def spy(endpoint: Any, data: Any, flat: Any, tag: int, split_at: int = 0) -> Any:
        splits.append(split_at)
        return real_post_first(endpoint, data, flat, tag, split_at)

    monkeypatch.setattr(client_module, "post_first", spy)
    chunk = (16 if split else 4) * layout.page_bytes
    config = CFG.replace(chunk_bytes=chunk, post_receives=posted, early_split_bytes=1 if split else 0)
    pair = make_pair(config, host_pages=32, disk_pages=0)
    keys = commit(pair.src, oracle, seq(31, 12))
    gone = [bytes([9]) * 32, bytes([8]) * 32, bytes([7]) * 32, bytes([6]) * 32]
    cases = [keys, [gone[0], *keys[:7]], [*keys[:3], gone[1]], [*keys[:2], *gone[:2]], gone, keys[5:6]]
    for want in cases * 2:  # twice over the same idle connection
        out = np.zeros((len(want), layout.page_bytes), dtype=np.uint8)
        pulled = pair.client.pull_sync(pair.server.address, want, prefer_shm=False, out=out)  # type: ignore[arg-type]
        found = [k for k in want if k not in gone]
        check_pages(oracle, pulled, found)
        assert list(pulled.missing) == [k for k in want if k in gone] and pulled.verified
        assert not found or np.shares_memory(pulled.data, out)
    assert pair.client.stats.pulls["ucx"] == 2 * len(cases)
    # split: 12 keys -> 9 + 3 pages, 8 -> 6 + 1, 4 -> 3 + an empty one, 2 + 2 empty ones, 4 gone
    assert splits[: len(cases)] == ([9, 6, 3, 3, 3, 0] if split else [0] * len(cases) if posted else [])
    outcome = get_runtime().run(pull_into(pair.client, pair.server.address, pair.dst, cases[1], False), 30)  # type: ignore[arg-type]
    assert outcome.imported == tuple(keys[:7]) and outcome.missing == (gone[0],)
    assert oracle.verify_manager(pair.dst) == 7
    pair.wait_no_leases()


def test_done_is_written_after_the_pull_returns_or_with_the_next_request(
    make_pair: Callable[..., Pair], oracle: ContentOracle
) -> None:
    """A ucx pull returns before its ``done`` is written: the next request takes it along, else
    it goes two loop turns later or when the client closes; every pull counts, no lease stays."""
    pair = make_pair(host_pages=32, disk_pages=0)
    keys = commit(pair.src, oracle, seq(41, 8))

    async def pulls() -> int:
        check_pages(oracle, await pair.client.pull(pair.server.address, keys[:5], prefer_shm=False), keys[:5])
        held = pair.server.open_leases  # done still pending: the server holds the lease
        check_pages(oracle, await pair.client.pull(pair.server.address, keys, prefer_shm=False), keys)
        await pair.client.pull(pair.server.address, keys[:2], prefer_shm=False)
        await pair.client.aclose()  # before the third done's turn came
        return held

    held = run(pulls())
    pair.wait_no_leases()
    assert held == 1 and pair.server.stats.connections == 1 and pair.server.stats.pulls == {"ucx": 3}

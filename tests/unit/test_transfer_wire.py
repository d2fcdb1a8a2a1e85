"""Pure parts of raykv.transfer (no UCX): settings, token, wire limits, budgets, shared tier files."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv import CacheConfig, CacheManager, ConfigError, KVLayout, TierConfig, TierKind, TransferError
from raykv.transfer import AuthToken, TransferConfig
from raykv.transfer.net import wire
from raykv.transfer.net.auth import CLIENT_LABEL, SERVER_LABEL
from raykv.transfer.net.runtime import ByteBudget, active_transports, cancel_and_wait, transport_warnings
from raykv.transfer.pages.payload import (
    AUTO_SPLIT_CORES,
    chunk_counts,
    early_split,
    payload_counts,
    usable_cores,
)
from raykv.transfer.pages.shm import ShmMapping, consecutive, copy_rows
from raykv.transfer.server import split_field as server_split

KEY = bytes(range(32))


# ---- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change",
    [
        {"host": ""},
        {"port": 70000},
        {"port": True},
        {"max_keys": 0},
        {"max_header_bytes": 100},
        {"max_payload_bytes": 4 << 30},  # above the in-flight budgets
        {"max_keys": 100_000},  # cannot fit in the header limit
        {"timeout_s": 0},
        {"timeout_s": float("nan")},
        {"connect_timeout_s": "1"},
        {"ucx_tls": ""},
        {"use_shm": 1},
        {"early_split_bytes": -1},
        {"early_split_bytes": True},
        {"early_split_bytes": 1.5},
        {"ucx_progress": "fast"},
        {"ucx_progress": 1},
    ],
)
def test_transfer_config_rejects_bad_values(change: dict) -> None:
    with pytest.raises(ConfigError):
        TransferConfig(**change)


def test_transfer_config_loopback_and_replace_validate() -> None:
    cfg = TransferConfig.loopback(max_keys=16)
    assert cfg.host == "127.0.0.1" and cfg.ucx_net_devices == "lo" and cfg.max_keys == 16
    with pytest.raises(ConfigError):
        cfg.replace(chunk_bytes=0)
    assert cfg.node == cfg.node  # stable default node id
    assert cfg.replace(node_id="n1").node == "n1"


def test_shared_tier_config_is_host_only() -> None:
    assert TierConfig.host(4096).shared is False
    assert TierConfig.host(4096, shared=True).shared is True
    with pytest.raises(ConfigError):
        TierConfig(TierKind.DISK, 4096, shared=True)
    with pytest.raises(ConfigError):
        TierConfig(TierKind.HOST, 4096, shared="yes")  # type: ignore[arg-type]


# ---- token --------------------------------------------------------------------------------------
def test_token_never_printed_and_pickles() -> None:
    secret = os.urandom(32)
    token = AuthToken(secret)
    for text in (repr(token), str(token), f"{token}", repr([token])):
        assert secret.hex() not in text and repr(secret) not in text and "redacted" in text
    again = pickle.loads(pickle.dumps(token))
    assert again == token and hash(again) == hash(token)
    assert AuthToken.generate() != token
    with pytest.raises(ValueError):
        AuthToken(b"short")


def test_challenge_response_is_labelled_and_exact() -> None:
    token, other = AuthToken.generate(), AuthToken.generate()
    ns, nc = os.urandom(32), os.urandom(32)
    mac = token.proof(CLIENT_LABEL, ns, nc)
    assert token.check(mac, CLIENT_LABEL, ns, nc)
    assert not other.check(mac, CLIENT_LABEL, ns, nc)
    assert not token.check(mac, SERVER_LABEL, ns, nc)  # a client proof is no server proof
    assert not token.check(mac, CLIENT_LABEL, nc, ns)
    assert not token.check("not bytes", CLIENT_LABEL, ns, nc)


# ---- wire ---------------------------------------------------------------------------------------
def header_msg(keys: list[bytes], **over: object) -> dict:
    msg = {
        "t": "header",
        "id": 1,
        "path": "ucx",
        "page_bytes": 512,
        "keys": keys,
        "parents": [KEY] * len(keys),
        "roots": [True] * len(keys),
        "tokens": [4] * len(keys),
        "layout": [len(keys)] if keys else [],
    }
    msg.update(over)
    return msg


def test_encode_decode_roundtrip_and_limits() -> None:
    framed = wire.encode({"t": "x", "v": b"\x00" * 10}, 4096)
    assert wire.decode(framed[4:]) == {"t": "x", "v": b"\x00" * 10}
    with pytest.raises(TransferError) as info:
        wire.encode({"t": "x", "v": b"\x00" * 5000}, 4096)
    assert info.value.reason == "limit"


def test_read_message_refuses_oversized_and_truncated() -> None:
    async def read(data: bytes, limit: int = 64) -> dict:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await wire.read_message(reader, limit)

    with pytest.raises(TransferError) as info:
        asyncio.run(read((1 << 30).to_bytes(4, "big") + b"x"))
    assert info.value.reason == "protocol"
    with pytest.raises(TransferError) as info:
        asyncio.run(read((10).to_bytes(4, "big") + b"abc"))
    assert info.value.reason == "closed"
    with pytest.raises(TransferError):
        asyncio.run(read((3).to_bytes(4, "big") + b"\xc1\xc1\xc1"))  # not msgpack
    assert asyncio.run(read(wire.encode({"t": "ok"}, 64))) == {"t": "ok"}


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_decode_garbage_is_protocol_error_or_a_typed_map(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except TransferError as exc:
        assert exc.reason == "protocol"
    else:
        assert isinstance(msg, dict) and isinstance(msg["t"], str)


def test_header_validation() -> None:
    keys = [bytes([i]) * 32 for i in range(4)]
    head = wire.Header.from_msg(header_msg(keys[1:3]), keys, 1 << 20)
    assert head.keys == tuple(keys[1:3]) and head.layout == (2,)
    bad = [
        header_msg(keys[::-1]),  # not in request order
        header_msg([b"x" * 32]),  # not requested
        header_msg(keys, parents=[KEY]),  # lengths differ
        header_msg(keys, roots=[1, 1, 1, 1]),
        header_msg(keys, tokens=[0, 4, 4, 4]),
        header_msg(keys, layout=[3]),  # chunk counts do not add up
        header_msg(keys, path="tcp"),
        header_msg(keys, page_bytes=True),
        {**header_msg(keys), "keys": [k[:31] for k in keys]},
        {**header_msg(keys), "t": "sums"},
    ]
    for msg in bad:
        with pytest.raises(TransferError):
            wire.Header.from_msg(msg, keys, 1 << 20)
    with pytest.raises(TransferError) as info:
        wire.Header.from_msg(header_msg(keys), keys, 1024)  # payload over the limit
    assert info.value.reason == "limit"
    with pytest.raises(TransferError) as info:
        wire.Header.from_msg({"t": "error", "reason": "auth", "message": "no"}, keys, 1 << 20)
    assert info.value.reason == "auth"


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["t", "id", "path", "page_bytes", "keys", "parents", "roots", "tokens", "layout"]),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.binary(max_size=40),
            st.text(max_size=5),
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
        ),
    )
)
def test_random_headers_never_escape_as_other_errors(msg: dict) -> None:
    msg.setdefault("t", "header")
    body = msgpack.packb(msg, use_bin_type=True)
    try:
        wire.Header.from_msg(wire.decode(body), [KEY], 1 << 20)
    except TransferError:
        pass


# ---- budgets, chunks, transports --------------------------------------------------------------
def test_byte_budget_bounds_and_cancellation() -> None:
    async def main() -> tuple[int, int]:
        budget = ByteBudget(100)
        await budget.acquire(60)
        waiter = asyncio.ensure_future(budget.acquire(60))
        await asyncio.sleep(0)
        assert not waiter.done() and budget.in_use == 60
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        second = asyncio.ensure_future(budget.acquire(50))
        await asyncio.sleep(0)
        assert not second.done()
        budget.release(60)
        await second
        budget.release(50)
        await budget.acquire(500)  # larger than the capacity: admitted alone
        budget.release(500)
        return budget.in_use, budget.peak

    in_use, peak = asyncio.run(main())
    assert in_use == 0 and peak == 500


@pytest.mark.parametrize(
    "pages,page,chunk", [(1, 512, 8 << 20), (256, 2 << 20, 8 << 20), (16, 64 << 10, 1 << 20)]
)
def test_chunk_counts_cover_every_page(pages: int, page: int, chunk: int) -> None:
    counts = chunk_counts(pages, page, chunk)
    assert sum(counts) == pages and all(c >= 1 for c in counts)
    assert all(c * page <= max(chunk, page) for c in counts)


def test_transport_check_warns_for_device_memory_over_tcp() -> None:
    info = (
        "#      resource 1  :  md 1  dev 1  flags -- tcp/lo\n"
        "#      resource 2  :  md 2  dev 0  flags -- posix/memory"
    )
    transports = active_transports(info)
    assert transports == ["tcp/lo", "posix/memory"]
    assert transport_warnings(transports, device_memory=False) == []
    [warning] = transport_warnings(transports, device_memory=True)
    assert "over TCP" in warning
    assert transport_warnings([*transports, "cuda_ipc/cuda"], device_memory=True) == []


# ---- shared host tier and mappings -------------------------------------------------------------
def test_shared_host_tier_is_a_mapped_file(layout: KVLayout, oracle) -> None:  # type: ignore[no-untyped-def]
    config = CacheConfig(layout, (TierConfig.host(8 * layout.page_bytes, shared=True),))
    mgr = CacheManager(config)
    pool = mgr.pools[0]
    path = pool.shm_path  # type: ignore[attr-defined]
    assert path is not None and os.stat(path).st_size == 8 * layout.page_bytes
    tokens = list(range(12))
    with mgr.create(tokens) as cache:
        assert cache.resume()
        cache.extend(tokens)
        oracle.fill_cache(cache)
        cache.commit()
        keys = [cache.block_key(i) for i in range(3)]
        slots = [int(p) for p in cache.page_ids()]
    mapping = ShmMapping(path, 8, layout.page_bytes)
    out = np.empty((3, layout.page_bytes), dtype=np.uint8)
    mapping.copy(slots, out)
    assert all(oracle.check(out[i], keys[i]) for i in range(3))
    with pytest.raises(ValueError):
        mapping.array[0, 0] = 1  # read-only
    with pytest.raises(TransferError):
        mapping.copy([99], out[:1])
    mapping.close()
    mgr.check_invariants()
    mgr.shutdown()
    assert not os.path.exists(path)


def test_mapping_refuses_foreign_or_wrong_size_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    foreign = tmp_path / "secrets.bin"
    foreign.write_bytes(b"\x00" * 1024)
    with pytest.raises(TransferError):
        ShmMapping(str(foreign), 2, 512)
    wrong = tmp_path / "raykv-host-x"
    wrong.write_bytes(b"\x00" * 1000)
    with pytest.raises(TransferError):
        ShmMapping(str(wrong), 2, 512)
    with pytest.raises(TransferError):
        ShmMapping(str(tmp_path / "raykv-host-missing"), 2, 512)


def test_copy_rows_memcpy_and_gather() -> None:
    src = np.arange(40, dtype=np.uint8).reshape(10, 4)
    out = np.empty((3, 4), dtype=np.uint8)
    assert consecutive([4, 5, 6]) and not consecutive([4, 6])
    copy_rows(src, [4, 5, 6], out)
    assert np.array_equal(out, src[4:7])
    copy_rows(src, [9, 0, 3], out)
    assert np.array_equal(out, src[[9, 0, 3]])


def test_a_pull_split_is_checked_and_the_payload_cut_there() -> None:
    """``split`` (two receives posted with the request): only with ``posted``, 0 < split < keys;
    the server's chunks follow it (empty ones left out of the layout); the client splits only
    payloads it may (4 pages or more, between ``early_split_bytes`` and ``chunk_bytes``)."""
    assert server_split({}, 8, True) == 0 and server_split({"split": None}, 8, False) == 0
    assert server_split({"split": 6}, 8, True) == 6
    for msg, posted in [
        ({"split": 6}, False),
        ({"split": 0}, True),
        ({"split": 8}, True),
        ({"split": -1}, True),
        ({"split": True}, True),
        ({"split": "6"}, True),
    ]:
        with pytest.raises(TransferError) as info:
            server_split(msg, 8, posted)
        assert info.value.reason == "protocol"
    assert payload_counts(12, 64, 1 << 20, True, 9) == [9, 3]
    assert payload_counts(7, 64, 1 << 20, True, 6) == [6, 1]
    assert payload_counts(3, 64, 1 << 20, True, 3) == [3] and payload_counts(0, 64, 1 << 20, True, 3) == []
    assert payload_counts(12, 64, 1 << 20, True, 0) == [12]  # posted: whole when it fits
    assert payload_counts(12, 64, 256, True, 0) == chunk_counts(12, 64, 256)
    assert early_split(16, 64 << 10, 512 << 10, 8 << 20) == 12
    assert early_split(16, 64 << 10, 0, 8 << 20) == 0  # never
    assert early_split(3, 1 << 20, 1, 8 << 20) == 0  # under 4 pages
    assert early_split(4, 64 << 10, 512 << 10, 8 << 20) == 0  # under early_split_bytes
    assert early_split(256, 64 << 10, 512 << 10, 8 << 20) == 0  # over chunk_bytes: chunked as usual
    auto = early_split(16, 64 << 10, None, 8 << 20)
    assert auto == (12 if usable_cores() >= AUTO_SPLIT_CORES else 0)


class SlowCancel(asyncio.Future):  # type: ignore[type-arg]
    """A future whose cancellation takes effect a little later (like a pending stream read's)."""

    def cancel(self, msg: object = None) -> bool:
        self.get_loop().call_later(0.05, asyncio.Future.cancel, self)
        return True


def test_cancel_and_wait_keeps_the_callers_cancellation() -> None:
    """Cancelling a task while it waits for a future it cancelled raises in the task (a suppress
    around ``await fut`` would swallow it and the task would run on); the future is done after."""

    async def scenario() -> tuple[bool, bool]:
        slow = SlowCancel()
        ran_on = False

        async def waiter() -> None:
            nonlocal ran_on
            await cancel_and_wait(slow)
            ran_on = True

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        return task.cancelled() and not ran_on, slow.done()

    assert asyncio.run(scenario()) == (True, True)

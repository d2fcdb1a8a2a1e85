"""The page server's guards (raykv.transfer.net.guard): what an unauthenticated peer can leave behind,
the auth deadline, the read and idle timeouts, the connection caps. Every test ends with no
connection, no lease and no file descriptor left over on the server's side."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from metrics_support import Recorder
from transfer_support import (
    Pair,
    authed,
    commit,
    host_pair,
    open_fds,
    raw_connect,
    read_to_end,
    rss_bytes,
    run,
    seq,
    settle,
)

from actors.cache.metrics import WorkerMetrics
from raykv import ContentOracle, KVLayout, TransferError
from raykv.core.errors import ConfigError, TransferFailure
from raykv.transfer import PageClient, TransferConfig
from raykv.transfer.net import wire
from raykv.transfer.net.guard import ConnectionSlots, LogLimiter

Guarded = tuple[Pair, list[bytes], int]
CFG = TransferConfig.loopback(
    timeout_s=10.0,
    connect_timeout_s=5.0,
    auth_timeout_s=0.5,
    read_timeout_s=0.5,
    idle_timeout_s=3.0,
    max_connections_per_peer=4,
    max_connections=6,
    use_shm_read=False,  # every pull goes over a connection
)


@pytest.fixture
def make_guarded(layout: KVLayout, oracle: ContentOracle) -> Iterator[Callable[..., Guarded]]:
    """Factory of started pairs with 4 committed blocks; each comes with this process's fd count
    once one pull has warmed everything process-wide up (the client's connection closed again)."""
    made: list[Pair] = []

    def factory(config: TransferConfig = CFG) -> Guarded:
        pair = host_pair(layout, config)
        made.append(pair)
        keys = commit(pair.src, oracle, seq(1, 4))
        warm = PageClient(pair.token, config)
        assert len(warm.pull_sync(pair.address, keys, prefer_shm=False).keys) == 4  # ucx: set up once
        warm.close()
        settle(pair.server)
        return pair, keys, open_fds()

    yield factory
    for pair in made:
        pair.close()


@pytest.fixture
def guarded(make_guarded: Callable[..., Guarded]) -> Guarded:
    """A pair under ``CFG`` (see ``make_guarded``)."""
    return make_guarded()


def export(metrics: WorkerMetrics, pair: Pair) -> None:
    server = pair.server
    transfer = {"server": server.stats.as_dict(), "open_leases": server.open_leases}
    metrics.update_transfer(transfer | {"open_connections": server.open_connections})


# ---- unauthenticated peers --------------------------------------------------------------------------
def test_preauth_error_reasons_leave_one_counter_and_bounded_memory(
    guarded: Guarded, caplog: pytest.LogCaptureFixture
) -> None:
    """2,000 connections that answer ``hello`` with an ``error`` of their own reason (each one
    new, a few valid enum values among them): the stats keep their keys, the metrics their
    labels, only ``preauth_rejected`` (and ``connections``) grow, the log gets a bounded number of
    lines naming none of the reasons, and memory stays flat."""
    pair, _, fds = guarded
    recorder = Recorder()
    metrics = WorkerMetrics("w", recorder)
    export(metrics, pair)
    before, labels_before = pair.server.stats.as_dict(), set(recorder.values)

    async def probe(i: int) -> None:
        reader, writer = await raw_connect(pair.address)
        try:
            await wire.read_message(reader, 4096)  # hello
            reason = "limit" if i % 97 == 0 else f"evil-{i}-" + "x" * (i % 200)
            writer.write(wire.encode({"t": "error", "reason": reason, "message": f"m{i}" * 50}, 1 << 16))
            await read_to_end(reader)
        finally:
            writer.close()

    async def flood(start: int, count: int) -> None:
        async def worker(first: int) -> None:  # a few at once, no task per probe
            for i in range(first, start + count, CFG.max_connections_per_peer):
                await probe(i)

        await asyncio.gather(*(worker(start + k) for k in range(CFG.max_connections_per_peer)))

    caplog.set_level(logging.DEBUG, logger="raykv.transfer")
    run(flood(0, 200))  # warm up allocator pools, then measure
    rss = rss_bytes()
    started = time.monotonic()
    pair.server.runtime.run(flood(200, 2000), 120)
    elapsed = time.monotonic() - started
    growth = rss_bytes() - rss
    settle(pair.server, fds)
    export(metrics, pair)
    after = pair.server.stats.as_dict()
    assert after.keys() == before.keys()
    changed = {k: (before[k], after[k]) for k in after if after[k] != before[k]}
    assert changed == {
        "preauth_rejected": (0, 2200),
        "connections": (before["connections"], before["connections"] + 2200),
    }
    assert after["errors"] == {}
    # One new series (the counter's first count), no new label value anywhere:
    assert set(recorder.values) - labels_before == {("raykv_transfer_preauth_rejected", (("worker", "w"),))}
    totals = {name: v for (name, _), v in recorder.values.items() if name.startswith("raykv_transfer")}
    assert totals["raykv_transfer_preauth_rejected"] == 2200
    assert totals.get("raykv_transfer_refused_connections", 0) == 0
    lines = [r for r in caplog.records if r.name.startswith("raykv.transfer")]
    assert len(lines) <= 12 and not any("evil" in r.getMessage() for r in lines)
    assert growth < 4 << 20, f"RSS grew by {growth / 2**20:.1f} MiB"
    print(
        f"2,000 pre-auth probes in {elapsed:.2f} s, RSS growth {growth / 2**20:.2f} MiB,",
        f"{len(lines)} log lines",
    )


def test_silent_or_trickling_peer_is_closed_at_the_auth_deadline(
    guarded: Guarded,
) -> None:
    pair, _, fds = guarded

    async def peer(payload: bytes) -> tuple[list[dict[str, Any]], float]:
        reader, writer = await raw_connect(pair.address)
        start = time.monotonic()
        try:
            hello = await wire.read_message(reader, 4096)
            assert hello["t"] == "hello"
            writer.write(payload)
            return await read_to_end(reader, 3.0), time.monotonic() - start
        finally:
            writer.close()

    # Silent, and a frame that never completes (longer than the auth deadline, not the read one):
    for payload in (b"", (100).to_bytes(4, "big") + b"\x81"):
        msgs, elapsed = run(peer(payload))  # type: ignore[misc]
        assert [m["reason"] for m in msgs] == ["timeout"] and "evil" not in str(msgs)
        assert CFG.auth_timeout_s * 0.8 <= elapsed < CFG.auth_timeout_s + 1.0
    stats = pair.server.stats
    assert stats.preauth_rejected == 2 and stats.errors == {}
    settle(pair.server, fds)


# ---- authenticated peers ----------------------------------------------------------------------------
def test_half_a_frame_after_auth_is_closed_at_the_read_timeout(
    guarded: Guarded,
) -> None:
    pair, _, fds = guarded

    async def scenario() -> tuple[list[dict[str, Any]], float]:
        conn = await authed(pair.address, pair.token, CFG)
        try:
            conn.writer.write((200).to_bytes(4, "big") + msgpack.packb({"t": "pull"})[:5])
            start = time.monotonic()
            return await read_to_end(conn.reader, 3.0), time.monotonic() - start
        finally:
            conn.close()

    msgs, elapsed = run(scenario())  # type: ignore[misc]
    assert [m["reason"] for m in msgs] == ["timeout"]
    assert CFG.read_timeout_s * 0.8 <= elapsed < min(CFG.idle_timeout_s, CFG.read_timeout_s + 1.0)
    assert pair.server.stats.errors == {"timeout": 1} and pair.server.stats.preauth_rejected == 0
    settle(pair.server, fds)


def test_idle_connection_is_closed_and_clients_retire_theirs_first(
    make_guarded: Callable[..., Guarded],
) -> None:
    config = CFG.replace(idle_timeout_s=0.6)
    pair, keys, fds = make_guarded(config)

    async def idle() -> tuple[list[dict[str, Any]], float]:
        conn = await authed(pair.address, pair.token, config)
        start = time.monotonic()
        try:
            return await read_to_end(conn.reader, 3.0), time.monotonic() - start
        finally:
            conn.close()

    msgs, elapsed = run(idle())  # type: ignore[misc]
    assert msgs == [] and 0.6 * 0.8 <= elapsed < 1.6  # closed without a word
    assert pair.server.stats.idle_closed == 1 and pair.server.stats.errors == {}
    # A client retires a connection idle for over half the server's timeout before it is closed.
    client = PageClient(pair.token, config)
    try:
        client.pull_sync(pair.address, keys)
        time.sleep(0.4)  # over half of 0.6 s: the next pull opens a new connection
        client.pull_sync(pair.address, keys)
        client.pull_sync(pair.address, keys)  # fresh: reused
    finally:
        client.close()
    assert pair.server.stats.connections == 1 + 1 + 2  # warm-up, idle probe, two by the client
    assert client.stats.failures == {}
    settle(pair.server, fds)


# ---- caps -------------------------------------------------------------------------------------------
def test_connections_over_a_cap_are_refused_busy_and_the_others_keep_working(
    guarded: Guarded, oracle: ContentOracle
) -> None:
    pair, keys, fds = guarded
    per_peer = CFG.max_connections_per_peer
    clients = [PageClient(pair.token, CFG) for _ in range(per_peer + 1)]
    try:
        for client in clients[:per_peer]:  # each keeps its connection open (idle, pooled)
            assert len(client.pull_sync(pair.address, keys).keys) == 4
        assert pair.server.connections_by_peer == {"127.0.0.1": per_peer}
        with pytest.raises(TransferError) as info:
            clients[-1].pull_sync(pair.address, keys)
        assert info.value.reason == TransferFailure.BUSY
        assert pair.server.stats.connections_refused == 1
        for client in clients[:per_peer]:  # the first N keep working, on their connections
            pulled = client.pull_sync(pair.address, keys)
            assert all(oracle.check(row, key) for row, key in zip(pulled.data, pulled.keys))
        assert pair.server.stats.connections == 1 + per_peer

        async def total_cap() -> list[Any]:
            # Another host (127.0.0.2) still gets in up to the total cap (6), then is refused too.
            first = [await raw_connect(pair.address, "127.0.0.2") for _ in range(2)]
            hellos = [await wire.read_message(r, 4096) for r, _ in first]
            reader, writer = await raw_connect(pair.address, "127.0.0.2")
            refused = await read_to_end(reader)
            writer.close()
            for _, w in first:
                w.close()
            return [m["t"] for m in hellos] + [(m["t"], m["reason"]) for m in refused]

        assert run(total_cap()) == ["hello", "hello", ("error", "busy")]
        assert pair.server.stats.connections_refused == 2
    finally:
        for client in clients:
            client.close()
    settle(pair.server, fds)


# ---- pure parts -------------------------------------------------------------------------------------
def test_slots_and_log_limiter() -> None:
    slots = ConnectionSlots(2, 3)
    assert slots.admit("a") and slots.admit("a") and not slots.admit("a")
    assert slots.admit("b") and not slots.admit("c") and slots.by_host() == {"a": 2, "b": 1}
    for host in ("a", "a", "b"):
        slots.release(host)
    assert slots.total == 0 and slots.by_host() == {}
    now = [0.0]
    logger = logging.getLogger("raykv.test.limiter")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        limiter = LogLimiter(logger, burst=3, interval_s=10.0, clock=lambda: now[0])
        assert [limiter.log(logging.INFO, "line %d", i) for i in range(5)] == [True] * 3 + [False] * 2
        now[0] = 10.0
        assert limiter.log(logging.INFO, "next")
    finally:
        logger.removeHandler(handler)
    assert records == ["line 0", "line 1", "line 2", "(2 similar lines dropped in 10 s)", "next"]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"auth_timeout_s": 0}, "auth_timeout_s"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s"),
        ({"idle_timeout_s": "5"}, "idle_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_connections_per_peer": True}, "max_connections_per_peer"),
        ({"max_connections_per_peer": 10, "max_connections": 5}, "max_connections_per_peer"),
    ],
)
def test_guard_settings_are_validated(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig(**change)
    assert info.value.field == field

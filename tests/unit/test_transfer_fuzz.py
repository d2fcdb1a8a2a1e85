"""A live page server under a seeded random frame fuzzer for a bounded time: valid and invalid
frames, before and after authentication, truncated frames, oversized length prefixes, garbage,
peers that stall or vanish. The server must not crash or log an internal error, must keep
serving a good client afterwards, and must end with every connection and lease closed, no file
descriptor left over and RSS growth under 20 MiB."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from typing import Any

import msgpack
from transfer_support import Pair, authed, commit, host_pair, open_fds, raw_connect, rss_bytes, seq, settle

from raykv import ContentOracle, KVLayout, TransferError
from raykv.core.errors import TransferFailure
from raykv.transfer import PageClient, TransferConfig

FUZZ_SECONDS = float(os.environ.get("RAYKV_FUZZ_SECONDS", "8"))
"""How long the fuzzer runs (bounded: at most 20 s)."""
SEED = int(os.environ.get("RAYKV_FUZZ_SEED", "20240611"))
PEERS = 8  # concurrent fuzzing peers: more than the per-peer cap, so some are refused "busy"
CFG = TransferConfig.loopback(
    timeout_s=2.0,
    connect_timeout_s=2.0,
    auth_timeout_s=0.3,
    read_timeout_s=0.3,
    idle_timeout_s=0.5,
    max_connections_per_peer=6,
    max_connections=64,
    max_keys=16,
    use_shm_read=False,
)
TYPES = ("hello", "auth", "welcome", "pull", "header", "sums", "done", "ack", "error", "gpu_pool", "")


class Fuzzer:
    """Random frames for one seeded stream (``keys``: blocks the server holds; ``node``: its id)."""

    def __init__(self, seed: int, keys: list[bytes], node: str) -> None:
        self.rng = random.Random(seed)
        self.keys = keys
        self.node = node

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        pick = r.randrange(9 if depth < 2 else 6)
        if pick == 0:
            return r.choice([0, -1, 1, 1 << 62, -(1 << 63), (1 << 64) - 1, r.randrange(-1000, 1000)])
        if pick == 1:
            return r.choice([True, False, None, 1.5, float("nan")])
        if pick == 2:
            return r.choice([*TYPES, *(f.value for f in TransferFailure), "x" * r.randrange(300), "\u2603"])
        if pick == 3:
            return r.randbytes(r.choice([0, 1, 31, 32, 33, r.randrange(200)]))
        if pick in (4, 5):
            return r.choice(self.keys)
        if pick == 6:
            return [self.value(depth + 1) for _ in range(r.randrange(5))]
        if pick == 7:
            return {str(self.value(depth + 1))[:20]: self.value(depth + 1) for _ in range(r.randrange(4))}
        return {self.rng.randrange(10): 1}  # a map with a non-string key

    def pull(self) -> dict[str, Any]:
        r = self.rng
        count = r.choice([0, 1, 3, len(self.keys), CFG.max_keys + 1])
        keys = [r.choice(self.keys) if r.random() < 0.8 else r.randbytes(32) for _ in range(count)]
        msg: dict[str, Any] = {
            "t": "pull",
            "id": r.randrange(1 << 20),
            "keys": keys,
            "path": r.choice(["shm", "ucx", "direct", "gpu_peer", "nope"]),
            "tag": r.choice([0, 1 << 12, (1 << 62) + 1, -5]),
            "sums": r.choice([True, False, None]),
            "ack": r.choice([True, False, None]),
            "posted": r.choice([False, None, True]),
        }
        if r.random() < 0.2:
            msg["split"] = self.value()
        for name in r.sample(sorted(msg), r.randrange(3)):  # now and then a field spoiled or gone
            if r.random() < 0.5:
                del msg[name]
            else:
                msg[name] = self.value()
        msg.setdefault("t", "pull")
        return msg

    def message(self) -> Any:
        r = self.rng
        pick = r.randrange(6)
        if pick <= 1:
            return self.pull()
        if pick == 2:
            return {"t": "done", "id": r.randrange(1 << 20)}
        if pick == 3:
            return {"t": "error", "reason": self.value(), "message": self.value()}
        if pick == 4:
            return {"t": r.choice(TYPES), **{f"f{i}": self.value() for i in range(r.randrange(4))}}
        return self.value()  # maybe not a map at all

    def frame(self) -> bytes:
        """One frame, framed right or wrong."""
        r = self.rng
        try:
            body = msgpack.packb(self.message(), use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            body = b"\xc1"
        pick = r.randrange(10)
        if pick == 0:  # oversized length prefix
            return r.randrange(CFG.max_header_bytes + 1, 1 << 32).to_bytes(4, "big") + body[:50]
        if pick == 1:  # truncated: the prefix promises more than follows
            return len(body).to_bytes(4, "big") + body[: r.randrange(max(1, len(body)))]
        if pick == 2:  # garbage
            return r.randbytes(r.randrange(1, 64))
        if pick == 3:  # a bare length prefix, or part of one
            return (0).to_bytes(4, "big")[: r.randrange(1, 5)]
        return len(body).to_bytes(4, "big") + body

    async def drain(self, reader: asyncio.StreamReader, seconds: float) -> None:
        """Read whatever the server sends for up to ``seconds`` (or until it closes)."""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(seconds):
                while await reader.read(1 << 16):
                    pass

    async def session(self, pair: Pair) -> None:
        """One connection: stray bytes before or after an honest handshake, then it goes."""
        r = self.rng
        if r.random() < 0.5:
            conn = await authed(pair.address, pair.token, CFG, r.choice([self.node, "far"]))
            reader, writer = conn.reader, conn.writer
        else:
            reader, writer = await raw_connect(pair.address)
        try:
            for _ in range(r.randrange(1, 5)):
                if r.random() < 0.1:
                    break  # vanish mid-conversation
                writer.write(self.frame())
                await writer.drain()
                await self.drain(reader, r.choice([0.0, 0.01, 0.05]))
            await self.drain(reader, r.choice([0.0, 0.1, 0.4]))
        finally:
            if r.random() < 0.3:
                writer.transport.abort()  # a reset instead of a close
            else:
                writer.close()


async def fuzz(pair: Pair, keys: list[bytes], seconds: float) -> int:
    """Run ``PEERS`` fuzzing peers for ``seconds``; returns how many connections they made."""
    stop = time.monotonic() + seconds
    made = 0

    async def peer(k: int) -> None:
        nonlocal made
        fuzzer = Fuzzer(SEED + k, keys, pair.server.node_id)
        while time.monotonic() < stop:
            made += 1
            with contextlib.suppress(TransferError, ConnectionError, TimeoutError, OSError):
                async with asyncio.timeout(3):
                    await fuzzer.session(pair)
            await asyncio.sleep(0.005)  # a peer refused "busy" comes back, but not in a busy loop

    await asyncio.gather(*(peer(k) for k in range(PEERS)))
    return made


def test_server_survives_a_random_frame_fuzzer(layout: KVLayout, oracle: ContentOracle, caplog: Any) -> None:
    assert FUZZ_SECONDS <= 20
    pair = host_pair(layout, CFG)
    try:
        keys = commit(pair.src, oracle, seq(3, 6))
        good = PageClient(pair.token, CFG)
        # Warm up (over ucx: ucxx sets up its CUDA context once, some MiB), then measure.
        assert len(good.pull_sync(pair.address, keys, prefer_shm=False).keys) == 6
        good.close()
        settle(pair.server)
        fds, rss = open_fds(), rss_bytes()
        caplog.set_level(logging.INFO)
        made = pair.server.runtime.run(fuzz(pair, keys, FUZZ_SECONDS), FUZZ_SECONDS + 30)
        settle(pair.server, fds, timeout_s=CFG.timeout_s + 3)
        growth = rss_bytes() - rss
        stats = pair.server.stats
        good = PageClient(pair.token, CFG)
        try:
            pulled = good.pull_sync(pair.address, keys)
        finally:
            good.close()
        assert list(pulled.keys) == keys and all(oracle.check(r, k) for r, k in zip(pulled.data, keys))
        settle(pair.server, fds)
        assert set(stats.errors) <= {f.value for f in TransferFailure} and not stats.errors["internal"]
        assert set(stats.pulls) <= set(pair.server.paths)
        assert stats.connections + stats.connections_refused >= made * 0.9  # a few never got in
        assert stats.preauth_rejected > 0 and stats.connections > 200 and stats.connections_refused > 0
        bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not bad, [r.getMessage() for r in bad[:3]]
        assert growth < 20 << 20, f"RSS grew by {growth / 2**20:.1f} MiB"
        pair.src.check_invariants()
        print(
            f"fuzz: {made} connections in {FUZZ_SECONDS:g} s, {stats.connections} admitted,",
            f"{stats.connections_refused} busy, {stats.preauth_rejected} pre-auth rejected,",
            f"{stats.idle_closed} idle, errors {dict(stats.errors)}, pulls {dict(stats.pulls)},",
            f"RSS growth {growth / 2**20:.2f} MiB",
        )
    finally:
        pair.close()

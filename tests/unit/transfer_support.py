"""Helpers shared by the page-transfer unit tests (requests with oracle KV, token sequences)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig, TransferError
from raykv.transfer import AuthToken, PageClient, PageServer, PeerAddress, TransferConfig, get_runtime
from raykv.transfer.net import wire
from raykv.transfer.net.connection import ClientConn, handshake


def commit(mgr: CacheManager, oracle: ContentOracle, tokens: list[int]) -> list[bytes]:
    """Run one request with oracle KV and commit it; returns its block keys."""
    with mgr.create(tokens) as cache:
        assert cache.resume()
        cache.extend(tokens[cache.num_reused_tokens :])
        oracle.fill_cache(cache, cache.num_reused_tokens // mgr.tokens_per_block)
        cache.commit()
        return [bytes(cache.block_key(i)) for i in range(len(tokens) // mgr.tokens_per_block)]


def seq(seed: int, blocks: int, tpb: int = 4) -> list[int]:
    """``blocks`` blocks of distinct tokens (``seed`` picks the sequence)."""
    return [seed * 10_000 + i for i in range(blocks * tpb)]


def run(coro: object) -> object:
    """Run a transfer coroutine on the transfer runtime's loop (30 s limit)."""
    return get_runtime().run(coro, 30)  # type: ignore[arg-type]


@dataclass
class Pair:
    """A serving manager ``src`` with its page server, and a pulling manager ``dst`` with a client."""

    src: CacheManager
    dst: CacheManager
    server: PageServer
    client: PageClient
    token: AuthToken

    @property
    def address(self) -> PeerAddress:
        assert self.server.address is not None
        return self.server.address

    def settled(self) -> None:
        """No lease left on the source, nothing staged on the destination, invariants hold."""
        deadline = time.monotonic() + 5
        while self.src.store.leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.open_leases == 0 and not self.src.store.leases and not self.dst.store.leases
        self.src.check_invariants()
        self.dst.check_invariants()

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.src.shutdown()
        self.dst.shutdown()


def host_pair(
    layout: KVLayout, config: TransferConfig, src_pages: int = 32, disk_pages: int = 0, dst_pages: int = 64
) -> Pair:
    """A started pair: ``src`` with a shared host tier (and a disk tier when ``disk_pages``),
    ``dst`` with a plain host tier."""
    token = AuthToken.generate()
    tiers = [TierConfig.host(src_pages * layout.page_bytes, pin_memory=False, shared=True)]
    if disk_pages:
        tiers.append(TierConfig.disk(disk_pages * layout.page_bytes))
    src = CacheManager(CacheConfig(layout, tuple(tiers)))
    dst = CacheManager(
        CacheConfig(layout, (TierConfig.host(dst_pages * layout.page_bytes, pin_memory=False),))
    )
    server = PageServer(src, token, config)
    server.start()
    return Pair(src, dst, server, PageClient(token, config), token)


# ---- page-server guard tests: raw peers, fds, RSS ---------------------------------------------------
def open_fds() -> int:
    """File descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle(server: PageServer, fds: int | None = None, timeout_s: float = 5.0) -> None:
    """Wait until the server holds no connection and no lease, and (when given) this process is
    back to ``fds`` file descriptors; assert it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (server.open_connections or server.open_leases) and (fds is None or open_fds() <= fds):
            break
        time.sleep(0.02)
    assert server.open_connections == 0 and server.connections_by_peer == {}
    assert server.open_leases == 0
    if fds is not None:
        assert open_fds() <= fds, (open_fds(), fds)


async def raw_connect(
    address: PeerAddress, source: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to a page server (from ``source``'s address when given)."""
    local = (source, 0) if source is not None else None
    return await asyncio.open_connection(address.host, address.port, local_addr=local)


async def authed(
    address: PeerAddress, token: AuthToken, config: TransferConfig, node: str = "raw-peer"
) -> ClientConn:
    """A raw authenticated connection (no UCX) to a page server, from node ``node``."""
    reader, writer = await raw_connect(address)
    return await handshake(token, config, node, None, address.endpoint, reader, writer)


async def read_to_end(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Every control message the server sends until it closes the stream (TimeoutError if it
    does not within ``timeout_s``)."""
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                out.append(await wire.read_message(reader, 1 << 20))
            except TransferError as exc:
                if exc.reason == "closed":
                    return out
                raise

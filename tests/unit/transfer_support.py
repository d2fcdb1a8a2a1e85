"""Helpers shared by the page-transfer unit tests (requests with oracle KV, token sequences)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig
from raykv.transfer import AuthToken, PageClient, PageServer, PeerAddress, TransferConfig, get_runtime


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

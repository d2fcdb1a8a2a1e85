"""Helpers shared by the page-transfer unit tests (requests with oracle KV, token sequences)."""

from __future__ import annotations

from raykv import CacheManager, ContentOracle
from raykv.transfer import get_runtime


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

"""Content oracle: deterministic KV bytes per (block key, layer, role, position).

The oracle names every byte of a page by the key of the block it belongs to, so after any tier
move, export, transfer or import, ``verify`` proves the bytes are the ones written for that block.
Row ``p`` (token position in the block) of buffer ``(layer, role)`` holds
``(h0 + p * h1 + j * h2) mod 256`` for byte ``j``, where ``h0, h1, h2`` come from
``SHA-256(key || layer || role)``; a partial block is filled for its first ``num_tokens`` rows only.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from raykv.core.config import KVLayout

if TYPE_CHECKING:
    from raykv.core.kvcache import KvCache
    from raykv.core.manager import CacheManager


class ContentOracle:
    """Fills and verifies pages of one layout."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def expected(self, key: bytes, num_tokens: int | None = None) -> npt.NDArray[np.uint8]:
        """The page bytes the oracle writes for ``key`` (rows past ``num_tokens`` are zero)."""
        tpb = self.layout.tokens_per_block
        n = tpb if num_tokens is None else num_tokens
        page = np.zeros(self.layout.page_bytes, dtype=np.uint8)
        for region in self.layout.regions():
            tag = f"{region.layer_id}/{region.spec.role}".encode()
            h = hashlib.sha256(bytes(key) + tag).digest()
            h0, h1, h2 = h[0], h[1] | 1, h[2] | 1
            per_tok = region.spec.bytes_per_token
            rows = np.arange(n, dtype=np.uint32)[:, None] * h1
            cols = np.arange(per_tok, dtype=np.uint32)[None, :] * h2
            vals = ((h0 + rows + cols) & 0xFF).astype(np.uint8)
            page[region.offset : region.offset + n * per_tok] = vals.reshape(-1)
        return page

    def fill(self, page: Any, key: bytes, num_tokens: int | None = None) -> None:
        """Write the expected bytes into a page view (numpy uint8 or torch uint8)."""
        data = self.expected(key, num_tokens)
        if isinstance(page, np.ndarray):
            page[:] = data
        else:  # torch tensor on any device
            import torch

            page.copy_(torch.from_numpy(data))

    def check(self, data: Any, key: bytes, num_tokens: int | None = None) -> bool:
        """True when ``data`` (bytes, numpy or torch) holds exactly the expected bytes."""
        if not isinstance(data, (bytes, bytearray, np.ndarray)):
            data = data.cpu().numpy()
        got = np.frombuffer(bytes(data), dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data
        return bool(np.array_equal(got.reshape(-1), self.expected(key, num_tokens)))

    def fill_cache(self, cache: KvCache, first_block: int = 0) -> None:
        """Write KV for blocks ``first_block ..`` of an active cache, as an engine would."""
        for i in range(first_block, cache.num_blocks):
            self.fill(cache.page(i), cache.block_key(i), cache.block_num_tokens(i))

    def verify_cache(self, cache: KvCache) -> None:
        """Raise AssertionError unless every page of an active cache holds its expected bytes."""
        for i in range(cache.num_blocks):
            if not self.check(cache.page(i), cache.block_key(i), cache.block_num_tokens(i)):
                raise AssertionError(f"{cache!r}: block {i} holds the wrong bytes")

    def verify_manager(self, manager: CacheManager) -> int:
        """Export every committed block of ``manager`` (from whatever tier it is on) and verify
        it. Returns how many blocks were verified (a disk page that fails its checksum is
        dropped by the export, not verified); raises AssertionError on the first bad one."""
        keys = [info.key for info in manager.committed_blocks()]
        exported = manager.export_blocks(keys)
        for block in exported:
            if not self.check(block.data, block.key):
                raise AssertionError(f"block {block.key.hex()[:16]} holds the wrong bytes")
        return len(exported)

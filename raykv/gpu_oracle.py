"""Device-side content oracle: the bytes of :class:`raykv.testing.ContentOracle`, made on the GPU.

Same definition, byte for byte: row ``p`` of buffer ``(layer, role)`` of the page of block ``key``
holds ``(h0 + p * h1 + j * h2) mod 256`` for byte ``j``, with ``h0, h1, h2`` from
``SHA-256(key || layer || role)``; rows past the block's token count, and padding, are zero.
Only the three hash bytes per (block, buffer) travel to the device; pages are generated, written
and compared there, and a check brings back one boolean per page.

A *target* is a GPU pool (:class:`~raykv.core.tiers.gpu.GpuPool`), an engine-side attachment
(:class:`~raykv.ipc.AttachedPool`) or a bare uint8 ``[num_slots, page_bytes]`` device tensor.
Work runs on the current stream, after the pool's pending copies of those slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from raykv.core.config import KVLayout

CHUNK_BYTES = 64 << 20
"""Upper bound on the int32 scratch of one batch (pages are generated in batches)."""


class DeviceOracle:
    """Fills and checks pages of one layout on a CUDA device."""

    def __init__(self, layout: KVLayout, device: Any = None) -> None:
        import torch

        self._torch = torch
        self.layout = layout
        self.device = torch.device("cuda") if device is None else torch.device(device)
        self._regions = layout.regions()
        self._tags = [f"{r.layer_id}/{r.spec.role}".encode() for r in self._regions]
        tpb = layout.tokens_per_block
        self._rows = torch.arange(tpb, dtype=torch.int32, device=self.device)
        widest = max(r.spec.bytes_per_token for r in self._regions)
        self._cols = torch.arange(widest, dtype=torch.int32, device=self.device)
        per_page = 4 * layout.page_bytes
        self.batch = max(1, CHUNK_BYTES // per_page)

    def _hashes(self, keys: Sequence[bytes]) -> Any:
        """[B, regions, 3] int32 on the device: (h0, h1 | 1, h2 | 1) per block and buffer."""
        table = np.empty((len(keys), len(self._tags), 3), dtype=np.int32)
        for b, key in enumerate(keys):
            for r, tag in enumerate(self._tags):
                h = hashlib.sha256(bytes(key) + tag).digest()
                table[b, r] = (h[0], h[1] | 1, h[2] | 1)
        return self._torch.from_numpy(table).to(self.device, non_blocking=False)

    def expected(self, keys: Sequence[bytes], num_tokens: Sequence[int] | None = None) -> Any:
        """uint8 ``[len(keys), page_bytes]`` on the device: the oracle's page of each key."""
        torch = self._torch
        count = len(keys)
        tpb = self.layout.tokens_per_block
        out = torch.zeros((count, self.layout.page_bytes), dtype=torch.uint8, device=self.device)
        if count == 0:
            return out
        h = self._hashes(keys)
        ntok = [tpb] * count if num_tokens is None else list(num_tokens)
        live = self._rows[None, :] < torch.tensor(ntok, dtype=torch.int32, device=self.device)[:, None]
        for r, region in enumerate(self._regions):
            per_tok = region.spec.bytes_per_token
            h0, h1, h2 = (h[:, r, i].reshape(count, 1, 1) for i in range(3))
            vals = h0 + self._rows.view(1, tpb, 1) * h1 + self._cols[:per_tok].view(1, 1, per_tok) * h2
            vals = (vals & 0xFF) * live[:, :, None]
            out[:, region.offset : region.offset + tpb * per_tok] = vals.to(torch.uint8).view(count, -1)
        return out

    def _target(self, target: Any, slots: Sequence[int]) -> Any:
        if hasattr(target, "wait_ready"):
            target.wait_ready(list(slots))
        return target.tensor if hasattr(target, "tensor") else target

    def fill(
        self,
        target: Any,
        slots: Sequence[int],
        keys: Sequence[bytes],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        """Write the oracle's page of ``keys[i]`` into page ``slots[i]`` of ``target``."""
        torch = self._torch
        tensor = self._target(target, slots)
        for lo in range(0, len(slots), self.batch):
            hi = lo + self.batch
            idx = torch.as_tensor(list(slots[lo:hi]), dtype=torch.long, device=self.device)
            ntok = None if num_tokens is None else num_tokens[lo:hi]
            tensor.index_copy_(0, idx, self.expected(keys[lo:hi], ntok))

    def check(
        self,
        target: Any,
        slots: Sequence[int],
        keys: Sequence[bytes],
        num_tokens: Sequence[int] | None = None,
    ) -> list[bool]:
        """Per page: does page ``slots[i]`` of ``target`` hold exactly the oracle's bytes?"""
        torch = self._torch
        tensor = self._target(target, slots)
        flags = []
        for lo in range(0, len(slots), self.batch):
            hi = lo + self.batch
            idx = torch.as_tensor(list(slots[lo:hi]), dtype=torch.long, device=self.device)
            ntok = None if num_tokens is None else num_tokens[lo:hi]
            got = tensor.index_select(0, idx)
            flags.append((got == self.expected(keys[lo:hi], ntok)).all(dim=1))
        if not flags:
            return []
        return [bool(x) for x in torch.cat(flags).tolist()]

    def fill_cache(self, pool: Any, cache: Any, first_block: int = 0) -> None:
        """Write KV for blocks ``first_block ..`` of an active cache whose top tier is ``pool``."""
        blocks = range(first_block, cache.num_blocks)
        slots = cache.page_ids()[first_block:]
        self.fill(
            pool, slots, [cache.block_key(i) for i in blocks], [cache.block_num_tokens(i) for i in blocks]
        )

    def verify_cache(self, pool: Any, cache: Any) -> None:
        """AssertionError unless every page of an active cache holds its expected bytes."""
        blocks = range(cache.num_blocks)
        keys = [cache.block_key(i) for i in blocks]
        flags = self.check(pool, cache.page_ids(), keys, [cache.block_num_tokens(i) for i in blocks])
        bad = [i for i, ok in enumerate(flags) if not ok]
        if bad:
            raise AssertionError(f"{cache!r}: blocks {bad} hold the wrong bytes")

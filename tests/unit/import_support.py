"""Helpers shared by the import tests: token runs and a committed chain exported as rows."""

from __future__ import annotations

import numpy as np

from raykv import block_keys
from raykv.core.records import BlockRecords

TPB = 4  # tokens per block of the conftest layout


def toks(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def chain(mgr, run_request, tokens):
    """Commit ``tokens`` in ``mgr``; returns (records, rows [n, page_bytes], checksums)."""
    run_request(mgr, tokens)
    blocks = mgr.export_blocks(block_keys(tokens, TPB))
    data = np.stack([np.frombuffer(b.data, dtype=np.uint8) for b in blocks])
    return BlockRecords.of(blocks), data, [b.checksum for b in blocks]

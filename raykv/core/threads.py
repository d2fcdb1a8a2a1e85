"""The copy threads: row-wise work (copies, checksums) of several MiB split over a few threads.

One memcpy thread moves a fraction of what the memory can (two copies in parallel move about
twice what one does: docs/benchmarks.md, "Transfers: same node, host pages"), and numpy copies
and zlib/ISA-L checksums release the GIL, so large row ranges are cut into pieces of at least
:data:`PIECE_BYTES`, one per thread. :func:`run_rows` is for a caller that may block;
``raykv.transfer.net.runtime.map_rows`` is its event-loop twin over the same threads.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PIECE_BYTES = 4 << 20
"""Row-wise work of at least twice this many bytes is split over the copy threads."""
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def copy_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy threads (2 to 8, by core count; started on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            workers = max(2, min(8, os.cpu_count() or 2))
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="raykv-copy")
        return _pool


def pieces(total: int, count: int) -> list[tuple[int, int]]:
    """Row ranges covering ``count`` rows of ``total`` bytes in all: one per copy thread, at least
    :data:`PIECE_BYTES` each (one range when smaller)."""
    n = max(1, min(copy_threads()._max_workers, total // PIECE_BYTES, count))
    return list(itertools.pairwise(count * i // n for i in range(n + 1)))


def run_rows(row_bytes: int, count: int, fn: Callable[[int, int], list[T]]) -> list[T]:
    """``fn(first, last)`` over rows ``0 .. count``, results concatenated in row order: this
    thread runs the first piece, the copy threads the others (:func:`pieces`); returns once every
    piece ended (the first error raises then). Jobs under two pieces run here alone. ``fn`` must
    only touch its own rows."""
    total = row_bytes * count
    if total < 2 * PIECE_BYTES:
        return fn(0, count)
    pool = copy_threads()
    first, *rest = pieces(total, count)
    others = [pool.submit(fn, a, b) for a, b in rest]
    try:
        head = fn(*first)
    finally:
        concurrent.futures.wait(others)  # no piece may still write when we return
    return [*head, *(x for f in others for x in f.result())]

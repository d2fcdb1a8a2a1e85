"""The copy threads (raykv/core/threads.py) and the host tier's copies in pieces over them."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from raykv.core import threads
from raykv.core.config import KVLayout, TierConfig
from raykv.core.tiers.host import HostPool
from raykv.core.types import PageId


def test_run_rows_covers_every_row_once_and_waits_for_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "PIECE_BYTES", 1)
    seen: list[tuple[int, int, str]] = []
    me = threading.current_thread().name

    def piece(a: int, b: int) -> list[int]:
        seen.append((a, b, threading.current_thread().name))
        return list(range(a, b))

    assert threads.run_rows(1, 1, piece) == [0]  # under two pieces: this thread alone
    assert seen == [(0, 1, me)]
    seen.clear()
    assert threads.run_rows(1, 101, piece) == list(range(101))
    bounds = sorted((a, b) for a, b, _ in seen)
    assert len(bounds) >= 2 and all(x[1] == y[0] for x, y in itertools.pairwise(bounds))
    assert bounds[0][0] == 0 and bounds[-1][1] == 101
    assert [t for a, _, t in seen if a == 0] == [me]
    assert any(t.startswith("raykv-copy") for *_, t in seen)
    done = threading.Event()

    def slow_then_fail(a: int, b: int) -> list[int]:
        if a == 0:
            raise RuntimeError("first piece")
        time.sleep(0.05)
        done.set()
        return []

    with pytest.raises(RuntimeError, match="first piece"):
        threads.run_rows(1, 100, slow_then_fail)
    assert done.is_set()  # the other pieces ended before the error came back


@pytest.mark.parametrize("piece_bytes", [threads.PIECE_BYTES, 1])  # whole, and in pieces
def test_host_pages_written_and_read_in_pieces_land_in_their_slots(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch, piece_bytes: int
) -> None:
    monkeypatch.setattr(threads, "PIECE_BYTES", piece_bytes)
    pool = HostPool(TierConfig.host(40 * layout.page_bytes, pin_memory=False), layout)
    try:
        rng = np.random.default_rng(7)
        for slots in ([3, 4, 5, 6, 7, 8, 9], [30, 2, 17, 5, 11, 38, 0, 21], list(range(40))):
            ids = [PageId(s) for s in slots]
            data = rng.integers(0, 256, (len(slots), layout.page_bytes), dtype=np.uint8)
            pool.write_pages(ids, data)
            assert np.array_equal(pool.array[slots], data)
            out = np.zeros_like(data)
            pool.read_pages(ids, out)
            assert np.array_equal(out, data)
    finally:
        pool.close()

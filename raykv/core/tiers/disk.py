"""Disk tier: page-aligned slots in one preallocated file.

The file lives in ``TierConfig.path`` (or a fresh temporary directory, removed on close). Slot ``i``
starts at byte ``i * stride`` where ``stride`` is the page size rounded up to 4096, so every page is
O_DIRECT-friendly. Reads and writes of runs of consecutive slots are one ``preadv``/``pwritev``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from raykv.core.config import DISK_ALIGN, KVLayout, TierConfig
from raykv.core.errors import OutOfMemoryError, StateError
from raykv.core.tiers.base import PagePool
from raykv.core.types import PageId, TierKind

_MAX_IOV = 512


def _runs(slots: list[PageId]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into (first index in list, first slot, length) runs of consecutive slots.

    Runs are capped at 512 pages so one vectored call stays under the system's IOV_MAX.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - start >= _MAX_IOV:
            runs.append((start, int(slots[start]), i - start))
            start = i
    return runs


class DiskPool(PagePool):
    """Pages in a preallocated file; the file (and a temporary directory) is removed on close."""

    kind = TierKind.DISK

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.stride = (self.page_bytes + DISK_ALIGN - 1) // DISK_ALIGN * DISK_ALIGN
        self._own_dir = config.path is None
        self.directory: str = tempfile.mkdtemp(prefix="raykv-disk-") if config.path is None else config.path
        fd, self.path = tempfile.mkstemp(prefix="pages-", suffix=".bin", dir=self.directory)
        self._fd = fd
        try:
            size = self.num_slots * self.stride
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover - non-Linux
                os.ftruncate(fd, size)
        except OSError as exc:
            self._cleanup()
            raise OutOfMemoryError(f"disk tier: cannot reserve {size} bytes: {exc}") from None

    def read_pages(self, slots: list[PageId], out: npt.NDArray[np.uint8]) -> None:
        self.read_rows(slots, [out[i] for i in range(len(slots))])

    def write_pages(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> None:
        self.write_rows(slots, [data[i] for i in range(len(slots))])

    def read_rows(self, slots: list[PageId], rows: Sequence[npt.NDArray[np.uint8]]) -> None:
        """Read pages ``slots`` straight into ``rows`` (writable contiguous page-sized arrays)."""
        self._io(slots, rows, write=False)

    def write_rows(self, slots: list[PageId], rows: Sequence[npt.NDArray[np.uint8]]) -> None:
        """Write ``rows`` (contiguous page-sized arrays, e.g. host tier rows) to pages ``slots``."""
        self._io(slots, rows, write=True)

    def _io(self, slots: list[PageId], rows: Sequence[npt.NDArray[np.uint8]], write: bool) -> None:
        self._check_open()
        call = os.pwritev if write else os.preadv
        page = self.page_bytes
        for first, slot, n in _runs(slots):
            views = [memoryview(rows[first + j]) for j in range(n)]  # type: ignore[arg-type]
            if self.stride == page:
                self._check_len(call(self._fd, views, slot * self.stride), n * page)
            else:
                for j, view in enumerate(views):
                    self._check_len(call(self._fd, [view], (slot + j) * self.stride), page)

    def _check_len(self, got: int, want: int) -> None:
        if got != want:
            raise StateError(f"disk tier: short I/O on {self.path} ({got} of {want} bytes)")

    def _cleanup(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        if not self._closed:
            self._cleanup()
        super().close()

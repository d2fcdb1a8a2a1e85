"""Disk tier: page-aligned slots in one preallocated file.

The file lives in ``TierConfig.path`` (or a fresh temporary directory, removed on close). Slot ``i``
starts at byte ``i * stride`` where ``stride`` is the page size rounded up to 4096, so every page is
O_DIRECT-friendly. Reads and writes of runs of consecutive slots are one ``preadv``/``pwritev``.

Checksums (``verify``, the default): every page written gets a CRC-32
(:data:`raykv.core.records.crc32`: ISA-L's when ``isal`` is installed) kept in memory per slot,
and every page read is checked against it. A page that fails (a different CRC, a short read: the
file was overwritten or truncated under the cache) is marked bad: :meth:`DiskPool.failed` reports
it until its slot is released, and nothing else about the read changes (the caller drops the
page; its bytes were read into the destination but must not be served). The checksums are not
persisted: the file is created fresh for each pool and unlinked on close, and the block tree that
names its pages lives in memory, so no page of a previous process is ever read.
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
from raykv.core.records import crc32
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


def _checksums(rows: Sequence[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint32]:
    return np.fromiter((crc32(row) for row in rows), dtype=np.uint32, count=len(rows))


class DiskPool(PagePool):
    """Pages in a preallocated file; the file (and a temporary directory) is removed on close.

    With ``verify`` every page carries a CRC-32 (see the module docstring): reads never raise for
    a bad page, they mark it, and :meth:`failed` says which pages of a read were bad.
    """

    kind = TierKind.DISK

    def __init__(self, config: TierConfig, layout: KVLayout, verify: bool = True) -> None:
        super().__init__(config, layout)
        self.verify = verify
        self._sums = np.zeros(self.num_slots, dtype=np.uint32)
        self._good = np.zeros(self.num_slots, dtype=bool)
        """Slots holding a page written here whose bytes have not failed a read since."""
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
        """Read pages ``slots`` straight into ``rows`` (writable contiguous page-sized arrays).

        With ``verify``, a page whose bytes fail their checksum or come back short is marked bad
        (:meth:`failed`) and its row holds whatever was read; without, a short read raises
        StateError. Thread-safe against reads and writes of other slots."""
        got = self._io(slots, rows, write=False)
        if self.verify and slots:
            index = np.asarray(slots, dtype=np.intp)
            bad = (got < self.page_bytes) | (_checksums(rows) != self._sums[index])
            if bad.any():
                self._good[index[bad]] = False

    def write_rows(self, slots: list[PageId], rows: Sequence[npt.NDArray[np.uint8]]) -> None:
        """Write ``rows`` (contiguous page-sized arrays, e.g. host tier rows) to pages ``slots``,
        with their checksums (a slot whose write raised stays bad)."""
        if not self.verify:
            self._io(slots, rows, write=True)
            return
        index = np.asarray(slots, dtype=np.intp)
        self._good[index] = False
        sums = _checksums(rows)
        self._io(slots, rows, write=True)
        self._sums[index] = sums
        self._good[index] = True

    def failed(self, slots: Sequence[PageId]) -> list[int]:
        """Positions in ``slots`` of the pages known bad: one that failed a read (or was never
        written here) since its slot was allocated. Always empty without ``verify``."""
        if not self.verify or not len(slots):
            return []
        return np.flatnonzero(~self._good[np.asarray(slots, dtype=np.intp)]).tolist()  # type: ignore[no-any-return]

    def release(self, slots: list[PageId]) -> None:
        super().release(slots)
        if slots:
            self._good[np.asarray(slots, dtype=np.intp)] = False

    def _io(
        self, slots: list[PageId], rows: Sequence[npt.NDArray[np.uint8]], write: bool
    ) -> npt.NDArray[np.intp]:
        """Bytes transferred per page; a short transfer raises StateError unless it is a read
        by a verifying pool (then the page fails its check)."""
        self._check_open()
        call = os.pwritev if write else os.preadv
        page, stride = self.page_bytes, self.stride
        lenient = self.verify and not write
        done = np.full(len(slots), page, dtype=np.intp)
        for first, slot, n in _runs(slots):
            views = [memoryview(rows[first + j]) for j in range(n)]  # type: ignore[arg-type]
            if stride == page:
                got = call(self._fd, views, slot * stride)
                if got != n * page:
                    self._short(got, n * page, lenient)
                    done[first : first + n] = np.clip(got - np.arange(n) * page, 0, page)
            else:
                for j, view in enumerate(views):
                    got = call(self._fd, [view], (slot + j) * stride)
                    if got != page:
                        self._short(got, page, lenient)
                        done[first + j] = got
        return done

    def _short(self, got: int, want: int, lenient: bool) -> None:
        if not lenient:
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

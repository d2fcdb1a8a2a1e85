"""Slot allocation shared by every tier's page pool.

A pool holds ``num_slots`` pages of ``page_bytes`` each; a slot index is a PageId. Allocation is
LIFO over a free list (recently freed slots are warm in caches) and all-or-nothing per call.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from raykv.core.config import KVLayout, TierConfig
from raykv.core.errors import OutOfPagesError, StateError
from raykv.core.types import PageId, TierKind


class SlotDirectory(Protocol):
    """What a pool needs of its slot directory (:class:`raykv.core.tiers.shm_directory.ShmDirectory`
    is the one implementation): forgetting released slots, and closing."""

    def unbind(self, slots: Sequence[int]) -> None: ...

    def close(self) -> None: ...


def is_run(slots: Sequence[int]) -> bool:
    """Whether ``slots`` is a non-empty run ``s, s + 1, s + 2, ...``: one page range, so one copy.
    Two C-level passes (a range list, one comparison), no per-slot Python step."""
    n = len(slots)
    if not n:
        return False
    first = int(slots[0])
    return bool(int(slots[-1]) - first == n - 1 and list(slots) == list(range(first, first + n)))


def copy_rows(src: npt.NDArray[np.uint8], slots: Sequence[int], out: npt.NDArray[np.uint8]) -> None:
    """``out[i] = src[slots[i]]``: one memcpy for a consecutive run, a gather otherwise.

    ``slots`` must be valid rows of ``src`` (the gather uses ``mode="clip"``: numpy buffers the
    whole output of ``take(..., out=)`` in its default mode, an extra copy).
    """
    if not len(slots):
        return
    if is_run(slots):
        first = int(slots[0])
        np.copyto(out, src[first : first + len(slots)])
    else:
        np.take(src, np.asarray(slots, dtype=np.intp), axis=0, out=out, mode="clip")


class PagePool(abc.ABC):
    """Fixed-size page slots of one tier. Subclasses own the memory (host, disk or GPU)."""

    kind: TierKind
    slot_directory: SlotDirectory | None = None
    """Which committed block sits in which slot, for same-node one-sided readers (a shared host
    tier, an exported GPU tier; :mod:`raykv.core.tiers.shm_directory`); None otherwise."""

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.num_slots = config.num_pages(self.page_bytes)
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._used = np.zeros(self.num_slots, dtype=bool)
        self._closed = False

    # ---- slots -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def capacity_bytes(self) -> int:
        """Usable bytes: ``num_slots * page_bytes`` (the configured capacity rounded down)."""
        return self.num_slots * self.page_bytes

    def allocate(self, count: int) -> list[PageId]:
        """Take ``count`` free slots. Raises OutOfPagesError (nothing taken) if fewer are free."""
        self._check_open()
        if count > len(self._free):
            raise OutOfPagesError(
                f"{self.kind.name} tier has {len(self._free)} free pages, {count} needed",
                tier=self.kind.name,
            )
        free = self._free
        slots: list[PageId] = free[len(free) - count :]  # type: ignore[assignment]
        del free[len(free) - count :]
        slots.sort()  # ascending: consecutive free slots become one run for batched copies
        if slots and slots[-1] - slots[0] == count - 1:  # distinct and sorted: one run
            self._used[slots[0] : slots[-1] + 1] = True  # a slice: no index array to build
        else:
            self._used[slots] = True
        return slots

    def release(self, slots: list[PageId]) -> None:
        """Return slots to the free list (their directory records, if the tier keeps a slot
        directory, go first). Raises StateError for a slot that is not in use."""
        if not slots:
            return
        index = np.asarray(slots, dtype=np.intp)
        if not self._used[index].all() or len(set(slots)) != len(slots):
            twice = next(s for i, s in enumerate(slots) if not self._used[s] or s in slots[:i])
            raise StateError(f"{self.kind.name} slot {twice} released twice")
        if self.slot_directory is not None:
            self.slot_directory.unbind(slots)
        self._used[index] = False
        self._free.extend(index.tolist())

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])

    def used_slots(self) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self._used)

    def check_slots(self) -> None:
        """Raise AssertionError if the free list and the used bitmap disagree."""
        free = self._free
        assert len(set(free)) == len(free), f"{self.kind.name}: duplicate free slots"
        assert not self._used[free].any() if free else True, "free slot marked used"
        assert len(free) + int(self._used.sum()) == self.num_slots, "slot count mismatch"

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"{self.kind.name} tier is closed")

    # ---- data --------------------------------------------------------------------------------
    @abc.abstractmethod
    def read_pages(self, slots: list[PageId], out: npt.NDArray[np.uint8]) -> None:
        """Copy pages ``slots`` into the rows of ``out`` (shape [len(slots), page_bytes], host)."""

    @abc.abstractmethod
    def write_pages(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> None:
        """Copy the rows of ``data`` (host, [len(slots), page_bytes]) into pages ``slots``."""

    def close(self) -> None:
        """Release the tier's memory or files. Idempotent."""
        self._closed = True

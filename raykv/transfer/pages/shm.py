"""Same-node fast path: map a peer's shared host tier read-only and copy leased pages out of it.

The owner keeps its host tier in a /dev/shm file (``TierConfig.shared``); a client on the same
node maps that file with PROT_READ once per server and, for each pull, copies the leased pages
with one memcpy when their slots are consecutive (a gather otherwise). The owner holds a block
lease for the duration, so the pages neither move nor change while they are copied.

:func:`map_owner_file` is the checked open-and-map both this reader and an engine's inbox writer
(:mod:`raykv.transfer.inbox`) use on a file another process owns.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from raykv.core.errors import CudaError, TransferError, TransferFailure
from raykv.core.tiers.base import copy_rows, is_run
from raykv.core.tiers.host import SHM_PREFIX

log = logging.getLogger(__name__)


def consecutive(slots: Sequence[int]) -> bool:
    """True when ``slots`` is one run ``s, s+1, s+2, ...`` (empty and single lists are)."""
    return not len(slots) or is_run(slots)


MapStep = Literal["name", "open", "size", "map"]


class OwnerFileError(Exception):
    """Why :func:`map_owner_file` refused a file: ``step`` is "name" (not the owner's prefix),
    "open", "size" (not a regular file of exactly the expected size) or "map" (fstat or mmap
    failed); ``strerror`` is the OS's reason for "open" and "map", else None. Callers turn it into
    their own error."""

    def __init__(self, step: MapStep, strerror: str | None = None) -> None:
        super().__init__(step, strerror)
        self.step: MapStep = step
        self.strerror = strerror


def map_owner_file(path: str, prefix: str, size: int, writable: bool = False, flags: int = 0) -> mmap.mmap:
    """Map all ``size`` bytes of ``path``, a file another process owns, MAP_SHARED (or'd with
    ``flags``, e.g. MAP_POPULATE), read-only or, with ``writable``, read-write. The file must be
    named ``prefix...``, and be a regular file (O_NOFOLLOW: not a symlink) of exactly ``size``
    bytes. Returns the mapping; the descriptor is closed before returning (the mapping keeps the
    file). Raises OwnerFileError naming the step that failed; nothing is left open then."""
    if not os.path.basename(path).startswith(prefix):
        raise OwnerFileError("name")
    mode = os.O_RDWR if writable else os.O_RDONLY
    try:
        fd = os.open(path, mode | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise OwnerFileError("open", exc.strerror) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise OwnerFileError("size")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | flags, prot=prot)
    except OSError as exc:
        raise OwnerFileError("map", exc.strerror) from None
    finally:
        os.close(fd)


_SHM_REFUSALS: dict[MapStep, str] = {
    "name": "shared tier path is not a raykv host-tier file",
    "open": "cannot open the peer's shared tier ({})",
    "size": "the peer's shared tier has an unexpected size",
    "map": "cannot map the peer's shared tier ({})",
}


class ShmMapping:
    """A read-only mapping of a peer's shared host tier, as an array [num_slots, page_bytes].

    Raises TransferError(reason="shm") when the file is not a raykv host-tier file of exactly the
    announced size or cannot be mapped; callers then use UCX instead.
    """

    def __init__(self, path: str, num_slots: int, page_bytes: int) -> None:
        try:
            self._mmap = map_owner_file(path, SHM_PREFIX, num_slots * page_bytes)
        except OwnerFileError as exc:
            message = _SHM_REFUSALS[exc.step].format(exc.strerror)
            raise TransferError(message, reason=TransferFailure.SHM) from None
        self.path = path
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8).reshape(
            num_slots, page_bytes
        )
        self.pinned = False
        """Whether the mapping is page-locked for CUDA (:meth:`pin_for_cuda`)."""
        self._pinned_at = 0

    def pin_for_cuda(self) -> bool:
        """Page-lock the mapping read-only for CUDA (:func:`raykv.core.tiers.cuda_util.host_register`),
        so device copies out of its rows DMA them directly; idempotent. Returns whether it is
        pinned now (False without CUDA or when the driver refuses: logged once, nothing
        changed)."""
        if self.pinned or self.array.size == 0:
            return self.pinned
        from raykv.core.tiers.cuda_util import try_host_register

        address = int(self.array.ctypes.data)
        refused = try_host_register(address, self.array.nbytes, read_only=True)
        if refused is not None:
            log.info("cannot page-lock a peer's shared tier (%s); device copies stage", refused)
            return False
        self._pinned_at, self.pinned = address, True
        return True

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself (for readers that take a buffer; valid until :meth:`close`)."""
        return self._mmap

    def check(self, slots: Sequence[int]) -> None:
        """TransferError unless every slot is one of the mapped tier's."""
        if len(slots) and not (min(slots) >= 0 and max(slots) < len(self.array)):
            raise TransferError(
                "the peer named a slot outside its shared tier", reason=TransferFailure.PROTOCOL
            )

    def copy(self, slots: Sequence[int], out: npt.NDArray[np.uint8]) -> None:
        """Copy the pages at ``slots`` into the rows of ``out`` (TransferError on a bad slot)."""
        self.check(slots)
        copy_rows(self.array, slots, out)

    def run(self, slots: Sequence[int]) -> npt.NDArray[np.uint8] | None:
        """The pages at ``slots`` in place (a read-only view, no copy) when they are one run of
        consecutive slots, else None. Valid while the owner's lease on them lasts."""
        self.check(slots)
        if not consecutive(slots):
            return None
        first = int(slots[0]) if len(slots) else 0
        return self.array[first : first + len(slots)]

    def close(self) -> None:
        if self.pinned:
            from raykv.core.tiers.cuda_util import host_unregister

            try:
                host_unregister(self._pinned_at)
            except CudaError as exc:  # the mapping goes anyway; the driver drops the lock with it
                log.warning("cuMemHostUnregister of a peer's shared tier failed (%s)", exc)
            self.pinned = False
        self.array = np.zeros((0, 0), dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it

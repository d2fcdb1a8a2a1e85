"""Host tier: one numpy array of page slots (pinned through torch when a GPU tier exists).

A *shared* host tier (``TierConfig.shared``) keeps the same array in a file under /dev/shm
(``raykv-host-<pid>-*``, mode 0600) so a peer process on the same node can map it read-only and copy
leased pages with one memcpy (:mod:`raykv.transfer`). The file is reserved up front (no SIGBUS on
a full /dev/shm later), its page tables filled in the background (:func:`prefault`), and unlinked
on close; a process killed with SIGKILL leaves it behind.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core import threads
from raykv.core.config import DTYPES, KVLayout, TierConfig
from raykv.core.errors import CudaError, OutOfMemoryError
from raykv.core.tiers.base import PagePool, copy_rows, is_run
from raykv.core.tiers.shm_directory import ShmDirectory
from raykv.core.types import PageId, TierKind

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "raykv-host-"
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap does not name it
PREFAULT_CHUNK = 64 << 20


def prefault(mapping: mmap.mmap, size: int, stop: threading.Event) -> int:
    """Fault in the page tables of ``mapping``'s first ``size`` bytes for writing, without
    changing a byte (``MADV_POPULATE_WRITE``), 64 MiB at a time until ``stop`` is set; returns the
    bytes done (0 where the kernel does not know the call, or the mapping was closed). A fresh
    shared tier's first write to each 4 KiB page would otherwise take a page fault: imports into
    fresh pages ran at a fifth of the speed of later ones (measured)."""
    done = 0
    while done < size and not stop.is_set():
        length = min(PREFAULT_CHUNK, size - done)
        try:
            mapping.madvise(MADV_POPULATE_WRITE, done, length)
        except (OSError, ValueError):
            return done
        done += length
    return done


class HostPool(PagePool):
    """Pages live in ``self.array`` (uint8, shape [num_slots, page_bytes]).

    ``pin`` asks for page-locked memory through torch (only meaningful with CUDA); when pinning is
    impossible the pool falls back to pageable memory and logs it. With ``config.shared`` the
    array lives in a /dev/shm file named by :attr:`shm_path`; ``pin`` then registers that mapping
    with CUDA (:meth:`pin_for_cuda`).
    """

    kind = TierKind.HOST

    def __init__(self, config: TierConfig, layout: KVLayout, pin: bool = False) -> None:
        super().__init__(config, layout)
        self.pinned = False
        self._torch_buffer: Any = None
        self._mmap: mmap.mmap | None = None
        self.shm_path: str | None = None
        """Path of the backing /dev/shm file of a shared tier (None when not shared or closed)."""
        self.slot_directory = None
        """Which committed block sits in which slot, for one-sided same-node reads (shared tiers;
        see :mod:`raykv.core.tiers.shm_directory`)."""
        self._registered = False
        self._stop_prefault = threading.Event()
        self._prefaulting: threading.Thread | None = None
        if config.shared:
            self.array = self._allocate_shared()
            assert self.shm_path is not None
            try:
                self.slot_directory = ShmDirectory(self.shm_path, self.num_slots, self.page_bytes)
            except OSError as exc:
                log.warning("host tier: no directory for one-sided reads (%s)", exc)
            if pin:
                self.pin_for_cuda()
        else:
            self.array = self._allocate(pin)

    def pin_for_cuda(self) -> bool:
        """Page-lock the tier's memory for CUDA copies (:func:`raykv.core.tiers.cuda_util.host_register`;
        a shared tier's mapping too), so device copies to and from its pages are DMA transfers.
        Changes nothing but the locking; idempotent. Returns whether the memory is pinned now
        (False without CUDA, or when the driver refuses, e.g. over the locked-memory limit:
        logged)."""
        if self.pinned or self.array.size == 0:
            return self.pinned
        from raykv.core.tiers.cuda_util import try_host_register

        refused = try_host_register(int(self.array.ctypes.data), self.array.nbytes)
        if refused is not None:
            log.warning("host tier: cannot pin for CUDA (%s); copies stage through pinned buffers", refused)
            return False
        self._registered = self.pinned = True
        return True

    def _unregister(self) -> None:
        if self._registered:
            from raykv.core.tiers.cuda_util import host_unregister

            try:
                host_unregister(int(self.array.ctypes.data))
            except CudaError as exc:
                log.warning("host tier: cuMemHostUnregister failed (%s)", exc)
            self._registered = self.pinned = False

    def _allocate_shared(self) -> npt.NDArray[np.uint8]:
        """Map a fresh, fully reserved /dev/shm file (a temp dir where /dev/shm is missing)."""
        size = self.num_slots * self.page_bytes
        directory = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=directory)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover - non-Linux
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            args = (self._mmap, size, self._stop_prefault)
            self._prefaulting = threading.Thread(target=prefault, args=args, daemon=True, name="prefault")
            self._prefaulting.start()
        except OSError as exc:
            os.unlink(path)
            raise OutOfMemoryError(f"host tier: cannot reserve {size} bytes in {directory}: {exc}") from None
        finally:
            os.close(fd)
        self.shm_path = path
        return np.frombuffer(self._mmap, dtype=np.uint8).reshape(self.num_slots, self.page_bytes)

    def _allocate(self, pin: bool) -> npt.NDArray[np.uint8]:
        shape = (self.num_slots, self.page_bytes)
        if pin:
            try:
                import torch

                if torch.cuda.is_available():
                    self._torch_buffer = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
                    self.pinned = True
                    return self._torch_buffer.numpy()  # type: ignore[no-any-return]
            except (ImportError, RuntimeError) as exc:
                log.warning("host tier: pinned allocation failed (%s); using pageable memory", exc)
        try:
            return np.zeros(shape, dtype=np.uint8)
        except MemoryError:
            raise OutOfMemoryError(
                f"host tier: cannot allocate {self.num_slots * self.page_bytes} bytes"
            ) from None

    def page(self, slot: PageId) -> npt.NDArray[np.uint8]:
        """Writable uint8 view of one page (valid until the slot is released)."""
        return self.array[slot]

    def buffer_view(self, slot: PageId, layer_id: int, role: str) -> npt.NDArray[Any]:
        """Typed view ``[tokens_per_block, *shape]`` of one (layer, role) buffer of a page.

        bfloat16 and float8 buffers are viewed as uint16 / uint8 (numpy has no such types).
        Raises RoleNotFoundError for a (layer, role) the layout lacks.
        """
        region = self.layout.buffer_region(layer_id, role)
        raw = self.array[slot, region.offset : region.offset + region.nbytes]
        return raw.view(DTYPES[region.spec.dtype][1]).reshape(region.view_shape)

    def read_pages(self, slots: list[PageId], out: npt.NDArray[np.uint8]) -> None:
        """:func:`raykv.core.tiers.base.copy_rows` out of the tier; several MiB in pieces over the copy
        threads (:func:`raykv.core.threads.run_rows`)."""
        if len(slots) * self.page_bytes < 2 * threads.PIECE_BYTES:
            self._read(slots, out)
        else:
            threads.run_rows(self.page_bytes, len(slots), lambda a, b: self._read(slots[a:b], out[a:b]))

    def write_pages(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> None:
        """One memcpy for a run of consecutive slots (a scatter is much slower), else a scatter;
        several MiB in pieces over the copy threads (:func:`raykv.core.threads.run_rows`)."""
        if len(slots) * self.page_bytes < 2 * threads.PIECE_BYTES:
            self._write(slots, data)
        else:
            threads.run_rows(self.page_bytes, len(slots), lambda a, b: self._write(slots[a:b], data[a:b]))

    def _read(self, slots: list[PageId], out: npt.NDArray[np.uint8]) -> list[None]:
        copy_rows(self.array, slots, out)
        return []

    def _write(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> list[None]:
        if is_run(slots):
            np.copyto(self.array[slots[0] : slots[0] + len(slots)], data)
        elif slots:
            self.array[np.asarray(slots, dtype=np.intp)] = data
        return []

    def close(self) -> None:
        super().close()
        self._stop_prefault.set()
        if self._prefaulting is not None:
            self._prefaulting.join()  # at most one chunk's madvise
            self._prefaulting = None
        self._unregister()
        self._torch_buffer = None
        if self.slot_directory is not None:
            self.slot_directory.close()
            self.slot_directory = None
        if self.shm_path is not None:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
            self.shm_path = None
        if self._mmap is not None:
            self.array = np.zeros((0, self.page_bytes), dtype=np.uint8)
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still exported (e.g. a send in flight): unmapped when it goes
            self._mmap = None

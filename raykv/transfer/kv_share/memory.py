"""A CPU engine's KV memory, shared read-only with its owner; the owner's gather out of it.

:func:`share_memory` (engine side) moves the whole pages of a memory range (a KV tensor torch
allocated) onto a fresh memfd at the same addresses, keeping their bytes: the engine's tensors
work on unchanged, and the memfd's descriptor is what the engine hands its CacheWorker.
:class:`ReadOnlyRegion` (owner side) maps such a descriptor with PROT_READ only: the owner can
read the engine's blocks and never write them, as the engine maps nothing of the owner's
matchable pages. :func:`gather` copies segments of mapped memory back to back into page rows
(``raykv.native._gather``: one call without the GIL, non-temporal stores; else ctypes.memmove).

Linux only (memfd, MAP_FIXED), and x86-64 only (:func:`supported`): the owner's abandon check
(:mod:`raykv.transfer.kv_share.owner`) relies on x86-64's ordering of loads, as the one-sided
reads do (:mod:`raykv.core.tiers.shm_directory`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import stat
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv import native
from raykv.core.errors import InvalidArgumentError, StateError

PAGE = mmap.PAGESIZE
CHUNK = 64 << 20
"""Bytes moved onto the memfd per step: at most this much memory is held twice while sharing."""
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
MIN_BYTES = 32 << 20
"""The smallest range :func:`share_memory` takes. glibc serves every allocation of at least this
size (its largest mmap threshold) from a mapping of its own, so the pages moved belong to that
allocation alone; a smaller range may lie in the malloc heap, whose pages other allocations
reuse once it is freed."""
_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""The owner maps an engine's memory with its page tables filled: a first gather would otherwise
take a fault per 4 KiB page (measured: a 64 MiB store ran at 0.34x a memcpy, its gather alone
at about 1x)."""


def supported() -> bool:
    """Whether engine memory can be shared here (Linux with memfd on x86-64)."""
    return (
        sys.platform == "linux" and hasattr(os, "memfd_create") and platform.machine() in ("x86_64", "AMD64")
    )


@dataclass(frozen=True)
class SharedRegion:
    """Engine memory now backed by memfd ``fd``: ``size`` bytes from address ``start``."""

    fd: int
    start: int
    size: int


@functools.cache
def _libc() -> tuple[Any, Any]:
    """libc's ``mmap`` and ``madvise`` with their signatures (errno kept), loaded once."""
    libc = ctypes.CDLL(None, use_errno=True)
    remap, advise = libc.mmap, libc.madvise
    remap.restype = ctypes.c_void_p
    remap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    advise.restype = ctypes.c_int
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return remap, advise


def share_memory(address: int, nbytes: int) -> SharedRegion | None:
    """Back the whole pages of ``[address, address + nbytes)`` by a new memfd, bytes kept, in
    chunks of :data:`CHUNK` (the old pages of a chunk are freed as it moves). The range must be
    one allocation of at least :data:`MIN_BYTES` of this process that nothing else writes
    meanwhile (a KV cache before its first step). The moved pages are marked MADV_DONTFORK: a
    child forked later does not inherit them (a shared mapping would otherwise be shared with it
    instead of copied on write). Returns the region, or None when the range is smaller than
    :data:`MIN_BYTES`. StateError when the kernel refuses the memfd or a mapping: chunks moved
    before stay moved (their bytes kept)."""
    if type(address) is not int or type(nbytes) is not int or address <= 0 or nbytes < 0:
        raise InvalidArgumentError("address", "need a positive address and a size")
    if nbytes < MIN_BYTES:
        return None
    start = -(-address // PAGE) * PAGE
    end = (address + nbytes) // PAGE * PAGE
    if end <= start:
        return None
    size = end - start
    try:
        fd = os.memfd_create("raykv-engine-kv", os.MFD_CLOEXEC)
    except OSError as exc:
        raise StateError(f"cannot create a memfd for engine memory ({exc.strerror})") from None
    try:
        os.ftruncate(fd, size)
        remap, advise = _libc()
        for offset in range(0, size, CHUNK):
            n = min(CHUNK, size - offset)
            view = (ctypes.c_char * n).from_address(start + offset)
            if os.pwrite(fd, memoryview(view), offset) != n:
                raise OSError(0, "short write")
            flags = mmap.MAP_SHARED | _MAP_FIXED
            got = remap(start + offset, n, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
            if got != start + offset:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            if advise(start + offset, n, _MADV_DONTFORK) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except OSError as exc:
        os.close(fd)
        raise StateError(f"cannot share engine memory ({exc.strerror})") from None
    return SharedRegion(fd, start, size)


class ReadOnlyRegion:
    """The owner's read-only mapping (page tables filled) of an engine's shared region: engine addresses
    ``[start, start + size)`` are readable at ``address + (engine address - start)``.
    StateError when ``fd`` is not a memfd or regular file of at least ``size`` bytes, or cannot
    be mapped. The descriptor is closed once mapped (or refused)."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < size or size <= 0 or start % PAGE:
                raise StateError("a shared region that is not a regular file of its stated size")
            flags = mmap.MAP_SHARED | _POPULATE
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        except OSError as exc:
            raise StateError(f"cannot map an engine region ({exc.strerror})") from None
        finally:
            os.close(fd)
        self.start, self.size = start, size
        self._array = np.frombuffer(self._mmap, np.uint8)
        self.address = int(self._array.ctypes.data)

    def u64(self, offset: int) -> int:
        """The 8-byte unsigned word at byte ``offset`` (little-endian), read once."""
        return int(self._array[offset : offset + 8].view(np.uint64)[0])

    def close(self) -> None:
        """Unmap (later gathers from it must not run: the owner closes a region only with its
        connection, after its last store)."""
        if self._mmap is not None:
            self._array = np.zeros(0, np.uint8)
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None


def gather(dst: npt.NDArray[np.uint8], srcs: npt.NDArray[np.uint64], lens: npt.NDArray[np.int64]) -> None:
    """Copy segment ``i`` (``lens[i]`` bytes at address ``srcs[i]``, mapped memory the caller
    checked) to ``dst`` back to back; ``dst`` (C-contiguous uint8) must hold their sum."""
    if not dst.flags.c_contiguous or int(lens.sum()) > dst.nbytes:
        raise InvalidArgumentError("dst", "must be C-contiguous and hold every segment")
    module = native.load("_gather")
    base = int(dst.ctypes.data)
    if module is not None:
        module.gather(base, np.ascontiguousarray(srcs, np.uint64), np.ascontiguousarray(lens, np.int64))
        return
    offset = 0
    for src, n in zip(srcs.tolist(), lens.tolist()):
        ctypes.memmove(base + offset, src, n)
        offset += n

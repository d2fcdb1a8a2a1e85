"""CUDA virtual memory for the GPU tier: a fixed address range with physical chunks mapped at its head.

:class:`VmmArena` reserves one virtual address range (``cuMemAddressReserve``) and maps physical
chunks (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``) at its head as it grows, unmapping and
releasing tail chunks when it shrinks. The base address never moves, so page ids stay valid and a
kernel's base pointer stays put. Chunks are created with a POSIX file-descriptor handle type when
the driver allows it, so :meth:`VmmArena.export_fds` can hand them to another process
(:mod:`raykv.ipc`), which maps them with :class:`ImportedArena`. When the driver refuses exportable
chunks, the arena falls back to plain (non-exportable) chunks and logs a warning.

:func:`torch_view` wraps any device address range as a torch uint8 tensor (through the CUDA array
interface, zero copy); the tensor keeps its owner alive but does not own the memory.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from raykv.core.errors import CudaError, InvalidArgumentError, OutOfMemoryError
from raykv.core.tiers.cuda_util import check, driver, ensure_context

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def default_chunk_bytes(quota: int) -> int:
    """Physical chunk size for a pool of ``quota`` bytes (TensorRT-LLM's rule).

    2 MiB below 2 GiB, then doubling per power of two of GiB, up to 32 MiB at 16 GiB or more.
    """
    shift = min(4, max(0, (quota // GIB).bit_length() - 1)) if quota >= GIB else 0
    return (2 * MIB) << shift


def _prop(device: int, exportable: bool) -> Any:
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if exportable:
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _access(device: int) -> Any:
    drv = driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _map(device: int, address: int, size: int, handle: Any) -> None:
    """Map ``handle`` at ``address`` and make it read-write for ``device`` (unmapped on failure)."""
    drv = driver()
    ptr = drv.CUdeviceptr(address)
    check(drv.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    try:
        check(drv.cuMemSetAccess(ptr, size, [_access(device)], 1), "cuMemSetAccess")
    except CudaError:
        drv.cuMemUnmap(ptr, size)
        raise


class VmmArena:
    """A reserved device address range of ``reserved`` bytes; ``mapped_bytes`` of it are backed.

    Raises OutOfMemoryError when the device cannot back a chunk, CudaError for any other driver
    failure; a constructor or :meth:`resize` that fails leaves nothing behind it took.
    """

    def __init__(self, device: int, reserve_bytes: int, chunk_bytes: int | None = None) -> None:
        drv = driver()
        ensure_context(device)
        self.device = device
        self.exportable = True
        self._lock = threading.Lock()
        gran_flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        gran = int(check(drv.cuMemGetAllocationGranularity(_prop(device, True), gran_flag), "granularity"))
        self.chunk_bytes = _round_up(chunk_bytes or default_chunk_bytes(reserve_bytes), gran)
        self.reserved = _round_up(max(reserve_bytes, 1), self.chunk_bytes)
        ptr = check(drv.cuMemAddressReserve(self.reserved, 0, drv.CUdeviceptr(0), 0), "cuMemAddressReserve")
        self.base = int(ptr)
        self._handles: list[Any] = []

    @property
    def mapped_bytes(self) -> int:
        return len(self._handles) * self.chunk_bytes

    @property
    def num_chunks(self) -> int:
        return len(self._handles)

    def resize(self, nbytes: int) -> None:
        """Back at least ``nbytes`` from the base (whole chunks); unmap the chunks past that.

        The caller makes sure nothing still uses memory it unmaps. Raises InvalidArgumentError
        beyond the reservation, OutOfMemoryError when the device has no room (the chunks mapped by
        this call are released again).
        """
        if nbytes < 0 or nbytes > self.reserved:
            raise InvalidArgumentError("nbytes", f"{nbytes} is outside the reserved {self.reserved} bytes")
        want = -(-nbytes // self.chunk_bytes)
        ensure_context(self.device)
        with self._lock:
            have = len(self._handles)
            try:
                while len(self._handles) < want:
                    self._map_chunk()
            except BaseException:
                self._unmap_tail(have)
                raise
            self._unmap_tail(want)

    def _map_chunk(self) -> None:
        drv = driver()
        try:
            handle = check(
                drv.cuMemCreate(self.chunk_bytes, _prop(self.device, self.exportable), 0), "cuMemCreate"
            )
        except OutOfMemoryError:
            raise
        except CudaError as exc:
            if not self.exportable:
                raise
            log.warning("GPU tier: exportable VMM chunks refused (%s); pool cannot be shared", exc.cuda_error)
            self.exportable = False
            handle = check(drv.cuMemCreate(self.chunk_bytes, _prop(self.device, False), 0), "cuMemCreate")
        try:
            _map(self.device, self.base + self.mapped_bytes, self.chunk_bytes, handle)
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        self._handles.append(handle)

    def _unmap_tail(self, keep: int) -> None:
        drv = driver()
        while len(self._handles) > keep:
            handle = self._handles.pop()
            ptr = drv.CUdeviceptr(self.base + len(self._handles) * self.chunk_bytes)
            check(drv.cuMemUnmap(ptr, self.chunk_bytes), "cuMemUnmap")
            check(drv.cuMemRelease(handle), "cuMemRelease")

    def export_fds(self) -> list[int]:
        """One new POSIX file descriptor per mapped chunk, in address order; the caller closes them.

        Raises CudaError when the chunks are not exportable.
        """
        if not self.exportable:
            raise CudaError("GPU pool chunks are not exportable", cuda_error="CUDA_ERROR_NOT_SUPPORTED")
        drv = driver()
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        ensure_context(self.device)
        fds: list[int] = []
        with self._lock:
            try:
                for handle in self._handles:
                    fds.append(int(check(drv.cuMemExportToShareableHandle(handle, kind, 0), "export")))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        return fds

    def close(self) -> None:
        """Unmap everything and free the reservation. Idempotent."""
        if self.base == 0:
            return
        drv = driver()
        ensure_context(self.device)
        with self._lock:
            self._unmap_tail(0)
            check(drv.cuMemAddressFree(drv.CUdeviceptr(self.base), self.reserved), "cuMemAddressFree")
            self.base = 0


class ImportedArena:
    """Chunks exported by another process (one POSIX fd each), mapped contiguously in this one.

    The fds are consumed (closed) whether or not the import succeeds. ``device``: the device
    whose context maps the chunks and that gets read-write access to them; that may be another
    device than the one holding the memory (a peer over NVLink or PCIe: the driver refuses with
    CudaError when the two cannot access each other).
    """

    def __init__(self, device: int, fds: list[int], chunk_bytes: int) -> None:
        drv = driver()
        ensure_context(device)
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.size = chunk_bytes * len(fds)
        self._handles: list[Any] = []
        self.base = 0
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        try:
            for fd in fds:
                self._handles.append(
                    check(drv.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle")
                )
            ptr = check(
                drv.cuMemAddressReserve(max(self.size, chunk_bytes), 0, drv.CUdeviceptr(0), 0), "reserve"
            )
            self.base = int(ptr)
            self._mapped = 0
            for handle in self._handles:
                _map(device, self.base + self._mapped * chunk_bytes, chunk_bytes, handle)
                self._mapped += 1
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Unmap and release everything this process mapped. Idempotent."""
        drv = driver()
        ensure_context(self.device)
        if self.base:
            for i in range(getattr(self, "_mapped", 0)):
                drv.cuMemUnmap(drv.CUdeviceptr(self.base + i * self.chunk_bytes), self.chunk_bytes)
            drv.cuMemAddressFree(drv.CUdeviceptr(self.base), max(self.size, self.chunk_bytes))
            self.base = 0
        for handle in self._handles:
            drv.cuMemRelease(handle)
        self._handles = []


class _CudaArray:
    """Exposes a device address range through the CUDA array interface (for torch.as_tensor)."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
            "strides": None,
        }


def torch_view(address: int, nbytes: int, device: int, owner: object) -> Any:
    """A 1-D torch uint8 tensor over ``nbytes`` of device memory at ``address`` (zero copy)."""
    import torch

    dev = torch.device("cuda", device)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    tensor = torch.as_tensor(_CudaArray(address, nbytes, owner), device=dev)
    if tensor.data_ptr() != address or tensor.numel() != nbytes:  # pragma: no cover - sanity
        raise CudaError("torch did not map the pool in place", cuda_error="RAYKV_VIEW_MISMATCH")
    return tensor

"""GPU tier: page slots in device memory with a fixed base address, indexable by page id.

Memory. The pool reserves a virtual address range as large as the device (CUDA virtual memory,
:mod:`raykv.core.tiers.vmm`) and maps physical chunks at its head for the configured pages;
:meth:`GpuPool.resize` maps more chunks or unmaps tail chunks, and the base address never moves.
Chunks are exportable (POSIX fds), so an engine process on the same GPU can map the very same
pages (:mod:`raykv.ipc`). If cuda-python or the VMM API is missing or refuses, the pool falls back
to one plain torch allocation (logged as a warning; ``RAYKV_GPU_VMM=0`` forces it): everything
works except :meth:`GpuPool.resize` and sharing.

Layout (page-major). ``tensor`` is uint8 ``[num_slots, page_bytes]``: page id ``p`` is row ``p``,
bytes ``[p * page_bytes, (p + 1) * page_bytes)`` from :attr:`GpuPool.base_address`. Inside a page
the buffers follow the :class:`~raykv.core.config.KVLayout` order (layer 0 "k", layer 0 "v", its extra
buffers, layer 1 "k", ...), each ``[tokens_per_block, *shape]`` row-major at a 16-byte-aligned
offset. :meth:`PageViews.layer_view` (and :meth:`PageViews.k_view` / :meth:`PageViews.v_view`)
gives the typed strided view ``[num_slots, tokens_per_block, *shape]`` of one buffer across all
pages: ``k_view(l)[page_id]`` is that page's K of layer ``l``, and a kernel addresses it as
``k_view(l).data_ptr() + page_id * k_view(l).stride(0) * itemsize``. Moving a page between tiers is
one contiguous copy.

Ordering (events, not device-wide synchronization). Copies run asynchronously on the copier's
streams (:mod:`raykv.core.tiers.cuda_copy`); :attr:`GpuPool.events` keeps each slot's pending copy.

* A copy out of the pool (demotion) first waits for the caller's current stream, so KV written
  there by the engine is complete. The manager may release the source slots at once: the next
  :meth:`allocate` that hands such a slot out makes the current stream wait for the drain.
* A copy into the pool (promotion) makes the caller's current stream wait for it, so work queued
  there afterwards sees the bytes. :meth:`page`, :meth:`buffer_view`, :meth:`read_pages` and
  :meth:`write_pages` wait for the slot's pending copy too; an engine launching kernels on another
  stream calls :meth:`wait_ready` with its page ids and stream first.
* Once the pool is shared with another process (``shared``), these waits block the host instead,
  since the other process's streams cannot wait on this process's events.

torch is imported only when a GPU tier is built; machines without CUDA never touch it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core.config import KVLayout, TierConfig
from raykv.core.errors import CudaError, InvalidArgumentError, OutOfMemoryError, StateError
from raykv.core.tiers.base import PagePool
from raykv.core.tiers.cuda_copy import CudaCopier
from raykv.core.tiers.cuda_util import SlotEvents, SlotList, one_run, slot_array, torch_errors
from raykv.core.tiers.vmm import VmmArena, default_chunk_bytes, torch_view
from raykv.core.types import PageId, TierKind

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
}


def cuda_available() -> bool:
    """True when torch imports and sees at least one CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CudaError("a GPU tier needs torch with CUDA", cuda_error="NO_TORCH") from None
    if not torch.cuda.is_available():
        raise CudaError("a GPU tier needs a CUDA device", cuda_error="cudaErrorNoDevice")
    return torch


class PageViews:
    """Typed views of ``self.tensor`` (uint8 ``[num_slots, page_bytes]`` on a device).

    Shared by the owning pool and by engine-side attachments (:class:`raykv.ipc.AttachedPool`).
    """

    tensor: Any
    layout: KVLayout
    num_slots: int

    def _dtype(self, name: str) -> Any:
        import torch

        return getattr(torch, TORCH_DTYPES[name])

    def buffer_view(self, slot: PageId, layer_id: int, role: str) -> Any:
        """Typed view ``[tokens_per_block, *shape]`` of one (layer, role) buffer of one page."""
        region = self.layout.buffer_region(layer_id, role)
        raw = self.tensor[slot, region.offset : region.offset + region.nbytes]
        return raw.view(self._dtype(region.spec.dtype)).view(region.view_shape)

    def layer_view(self, layer_id: int, role: str) -> Any:
        """Strided view ``[num_slots, tokens_per_block, *shape]`` of one buffer across pages."""
        region = self.layout.buffer_region(layer_id, role)
        raw = self.tensor[:, region.offset : region.offset + region.nbytes]
        return raw.view(self._dtype(region.spec.dtype)).view(self.num_slots, *region.view_shape)

    def k_view(self, layer_id: int) -> Any:
        """``[num_slots, tokens_per_block, heads, head_dim]`` K of one layer, indexed by page id."""
        return self.layer_view(layer_id, "k")

    def v_view(self, layer_id: int) -> Any:
        """``[num_slots, tokens_per_block, heads, head_dim]`` V of one layer, indexed by page id."""
        return self.layer_view(layer_id, "v")

    def kv_views(self) -> list[tuple[Any, Any]]:
        """(K, V) views of every layer, in layout order."""
        return [(self.k_view(i), self.v_view(i)) for i in self.layout.layer_ids]


class GpuPool(PageViews, PagePool):
    """Pages in device memory. Raises OutOfMemoryError at construction if the GPU lacks room.

    ``use_vmm`` (default: on unless ``RAYKV_GPU_VMM=0``) picks CUDA virtual memory; when it is
    unavailable the pool logs a warning and uses a plain allocation (``arena`` is then None).
    """

    kind = TierKind.GPU

    def __init__(self, config: TierConfig, layout: KVLayout, use_vmm: bool | None = None) -> None:
        PagePool.__init__(self, config, layout)
        torch = _import_torch()
        self._torch = torch
        count = torch.cuda.device_count()
        if config.device >= count:
            raise CudaError(
                f"GPU tier: no CUDA device {config.device} ({count} visible)",
                cuda_error="CUDA_ERROR_INVALID_DEVICE",
            )
        self.device = torch.device("cuda", config.device)
        need = self.num_slots * self.page_bytes
        with torch_errors("cudaMemGetInfo"):
            free, total = torch.cuda.mem_get_info(self.device)
        if need > free:
            raise OutOfMemoryError(
                f"GPU tier wants {need} bytes on {self.device}, only {free} free",
                tier="GPU",
                needed=need,
                free=free,
            )
        self.events = SlotEvents()
        self.shared = False
        """True once another process maps the pool: waits then block the host (see module doc)."""
        self._storage: Any = None
        want_vmm = os.environ.get("RAYKV_GPU_VMM", "1") != "0" if use_vmm is None else use_vmm
        self.arena: VmmArena | None = self._make_arena(need, total) if want_vmm else None
        if self.arena is None:
            with torch_errors("GPU tier allocation"):
                self._storage = torch.empty(need, dtype=torch.uint8, device=self.device)
        self.base_address = self.arena.base if self.arena is not None else int(self._storage.data_ptr())
        """Device address of page 0; fixed for the pool's lifetime."""
        self.tensor = self._view()
        self.copier = CudaCopier(config.device)
        self.slot_directory = None
        """Set while the tier is exported to same-node peers (:mod:`raykv.transfer.paths.gpu_peer`):
        which committed block sits in which slot, for their one-sided reads."""

    def _make_arena(self, need: int, total: int) -> VmmArena | None:
        device = self.device.index
        try:
            arena = VmmArena(device, max(need, total), default_chunk_bytes(need))
        except (CudaError, ImportError, OSError) as exc:
            log.warning("GPU tier: CUDA virtual memory unavailable (%s); using a plain allocation", exc)
            return None
        try:
            arena.resize(need)
            torch_view(arena.base, need, device, arena)
        except OutOfMemoryError as exc:
            arena.close()
            raise OutOfMemoryError(
                f"GPU tier wants {need} bytes on {self.device}: {exc}", tier="GPU"
            ) from None
        except (CudaError, RuntimeError, TypeError) as exc:
            arena.close()
            log.warning("GPU tier: mapping VMM chunks failed (%s); using a plain allocation", exc)
            return None
        return arena

    def _view(self) -> Any:
        nbytes = self.num_slots * self.page_bytes
        if self.arena is not None:
            flat = torch_view(self.arena.base, nbytes, self.device.index, self.arena)
        else:
            flat = self._storage[:nbytes]
        return flat.view(self.num_slots, self.page_bytes)

    # ---- growth ------------------------------------------------------------------------------
    def resize(self, num_slots: int) -> None:
        """Grow or shrink the pool to ``num_slots`` pages; the base address stays where it is.

        Growing maps chunks (OutOfMemoryError, nothing changed, when the device lacks room).
        Shrinking unmaps the tail and needs every slot past ``num_slots`` free (StateError
        otherwise). Views taken before a resize keep their old shape; take new ones.
        """
        self._check_open()
        if self.arena is None:
            raise StateError(
                "GPU tier: resizing needs the CUDA virtual-memory pool (this one is a plain allocation)"
            )
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidArgumentError("num_slots", f"must be an int >= 1, got {num_slots!r}")
        old = self.num_slots
        if num_slots * self.page_bytes > self.arena.reserved:
            raise InvalidArgumentError(
                "num_slots", f"{num_slots} pages exceed the {self.arena.reserved}-byte reservation"
            )
        if num_slots < old:
            busy = int(np.count_nonzero(self._used[num_slots:]))
            if busy:
                raise StateError(
                    f"GPU tier: cannot shrink to {num_slots} pages, {busy} pages above that are in use"
                )
            gone = range(num_slots, old)
            self.events.wait_host(gone)
            with torch_errors("synchronize before unmapping"):
                self._torch.cuda.synchronize(self.device)
            self.arena.resize(num_slots * self.page_bytes)
            self._free = [s for s in self._free if s < num_slots]
            self._used = self._used[:num_slots].copy()
        elif num_slots > old:
            self.arena.resize(num_slots * self.page_bytes)
            self._used = np.concatenate((self._used, np.zeros(num_slots - old, dtype=bool)))
            self._free[:0] = range(num_slots - 1, old - 1, -1)
        self.num_slots = num_slots
        self.tensor = self._view()

    # ---- ordering ----------------------------------------------------------------------------
    def wait_ready(self, slots: list[PageId] | range, stream: Any = None) -> None:
        """Order ``stream`` (default: the current stream) after the pending copies of ``slots``.

        In a shared pool this blocks the host until those copies completed instead.
        """
        if not len(self.events):
            return
        if self.shared:
            self.events.wait_host(slots)
        else:
            self.events.wait_stream(slots, stream or self._torch.cuda.current_stream(self.device))

    def record_written(self, slots: list[PageId]) -> None:
        """Pages ``slots`` were written by work queued on the current stream (a commit): copies
        out of them, and same-node peers reading them (``gpu_peer``), wait for that work first."""
        if not slots:
            return
        with torch_errors("record the commit's event"):
            event = self._torch.cuda.Event()
            event.record(self._torch.cuda.current_stream(self.device))
        self.events.set(list(slots), event)

    def allocate(self, count: int) -> list[PageId]:
        """Take ``count`` free slots; a slot still being drained is waited for (see module doc)."""
        slots = super().allocate(count)
        self.wait_ready(slots)
        return slots

    # ---- data --------------------------------------------------------------------------------
    def page(self, slot: PageId) -> Any:
        """uint8 view of one whole page (ordered after its pending copy)."""
        self.wait_ready([slot])
        return self.tensor[slot]

    def buffer_view(self, slot: PageId, layer_id: int, role: str) -> Any:
        self.wait_ready([slot])
        return super().buffer_view(slot, layer_id, role)

    def read_pages(self, slots: list[PageId], out: npt.NDArray[np.uint8]) -> None:
        if not slots:
            return
        torch = self._torch
        self.wait_ready(slots)
        with torch_errors("GPU page read"):
            idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
            torch.from_numpy(out).copy_(self.tensor.index_select(0, idx))

    def write_pages(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> None:
        if not slots:
            return
        torch = self._torch
        self.wait_ready(slots)
        with torch_errors("GPU page write"):
            idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
            src = torch.from_numpy(np.ascontiguousarray(data)).to(self.device)
            self.tensor.index_copy_(0, idx, src)

    def copy_slots(self, src: SlotList, dst: SlotList) -> None:
        """Copy pages ``src`` onto pages ``dst`` of this pool (asynchronous, on the d2d stream).
        Large batches are cheapest as int64 arrays (no per-slot Python work); the slot events
        are looked up before the copy only when some are pending, and set after it is enqueued
        (while the GPU copies)."""
        if one_run(src) and one_run(dst):
            listed: SlotList | None = [*src, *dst]
        else:
            src, dst = slot_array(src), slot_array(dst)
            listed = None

        def both() -> SlotList:
            return listed if listed is not None else np.concatenate((src, dst))

        waits = self.events.pending(both()) if len(self.events) else []
        event = self.copier.copy(
            "d2d", self.base_address, src, self.base_address, dst, self.page_bytes, waits
        )
        if event is not None:
            self.events.set(both(), event)
            self.fence_current(event)

    def fence_current(self, event: Any) -> None:
        """Order the current stream after ``event`` (a copy into this pool); a no-op in a shared
        pool, whose users wait on the host (:meth:`wait_ready`)."""
        if not self.shared:
            self._torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Block until every copy into or out of this pool completed."""
        self.copier.synchronize()
        self.events.wait_all()

    def close(self) -> None:
        """Wait for pending copies, then free the device memory. Views taken earlier are invalid."""
        if self._closed:
            return
        super().close()
        try:
            self.copier.close()
            self.events.wait_all()
            with torch_errors("synchronize before freeing the GPU tier"):
                self._torch.cuda.synchronize(self.device)
        finally:
            self.tensor = self._torch.empty((0, self.page_bytes), dtype=self._torch.uint8, device=self.device)
            self._storage = None
            if self.arena is not None:
                self.arena.close()

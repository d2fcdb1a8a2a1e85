"""BlockCopier: whole blocks between a vLLM engine's per-layer KV views and raykv page rows.

Pages are laid out as :func:`~raykv.integrations.vllm.layout.engine_layout` says: ``token_major``
("k" and "v" of ``[tokens, heads, head_size]`` per layer) or ``engine_native`` (the CPU
backend's block bytes verbatim). Which backend stored the engine's blocks, and how, is a
:class:`~raykv.integrations.vllm.kv_blocks.BlockFormat`; every copy goes through the logical
shape of the engine's views, so any physical order (vLLM's ``KVCacheLayout``) is handled and a
token-major page is byte-identical whichever backend wrote it.

Copies are batched: per layer one gather (``index_select`` over the block ids, or a slice when
the ids are one run) and one copy per page region; loads write back with one scatter per layer
(``index_copy_``; numpy fancy assignment for CPU engines, whose torch scatter is slower than
a memcpy per block). For an engine on an accelerator the page rows go through a staging area:
chunks of at most ``chunk_bytes`` of rows in a device buffer, and, unless the rows themselves are
pinned (page-locked, or registered with ``cudaHostRegister``: then the copies DMA them directly),
in a pinned host buffer; two of each so that the host copy of one chunk overlaps the transfer of
the other; one host-to-device copy per chunk for a load, one device-to-host copy per chunk for a
save. Both
calls return after the engine's blocks (load) or the rows (save) are written.

torch is imported inside functions only; this module never imports vllm or ray.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv import ConfigError, InvalidArgumentError, KVLayout
from raykv.core.config import BufferRegion
from raykv.core.tiers.cuda_blocks import BlockKernel, PartGeometry, block_kernel
from raykv.core.tiers.cuda_calls import calls, current_stream
from raykv.integrations.vllm.kv_blocks import BlockFormat, detect_format, engine_blocks
from raykv.integrations.vllm.layout import ENGINE_TENSOR_DTYPES, MLA_ROLE, NATIVE_ROLE, is_latent

CHUNK_BYTES = 64 << 20


class BlockCopier:
    """Copies whole blocks between a vLLM engine's per-layer KV tensors and raykv page rows.

    ``kv_caches`` maps layer names to the views vLLM registers (``register_kv_caches``);
    ``names`` gives layout order (from :func:`~raykv.integrations.vllm.layout.engine_layout`).
    ``kv_cache_layout`` names the block format (:data:`~raykv.integrations.vllm.kv_blocks.KV_CACHE_LAYOUTS`);
    None: the tensors' strides decide, ConfigError when they allow more than one. ``layers``:
    the layout's layer ids ``names`` are (default: every layer): a copier of some layers reads and
    writes only their regions of a page (:class:`~raykv.integrations.vllm.groups.GroupedCopier`
    keeps one per KV cache group).
    InvalidArgumentError when a layer is missing or its tensor does not fit the layout (the
    message names the layer and its shape); ConfigError for ``engine_native`` pages of a
    backend other than the CPU one.
    """

    def __init__(
        self,
        layout: KVLayout,
        names: Sequence[str],
        kv_caches: Mapping[str, Any],
        kv_cache_layout: str | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        use_kernel: bool = True,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.layout = layout
        self.page_bytes = layout.page_bytes
        ids = layout.layer_ids if layers is None else tuple(layers)
        if not ids or any(i not in layout.layer_ids for i in ids):
            raise InvalidArgumentError("layers", f"{ids} are not layers of the layout {layout.layer_ids}")
        if len(names) != len(ids):
            raise InvalidArgumentError("kv_caches", f"{len(names)} layers for a layout of {len(ids)}")
        self.native = layout.roles(ids[0]) == (NATIVE_ROLE,)
        latent = is_latent(layout)
        roles = (NATIVE_ROLE,) if self.native else (MLA_ROLE,) if latent else ("k", "v")
        self._regions = [tuple(layout.buffer_region(i, r) for r in roles) for i in ids]
        tensors = [_tensor_of(kv_caches, name) for name in names]
        if latent != (kv_cache_layout == "mla") and kv_cache_layout is not None:
            raise ConfigError(
                "kv_cache_layout",
                f"{kv_cache_layout!r} for {'MLA' if latent else 'key and value'} pages (MLA pages "
                "go with the 'mla' layout only)",
            )
        self.format = _one_format(names, tensors, "mla" if latent else kv_cache_layout)
        self.heads, self.head_size = self._head_dims(tensors[0])
        self._blocks = [self._layer_blocks(*layer) for layer in zip(names, tensors, self._regions)]
        self.num_blocks = int(self._blocks[0].shape[0])
        if any(int(b.shape[0]) != self.num_blocks for b in self._blocks):
            raise InvalidArgumentError("kv_caches", "layers with different block counts")
        self.device = tensors[0].device
        if any(t.device != self.device for t in tensors):
            raise InvalidArgumentError("kv_caches", "layers on different devices")
        self._block_shape = tuple(self._blocks[0].shape[1:])
        self._engine_parts = [self._parts(b) for b in self._blocks]
        self._page_shape = tuple(self._engine_parts[0][0].shape[1:])
        self._dtype = tensors[0].dtype
        self._np_blocks = [_numpy_rows(b) for b in self._blocks] if self.device.type == "cpu" else None
        self.verbatim = self._verbatim()
        self._chunk = max(1, chunk_bytes // self.page_bytes)
        self._scratch: Any = None
        self._staging = None
        self.kernel: BlockKernel | None = None
        if self.device.type != "cpu":
            self._staging = _Staging(self.device, self.page_bytes, self._chunk)
            self.kernel = self._block_kernel() if use_kernel else None

    def _block_kernel(self) -> BlockKernel | None:
        """The one-launch block copy kernel for these tensors (token-major pages on CUDA), or
        None (torch copies) where it does not apply."""
        if self.native or self.device.type != "cuda":
            return None
        parts = [part for layer in self._engine_parts for part in layer]
        offsets = [region.offset for layer in self._regions for region in layer]
        return block_kernel(self.device, PartGeometry.of_parts(parts, offsets))

    # ---- construction ------------------------------------------------------------------------
    def _head_dims(self, tensor: Any) -> tuple[int, int]:
        """(heads, head_size) the layout describes (the native layout only has their product, so
        the engine's tensor splits it)."""
        spec = self._regions[0][0].spec
        if not self.native:
            return int(spec.shape[0]), int(spec.shape[1])
        heads, head = int(tensor.shape[1]), int(tensor.shape[-1]) // 2
        if 2 * heads * head != spec.shape[0]:
            raise InvalidArgumentError("kv_caches", f"{tuple(tensor.shape)} does not fit the native layout")
        return heads, head

    def _layer_blocks(self, name: str, tensor: Any, regions: tuple[BufferRegion, ...]) -> Any:
        dtype = regions[0].spec.dtype
        if str(tensor.dtype) not in ENGINE_TENSOR_DTYPES.get(dtype, (f"torch.{dtype}",)):
            raise InvalidArgumentError("kv_caches", f"{name}: {tensor.dtype} for a layout of {dtype}")
        tpb = self.layout.tokens_per_block
        blocks = engine_blocks(
            name, tensor, tpb, self.heads, self.head_size, self.format.cells(self.head_size)
        )
        for part, region in zip(self._parts(blocks[:1]), regions):
            if part[0].numel() * part.element_size() != region.nbytes:
                raise InvalidArgumentError("kv_caches", f"{name}: {tuple(tensor.shape)} does not fit")
        return blocks

    def _verbatim(self) -> bool:
        """Whether, on a CPU engine, every layer's page regions are its blocks' bytes verbatim:
        the regions follow one another and cover a block exactly, and the format's view of a
        block lists its bytes in memory order (engine_native pages; an MLA engine's one-head
        latent blocks). Checked once on a random probe block: then loads assign whole blocks."""
        import torch

        if self._np_blocks is None or any(b is None for b in self._np_blocks):
            return False
        if self.native:
            return True
        first = self._np_blocks[0]
        assert first is not None
        block_bytes = int(first.shape[1])
        for regions in self._regions:
            ends = [r.offset + r.nbytes for r in regions]
            if ends[-1] - regions[0].offset != block_bytes or any(
                r.offset != end for r, end in zip(regions[1:], ends)
            ):
                return False
        probe = np.random.default_rng(7).integers(0, 256, (1, self.page_bytes), dtype=np.uint8)
        block = torch.empty((1, *self._block_shape), dtype=self._dtype)
        for part, region in zip(self._parts(block), self._regions[0]):
            part.copy_(self._page(_as_tensor(probe), region))
        start = self._regions[0][0].offset
        written = block.reshape(1, -1).view(torch.uint8).numpy()
        return bool(np.array_equal(written[0], probe[0, start : start + block_bytes]))

    def shared_segments(self) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]] | None:
        """For a CPU engine whose pages are its blocks verbatim (:attr:`verbatim`): the memory
        ranges its KV tensors live in (``[(address, bytes), ...]``, each storage once) and the
        segments a page is made of (``[(address of block 0's bytes, block stride, bytes), ...]``
        in page order), as :class:`raykv.transfer.kv_share.engine.SharedKV` takes them. None
        where a page is not its layers' blocks back to back from byte 0."""
        if not self.verbatim or self._np_blocks is None:
            return None
        segments, memories, offset = [], {}, 0
        for blocks, np_blocks, regions in sorted(
            zip(self._blocks, self._np_blocks, self._regions), key=lambda t: t[2][0].offset
        ):
            assert np_blocks is not None
            if regions[0].offset != offset:
                return None
            length = int(np_blocks.shape[1])
            segments.append((int(np_blocks.ctypes.data), int(np_blocks.strides[0]), length))
            offset += length
            storage = blocks.untyped_storage()
            memories[int(storage.data_ptr())] = int(storage.nbytes())
        if offset != self.page_bytes:
            return None
        return sorted(memories.items()), segments

    def _parts(self, blocks: Any) -> tuple[Any, ...]:
        """The page regions' parts of ``blocks`` (``[m, r, H, N, C]``), in region order."""
        if self.native:
            return (self.format.native(blocks),)
        return self.format.kv(blocks, self.head_size)

    # ---- copies ------------------------------------------------------------------------------
    def save(self, block_ids: Sequence[int], rows: npt.NDArray[np.uint8]) -> None:
        """Write engine blocks ``block_ids`` into ``rows[:len(block_ids)]`` (writable uint8)."""

        ids = self._check(rows, block_ids)
        pending: tuple[_Slot, npt.NDArray[np.uint8], bool] | None = None
        for i, (lo, hi) in enumerate(self._chunks(len(ids))):
            slot = self._staging.slot(i, hi - lo) if self._staging is not None else None
            out = slot.dev[: hi - lo] if slot is not None else _as_tensor(rows[lo:hi])
            if self.kernel is not None:
                limits = (hi - lo, self.num_blocks)
                self.kernel.copy(int(out.data_ptr()), self.page_bytes, None, ids[lo:hi], False, limits)
            else:
                self._read_blocks(self._pick(ids[lo:hi]), out)
            if slot is not None:
                direct = slot.download(hi - lo, rows[lo:hi])
                if pending is not None:
                    pending[0].finish(pending[1], pending[2])
                pending = (slot, rows[lo:hi], direct)
        if pending is not None:
            pending[0].finish(pending[1], pending[2])

    def _read_blocks(self, pick: Any, out: Any) -> None:
        """Write the engine blocks ``pick`` (:meth:`_pick`) of every layer into page rows ``out``
        (uint8 ``[n, page_bytes]``), with torch: one gather per layer and region."""
        import torch

        for parts, regions in zip(self._engine_parts, self._regions):
            for part, region in zip(parts, regions):
                page = self._page(out, region)
                if isinstance(pick, slice):
                    page.copy_(part[pick])
                else:  # straight into the page rows (strided out), one pass
                    torch.index_select(part, 0, pick[0], out=page)

    def load(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[int]) -> None:
        """Write ``rows[i]`` into engine block ``block_ids[i]`` for every i."""
        ids = self._check(rows, block_ids)
        for i, (lo, hi) in enumerate(self._chunks(len(ids))):
            if self._staging is not None:
                src = self._staging.slot(i, hi - lo).upload(rows[lo:hi])
            else:
                src = _as_tensor(rows[lo:hi])
            self._write_blocks(ids[lo:hi], src)
        if self._staging is not None:
            self._staging.wait()

    def load_device(self, pages: Any, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Write page ``pages[slots[i]]`` into engine block ``block_ids[i]`` for every i, device
        to device: ``pages`` is a uint8 ``[num_pages, page_bytes]`` tensor on the engine's device
        (a CacheWorker's GPU tier mapped into this process, :mod:`raykv.transfer.paths.gpu_land`).
        With the block kernel, one launch whose table is packed straight from ``slots`` and
        ``block_ids``; otherwise per chunk one gather of the pages (none when the slots are one
        run) and one scatter per layer. Returns once the engine's blocks are written.
        InvalidArgumentError, with nothing written, when ``pages`` is not such a tensor or a
        slot or block id is out of range."""
        import torch

        if not (
            isinstance(pages, torch.Tensor)
            and pages.dtype == torch.uint8
            and pages.dim() == 2
            and pages.shape[1] == self.page_bytes
            and pages.device == self.device
        ):
            raise InvalidArgumentError("pages", f"need uint8 [n, {self.page_bytes}] on {self.device}")
        if self.kernel is not None and pages.stride() == (self.page_bytes, 1):
            if len(slots) != len(block_ids):
                raise InvalidArgumentError("slots", f"need {len(block_ids)} slots, got {len(slots)}")
            stream = current_stream(self.device.index or 0)
            limits = (len(pages), self.num_blocks)  # checked before anything is enqueued
            self.kernel.copy(int(pages.data_ptr()), self.page_bytes, slots, block_ids, True, limits, stream)
            calls().stream_synchronize(stream)
            return
        ids = self._check_ids(block_ids)
        at = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(at) != len(ids) or (len(at) and (at.min() < 0 or at.max() >= len(pages))):
            raise InvalidArgumentError("slots", f"need {len(ids)} slots in 0..{len(pages) - 1}")
        for i, (lo, hi) in enumerate(self._chunks(len(ids))):
            run = self._pick(at[lo:hi])
            if isinstance(run, slice):
                src = pages[run]
            else:
                out = self._staging.slot(i, hi - lo).dev[: hi - lo] if self._staging is not None else None
                src = torch.index_select(pages, 0, run[0], out=out)
            self._write_blocks(ids[lo:hi], src)
        if self._staging is not None:
            self._staging.wait()

    def _write_blocks(self, ids: npt.NDArray[np.int64], src: Any) -> None:
        """Write page rows ``src`` (uint8 ``[n, page_bytes]`` on the engine's device) into the
        engine blocks ``ids`` of every layer: one launch of the block kernel, else with torch
        (one scatter per layer and region)."""
        if self.kernel is not None and src.is_contiguous():
            limits = (len(src), self.num_blocks)
            self.kernel.copy(int(src.data_ptr()), self.page_bytes, None, ids, True, limits)
            return
        pick = self._pick(ids)
        for layer, regions in enumerate(self._regions):
            if isinstance(pick, slice):
                for part, region in zip(self._engine_parts[layer], regions):
                    part[pick].copy_(self._page(src, region))
            else:
                self._scatter(layer, pick, src)

    def _scatter(self, layer: int, pick: tuple[Any, npt.NDArray[np.int64]], src: Any) -> None:
        """Write page rows ``src`` into the layer's blocks ``pick``: ``index_copy_`` per region,
        or for a CPU engine (whose torch scatter is slower than a memcpy per block) numpy fancy
        assignment of whole blocks, through a scratch buffer in block order unless the page
        regions are the block's bytes verbatim (:attr:`verbatim`)."""
        import torch

        regions = self._regions[layer]
        whole = self._np_blocks[layer] if self._np_blocks is not None else None
        if whole is None:
            for part, region in zip(self._engine_parts[layer], regions):
                part.index_copy_(0, pick[0], self._page(src, region))
        elif self.verbatim:
            start = regions[0].offset
            whole[pick[1]] = src.numpy()[:, start : start + whole.shape[1]]
        else:
            scratch = self._scratch_rows(len(pick[1]))
            for part, region in zip(self._parts(scratch), regions):
                part.copy_(self._page(src, region))
            whole[pick[1]] = scratch.reshape(len(scratch), -1).view(torch.uint8).numpy()

    def _check(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        ids = self._check_ids(block_ids)
        if rows.ndim != 2 or rows.shape[1] != self.page_bytes or len(rows) < len(ids):
            raise InvalidArgumentError("rows", f"need {len(ids)} rows of {self.page_bytes} bytes")
        return ids

    def _check_ids(self, block_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidArgumentError("block_ids", f"block ids must be in 0..{self.num_blocks - 1}")
        return ids

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(lo, min(n, lo + self._chunk)) for lo in range(0, n, self._chunk)]

    def _pick(self, ids: npt.NDArray[np.int64]) -> Any:
        """A slice when ``ids`` are one run of consecutive blocks, else ``(torch ids on the
        engine's device, numpy ids)``."""
        import torch

        first, last = int(ids[0]), int(ids[-1])
        if last - first == len(ids) - 1 and (len(ids) < 3 or bool((np.diff(ids) == 1).all())):
            return slice(first, last + 1)
        return torch.from_numpy(ids).to(self.device), ids

    def _page(self, rows: Any, region: BufferRegion) -> Any:
        """``region`` of uint8 ``rows`` (``[n, page_bytes]``) as ``[n, *page_shape]`` values."""
        raw = rows[:, region.offset : region.offset + region.nbytes]
        return raw.view(self._dtype).view(len(rows), *self._page_shape)

    def _scratch_rows(self, n: int) -> Any:
        """``[n, *block_shape]`` of the engine's dtype and device (reused)."""
        import torch

        if self._scratch is None or len(self._scratch) < n:
            shape = (max(n, min(self._chunk, 2 * n)), *self._block_shape)
            self._scratch = torch.empty(shape, dtype=self._dtype, device=self.device)
        return self._scratch[:n]


class _Slot:
    """One chunk's staging: a host buffer (pinned on CUDA) and a device buffer of ``cap`` rows."""

    def __init__(self, device: Any, page_bytes: int, cap: int) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.device = device
        self.cap = cap
        self.host = torch.empty((cap, page_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros((cap, page_bytes), dtype=torch.uint8, device=device)
        self.event = torch.cuda.Event() if self.cuda else None
        self._used = False

    def _ready(self) -> None:
        """Wait until the last transfer through the host buffer is done."""
        if self.event is not None and self._used:
            self.event.synchronize()

    def _sent(self) -> None:
        self._used = True
        if self.event is not None:
            import torch

            self.event.record(torch.cuda.current_stream(self.device))

    def upload(self, rows: npt.NDArray[np.uint8]) -> Any:
        """``rows`` on the device (``[n, page_bytes]``): straight from ``rows`` when they are
        pinned (page-locked or registered with CUDA), else through the host buffer."""
        n = len(rows)
        source = _pinned_tensor(rows) if self.cuda else None
        if source is None:
            self._ready()
            np.copyto(self.host_np[:n], rows)
            source = self.host[:n]
        self.dev[:n].copy_(source, non_blocking=self.cuda)
        self._sent()
        return self.dev[:n]

    def download(self, n: int, rows: npt.NDArray[np.uint8]) -> bool:
        """Start copying the device buffer's first ``n`` rows to the host: straight into
        ``rows`` when they are pinned (True: nothing left for :meth:`finish` but the wait), else
        into the host buffer."""
        target = _pinned_tensor(rows) if self.cuda else None
        direct = target is not None
        if target is None:
            self._ready()
            target = self.host[:n]
        target.copy_(self.dev[:n], non_blocking=self.cuda)
        self._sent()
        return direct

    def finish(self, rows: npt.NDArray[np.uint8], direct: bool) -> None:
        """Wait for :meth:`download`; unless it went straight to ``rows``, copy its rows there."""
        self._ready()
        if not direct:
            np.copyto(rows, self.host_np[: len(rows)])


class _Staging:
    """Two :class:`_Slot` s, alternating by chunk, (re)allocated to the largest chunk seen."""

    def __init__(self, device: Any, page_bytes: int, max_rows: int) -> None:
        self.device = device
        self.page_bytes = page_bytes
        self.max_rows = max_rows
        self._slots: list[_Slot | None] = [None, None]

    def slot(self, i: int, n: int) -> _Slot:
        """The slot of chunk ``i``, with room for ``n`` rows."""
        have = self._slots[i % 2]
        if have is None or have.cap < n:
            cap = max(n, min(self.max_rows, 2 * have.cap if have is not None else n))
            if have is not None:
                have._ready()
            have = self._slots[i % 2] = _Slot(self.device, self.page_bytes, cap)
        return have

    def wait(self) -> None:
        """Wait for every copy queued on the device's current stream."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _tensor_of(kv_caches: Mapping[str, Any], name: str) -> Any:
    tensor = kv_caches.get(name)
    if tensor is None:
        raise InvalidArgumentError("kv_caches", f"no KV tensor for layer {name!r}")
    return tensor


def _one_format(names: Sequence[str], tensors: Sequence[Any], kv_cache_layout: str | None) -> BlockFormat:
    formats = {id(f): f for f in (detect_format(n, t, kv_cache_layout) for n, t in zip(names, tensors))}
    if len(formats) != 1:
        raise InvalidArgumentError("kv_caches", "layers whose strides allow different block formats")
    return next(iter(formats.values()))


def _as_tensor(rows: npt.NDArray[np.uint8]) -> Any:
    import torch

    with warnings.catch_warnings():  # read-only rows (a peer's mapped tier) are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)


def _pinned_tensor(rows: npt.NDArray[np.uint8]) -> Any:
    """``rows`` as a tensor when their memory is pinned (page-locked by torch or registered with
    ``cudaHostRegister``), so a device copy may DMA it directly; else None."""
    tensor = _as_tensor(rows)
    return tensor if tensor.is_pinned() else None


def is_pinned(rows: npt.NDArray[np.uint8]) -> bool:
    """Whether device copies of ``rows`` DMA them directly (their memory is page-locked by
    torch or registered with CUDA); False without CUDA."""
    return _pinned_tensor(rows) is not None


def _numpy_rows(blocks: Any) -> npt.NDArray[np.uint8] | None:
    """A CPU engine's blocks as a writable numpy ``[num_blocks, block_bytes]`` uint8 view, or
    None when a block is not one contiguous run of memory."""
    import torch

    try:
        return blocks.view(len(blocks), -1).view(torch.uint8).numpy()  # type: ignore[no-any-return]
    except RuntimeError:
        return None

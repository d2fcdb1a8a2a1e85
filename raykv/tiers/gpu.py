"""GPU tier: page slots in one device tensor (torch), indexable by page id.

Layout: ``self.tensor`` is uint8 of shape ``[num_slots, page_bytes]`` on ``cuda:device``; a page id
is a row. :meth:`buffer_view` gives the typed ``[tokens_per_block, *shape]`` view of one (layer,
role) buffer of a page and :meth:`layer_view` the strided ``[num_slots, tokens_per_block, *shape]``
view of one buffer across all pages, which an attention kernel indexes by page id.

This module imports torch lazily and only when a GPU tier is configured; machines without CUDA
never touch it. (The CUDA virtual-memory pool and the asynchronous copy engine are the GPU-tier
issue's work; this pool is the plain-allocation version of the same interface.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.config import KVLayout, TierConfig
from raykv.errors import CudaError, OutOfMemoryError
from raykv.tiers.base import PagePool
from raykv.types import PageId, TierKind

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


class GpuPool(PagePool):
    """Pages in device memory. Raises OutOfMemoryError at construction if the GPU lacks room."""

    kind = TierKind.GPU

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        try:
            import torch
        except ImportError:
            raise CudaError("a GPU tier needs torch with CUDA", cuda_error="NO_TORCH") from None
        if not torch.cuda.is_available():
            raise CudaError("a GPU tier needs a CUDA device", cuda_error="cudaErrorNoDevice")
        self._torch = torch
        self.device = torch.device("cuda", config.device)
        free, _total = torch.cuda.mem_get_info(self.device)
        need = self.num_slots * self.page_bytes
        if need > free:
            raise OutOfMemoryError(
                f"GPU tier wants {need} bytes on {self.device}, only {free} free", tier="GPU"
            )
        self.tensor = torch.empty((self.num_slots, self.page_bytes), dtype=torch.uint8, device=self.device)

    def buffer_view(self, slot: PageId, layer_id: int, role: str) -> Any:
        """Typed torch view of one (layer, role) buffer of one page."""
        region = self.layout.buffer_region(layer_id, role)
        dtype = getattr(self._torch, TORCH_DTYPES[region.spec.dtype])
        raw = self.tensor[slot, region.offset : region.offset + region.nbytes]
        return raw.view(dtype).view(region.view_shape)

    def layer_view(self, layer_id: int, role: str) -> Any:
        """Strided view ``[num_slots, tokens_per_block, *shape]`` of one buffer across pages."""
        region = self.layout.buffer_region(layer_id, role)
        dtype = getattr(self._torch, TORCH_DTYPES[region.spec.dtype])
        raw = self.tensor[:, region.offset : region.offset + region.nbytes]
        return raw.view(dtype).view(self.num_slots, *region.view_shape)

    def page(self, slot: PageId) -> Any:
        return self.tensor[slot]

    def read_pages(self, slots: list[PageId], out: npt.NDArray[np.uint8]) -> None:
        if not slots:
            return
        torch = self._torch
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        host = torch.from_numpy(out)
        host.copy_(self.tensor.index_select(0, idx))

    def write_pages(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> None:
        if not slots:
            return
        torch = self._torch
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        src = torch.from_numpy(np.ascontiguousarray(data)).to(self.device, non_blocking=False)
        self.tensor.index_copy_(0, idx, src)

    def close(self) -> None:
        super().close()
        self.tensor = self._torch.empty(0, dtype=self._torch.uint8, device=self.device)

"""Host tier: one numpy array of page slots (pinned through torch when a GPU tier exists)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.config import DTYPES, KVLayout, TierConfig
from raykv.errors import OutOfMemoryError
from raykv.tiers.base import PagePool
from raykv.types import PageId, TierKind

log = logging.getLogger(__name__)


class HostPool(PagePool):
    """Pages live in ``self.array`` (uint8, shape [num_slots, page_bytes]).

    ``pin`` asks for page-locked memory through torch (only meaningful with CUDA); when pinning is
    impossible the pool falls back to pageable memory and logs it.
    """

    kind = TierKind.HOST

    def __init__(self, config: TierConfig, layout: KVLayout, pin: bool = False) -> None:
        super().__init__(config, layout)
        self.pinned = False
        self._torch_buffer: Any = None
        self.array = self._allocate(pin)

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
        if slots:
            np.take(self.array, slots, axis=0, out=out)

    def write_pages(self, slots: list[PageId], data: npt.NDArray[np.uint8]) -> None:
        if slots:
            self.array[slots] = data

    def close(self) -> None:
        super().close()
        self._torch_buffer = None

"""GroupedCopier: whole pages for an engine whose layers sit in several KV cache groups.

vLLM's hybrid KV cache manager gives each group of layers (full attention, sliding-window
attention) its own block table over one shared block pool, so one raykv page (a block of tokens
of every layer) lives in a different engine block per group. A sliding-window group keeps only
the blocks its window still reads: its table holds vLLM's null block
(:data:`~raykv.integrations.vllm.plan.NULL_BLOCK`) at the positions before the window.

A load writes each group's layers of a page into that group's block and skips a group whose
block is null there (the engine does not read it); a save needs every group's block of every page
(a page is stored whole or not at all). One :class:`~raykv.integrations.vllm.copier.BlockCopier`
per group does the copies, over that group's layers only.

torch is imported inside the copiers only; this module never imports vllm or ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv import InvalidArgumentError, KVLayout
from raykv.integrations.vllm.copier import BlockCopier
from raykv.integrations.vllm.plan import NULL_BLOCK


class GroupedCopier:
    """Copies pages between page rows and an engine's blocks addressed per KV cache group.

    ``names`` are the engine's attention layers in layout order and ``groups[i]`` the group of
    ``names[i]`` (groups numbered 0.., each with at least one layer). Block ids are given per page
    as a tuple of one id per group (group 0 first), or, for one group, as plain ints.
    InvalidArgumentError (nothing copied) for ids of the wrong shape, a null block in a save, or
    an id out of range; the constructor raises what :class:`BlockCopier` raises.
    """

    def __init__(
        self,
        layout: KVLayout,
        names: Sequence[str],
        groups: Sequence[int],
        kv_caches: Mapping[str, Any],
        kv_cache_layout: str | None = None,
    ) -> None:
        if len(groups) != len(names) or not groups or set(groups) != set(range(max(groups) + 1)):
            raise InvalidArgumentError("groups", f"need one group 0..G-1 per layer, got {tuple(groups)}")
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.num_groups = max(groups) + 1
        ids = layout.layer_ids
        self.copiers: list[BlockCopier] = []
        self._regions: list[list[tuple[int, int]]] = []  # per group: (offset, end) of its page regions
        for g in range(self.num_groups):
            at = [i for i, group in enumerate(groups) if group == g]
            layers = [ids[i] for i in at]
            self.copiers.append(
                BlockCopier(layout, [names[i] for i in at], kv_caches, kv_cache_layout, layers=layers)
            )
            regions = [layout.buffer_region(i, r) for i in layers for r in layout.roles(i)]
            self._regions.append([(r.offset, r.offset + r.nbytes) for r in regions])
        self.device = self.copiers[0].device
        self.num_blocks = min(c.num_blocks for c in self.copiers)

    def _table(self, block_ids: Sequence[Any]) -> npt.NDArray[np.int64]:
        """``block_ids`` as an ``[n, groups]`` int64 array, every id checked before any copy."""
        table = np.asarray(block_ids, dtype=np.int64)
        if table.size == 0:  # no pages: nothing to copy
            return np.empty((0, self.num_groups), dtype=np.int64)
        if table.ndim == 1 and self.num_groups == 1:
            table = table.reshape(-1, 1)
        if table.ndim != 2 or table.shape[1] != self.num_groups:
            raise InvalidArgumentError(
                "block_ids", f"need one id per KV cache group ({self.num_groups}) for every page"
            )
        if table.size and (table.min() < 0 or table.max() >= self.num_blocks):
            raise InvalidArgumentError("block_ids", f"block ids must be in 0..{self.num_blocks - 1}")
        return table

    def _present(self, table: npt.NDArray[np.int64]) -> list[tuple[npt.NDArray[np.intp], list[int]]]:
        """Per group, the pages whose block there is not null and those blocks."""
        out = []
        for g in range(self.num_groups):
            at = np.flatnonzero(table[:, g] != NULL_BLOCK)
            out.append((at, table[at, g].tolist()))
        return out

    def load(self, rows: npt.NDArray[np.uint8], block_ids: Sequence[Any]) -> None:
        """Write ``rows[i]`` into page i's blocks, group by group (a null block: that group's
        layers of the page are skipped)."""
        table = self._table(block_ids)
        if rows.ndim != 2 or rows.shape[1] != self.page_bytes or len(rows) < len(table):
            raise InvalidArgumentError("rows", f"need {len(table)} rows of {self.page_bytes} bytes")
        for copier, (at, ids) in zip(self.copiers, self._present(table)):
            if ids:
                picked = rows[: len(table)] if len(at) == len(table) else rows[at]
                copier.load(picked, ids)

    def load_device(self, pages: Any, slots: Sequence[int], block_ids: Sequence[Any]) -> None:
        """Write page ``pages[slots[i]]`` into page i's blocks, group by group, device to device
        (:meth:`BlockCopier.load_device`; a null block skips that group's layers)."""
        table = self._table(block_ids)
        at_slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(at_slots) != len(table):
            raise InvalidArgumentError("slots", f"need {len(table)} slots, got {len(at_slots)}")
        if len(at_slots) and (at_slots.min() < 0 or at_slots.max() >= len(pages)):
            raise InvalidArgumentError("slots", f"slots must be in 0..{len(pages) - 1}")
        for copier, (at, ids) in zip(self.copiers, self._present(table)):
            if ids:
                copier.load_device(pages, at_slots[at].tolist(), ids)

    def save(self, block_ids: Sequence[Any], rows: npt.NDArray[np.uint8]) -> None:
        """Write page i's blocks of every group into ``rows[i]`` (writable uint8): group 0's
        copier writes the rows, each other group's its own regions through a scratch copy.
        InvalidArgumentError when a page has a null block in some group."""
        table = self._table(block_ids)
        if (table == NULL_BLOCK).any():
            raise InvalidArgumentError("block_ids", "a page with a null block cannot be saved whole")
        n = len(table)
        if n == 0:
            return
        self.copiers[0].save(table[:, 0].tolist(), rows)
        scratch = np.empty((n, self.page_bytes), dtype=np.uint8)
        for g in range(1, self.num_groups):
            self.copiers[g].save(table[:, g].tolist(), scratch)
            for lo, hi in self._regions[g]:
                rows[:n, lo:hi] = scratch[:, lo:hi]

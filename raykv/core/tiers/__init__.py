"""Page pools per tier: host (numpy, pinned with CUDA), disk (page-aligned file), GPU (torch)."""

from __future__ import annotations

from raykv.core.config import KVLayout, TierConfig
from raykv.core.tiers.base import PagePool
from raykv.core.tiers.disk import DiskPool
from raykv.core.tiers.host import HostPool
from raykv.core.types import TierKind

__all__ = ["DiskPool", "HostPool", "PagePool", "make_pool"]


def make_pool(
    config: TierConfig, layout: KVLayout, pin_host: bool = False, verify_disk: bool = True
) -> PagePool:
    """Build the pool for one tier config (the GPU pool imports torch only when asked for);
    ``verify_disk``: a disk tier checksums its pages (:class:`DiskPool`)."""
    if config.kind is TierKind.HOST:
        return HostPool(config, layout, pin=pin_host and config.pin_memory)
    if config.kind is TierKind.DISK:
        return DiskPool(config, layout, verify=verify_disk)
    from raykv.core.tiers.gpu import GpuPool

    return GpuPool(config, layout)

"""raykv: a distributed KV cache for LLM serving.

This package is the pure core: it never imports ray. ``raykv.start`` and ``raykv.connect`` (the
cluster entry points) live in ``actors.cache.cluster`` and are re-exported lazily once that module exists.
"""

from __future__ import annotations

from typing import Any

from raykv.core.config import BufferSpec, CacheConfig, KVLayout, LayerSpec, TierConfig
from raykv.core.errors import (
    CapacityError,
    ConfigError,
    CudaError,
    ImportRejectedError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    OutOfMemoryError,
    OutOfPagesError,
    PageCorruptError,
    RayKVError,
    ResourceBusyError,
    RoleNotFoundError,
    StateError,
    TransferError,
    UnavailableError,
)
from raykv.core.events import AllCleared, BlockRemoved, BlockStored, BlockTierChanged, CacheEvent
from raykv.core.eviction import EvictionPolicy, PriorityLRU
from raykv.core.keys import MultimodalItem, ReuseScope, block_keys, lora_id_from_name
from raykv.core.kvcache import KvCache, Status
from raykv.core.manager import CacheManager
from raykv.core.records import CommittedBlockInfo, ExportedBlock, ImportResult, ProbeResult, page_checksum
from raykv.core.stats import CacheStats, RequestStats, StatsDelta
from raykv.core.types import BlockKey, PageId, Priority, RequestId, TierKind, TierLevel, TokenId, WorkerId
from raykv.testing import ContentOracle

__version__ = "0.1.0"

__all__ = [
    "AllCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "BlockTierChanged",
    "BufferSpec",
    "CacheConfig",
    "CacheEvent",
    "CacheManager",
    "CacheStats",
    "CapacityError",
    "CommittedBlockInfo",
    "ConfigError",
    "ContentOracle",
    "CudaError",
    "EvictionPolicy",
    "ExportedBlock",
    "ImportRejectedError",
    "ImportResult",
    "IntegrityError",
    "InvalidArgumentError",
    "KVLayout",
    "KvCache",
    "LayerSpec",
    "MultimodalItem",
    "NotFoundError",
    "OutOfMemoryError",
    "OutOfPagesError",
    "PageCorruptError",
    "PageId",
    "Priority",
    "PriorityLRU",
    "ProbeResult",
    "RayKVError",
    "RequestId",
    "ResourceBusyError",
    "RequestStats",
    "ReuseScope",
    "RoleNotFoundError",
    "StateError",
    "StatsDelta",
    "Status",
    "TierConfig",
    "TierKind",
    "TierLevel",
    "TokenId",
    "TransferError",
    "UnavailableError",
    "WorkerId",
    "block_keys",
    "lora_id_from_name",
    "page_checksum",
]

_LAZY = {"start": "actors.cache.cluster", "connect": "actors.cache.cluster"}


def __getattr__(name: str) -> Any:
    """Lazily re-export the cluster entry points without importing ray at ``import raykv``."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'raykv' has no attribute {name!r}")
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise AttributeError(f"raykv.{name} needs {module_name} ({exc})") from None
    return getattr(module, name)

"""Frozen, validated configuration.

Every dataclass validates in ``__post_init__``, so ``dataclasses.replace`` validates again. Errors
are :class:`raykv.core.errors.ConfigError` (a ValueError) naming the offending field.

Page layout (bytes of one page, which holds one block of ``tokens_per_block`` tokens):
layers in order; inside a layer, its buffers in order; each buffer region is
``tokens_per_block * prod(shape) * itemsize`` bytes, padded up to a multiple of 16 bytes, laid out
as ``[tokens_per_block, *shape]`` (row-major). ``KVLayout.buffer_region`` gives offsets.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Final

from raykv.core.errors import ConfigError, RoleNotFoundError
from raykv.core.types import TierKind

REGION_ALIGN: Final = 16
DISK_ALIGN: Final = 4096

# name -> (itemsize, numpy dtype used for host views; raw unsigned where numpy lacks the type)
DTYPES: Final[dict[str, tuple[int, str]]] = {
    "float32": (4, "float32"),
    "float16": (2, "float16"),
    "bfloat16": (2, "uint16"),
    "float8_e4m3fn": (1, "uint8"),
    "float8_e5m2": (1, "uint8"),
    "int8": (1, "int8"),
    "uint8": (1, "uint8"),
    "int32": (4, "int32"),
}


def _positive_int(field_name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field_name, f"must be a positive int, got {value!r}")
    return value


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


@dataclass(frozen=True)
class BufferSpec:
    """One named buffer of a layer (e.g. role "k", "v", "k_scale", "index_k").

    ``shape`` is the per-token shape (e.g. ``(num_kv_heads, head_dim)``) and ``dtype`` one of
    :data:`DTYPES`.
    """

    role: str
    shape: tuple[int, ...]
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ConfigError("role", f"must be a non-empty str, got {self.role!r}")
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else (self.shape,)
        if not shape:
            raise ConfigError("shape", "must have at least one dimension")
        for dim in shape:
            _positive_int("shape", dim)
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class LayerSpec:
    """The buffers of one layer; roles are unique within a layer."""

    layer_id: int
    buffers: tuple[BufferSpec, ...]

    def __post_init__(self) -> None:
        if isinstance(self.layer_id, bool) or not isinstance(self.layer_id, int):
            raise ConfigError("layer_id", f"must be an int, got {self.layer_id!r}")
        if self.layer_id < 0:
            raise ConfigError("layer_id", f"must be >= 0, got {self.layer_id}")
        buffers = tuple(self.buffers)
        if not buffers:
            raise ConfigError("buffers", f"layer {self.layer_id} has no buffers")
        if not all(isinstance(b, BufferSpec) for b in buffers):
            raise ConfigError("buffers", "every buffer must be a BufferSpec")
        roles = [b.role for b in buffers]
        if len(set(roles)) != len(roles):
            raise ConfigError("buffers", f"duplicate roles in layer {self.layer_id}: {roles}")
        object.__setattr__(self, "buffers", buffers)


@dataclass(frozen=True)
class BufferRegion:
    """Where one (layer, role) buffer lives inside a page."""

    layer_id: int
    spec: BufferSpec
    offset: int
    nbytes: int
    tokens_per_block: int

    @property
    def view_shape(self) -> tuple[int, ...]:
        return (self.tokens_per_block, *self.spec.shape)


@dataclass(frozen=True)
class KVLayout:
    """Layers x named buffers, and how many tokens one block (one page) holds."""

    layers: tuple[LayerSpec, ...]
    tokens_per_block: int
    _regions: dict[tuple[int, str], BufferRegion] = field(init=False, repr=False, compare=False, hash=False)
    _page_bytes: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _positive_int("tokens_per_block", self.tokens_per_block)
        layers = tuple(self.layers)
        if not layers:
            raise ConfigError("layers", "at least one layer is required")
        if not all(isinstance(layer, LayerSpec) for layer in layers):
            raise ConfigError("layers", "every layer must be a LayerSpec")
        ids = [layer.layer_id for layer in layers]
        if len(set(ids)) != len(ids):
            raise ConfigError("layers", f"duplicate layer ids: {ids}")
        object.__setattr__(self, "layers", layers)
        regions: dict[tuple[int, str], BufferRegion] = {}
        offset = 0
        for layer in layers:
            for buf in layer.buffers:
                nbytes = buf.bytes_per_token * self.tokens_per_block
                regions[(layer.layer_id, buf.role)] = BufferRegion(
                    layer.layer_id, buf, offset, nbytes, self.tokens_per_block
                )
                offset += _round_up(nbytes, REGION_ALIGN)
        object.__setattr__(self, "_regions", regions)
        object.__setattr__(self, "_page_bytes", offset)

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int = 16,
        dtype: str = "float16",
        extra: tuple[BufferSpec, ...] = (),
    ) -> KVLayout:
        """Build the usual layout: every layer has "k" and "v" of shape (heads, head_dim).

        ``extra`` buffers (quantization scales, sparse-attention index keys...) are added to every
        layer after K and V.
        """
        _positive_int("num_layers", num_layers)
        kv = (
            BufferSpec("k", (num_kv_heads, head_dim), dtype),
            BufferSpec("v", (num_kv_heads, head_dim), dtype),
        )
        layers = tuple(LayerSpec(i, kv + tuple(extra)) for i in range(num_layers))
        return cls(layers=layers, tokens_per_block=tokens_per_block)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: every buffer of every layer for one block."""
        return self._page_bytes

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(layer.layer_id for layer in self.layers)

    def roles(self, layer_id: int) -> tuple[str, ...]:
        """Roles of one layer, in page order. Raises RoleNotFoundError for an unknown layer."""
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return tuple(b.role for b in layer.buffers)
        raise RoleNotFoundError(f"layout has no layer {layer_id!r}", layer_id=layer_id, role=None)

    def buffer_region(self, layer_id: int, role: str) -> BufferRegion:
        """Offset, size and spec of one buffer inside a page.

        Raises RoleNotFoundError (a KeyError) when the layer does not have that role; every code
        path that looks up a (layer, role) goes through here.
        """
        try:
            return self._regions[(layer_id, role)]
        except (KeyError, TypeError):
            raise RoleNotFoundError(
                f"layout has no buffer with role {role!r} in layer {layer_id!r}",
                layer_id=layer_id,
                role=role,
            ) from None

    def regions(self) -> tuple[BufferRegion, ...]:
        """Every buffer region, in page order."""
        return tuple(self._regions.values())


def layout_difference(have: KVLayout, want: KVLayout) -> str:
    """The fields in which ``want`` differs from ``have``, as ``field have -> want`` phrases (at
    most three; "" when they are equal): tokens per block, layer count, then the
    first differing layer's buffers (roles, per-token shapes, dtypes)."""
    out = []
    if have.tokens_per_block != want.tokens_per_block:
        out.append(f"tokens_per_block {have.tokens_per_block} -> {want.tokens_per_block}")
    if len(have.layers) != len(want.layers):
        out.append(f"layers {len(have.layers)} -> {len(want.layers)}")
    for a, b in zip(have.layers, want.layers):
        if a.buffers == b.buffers:
            continue
        pairs = list(zip(a.buffers, b.buffers))
        if [x.role for x in a.buffers] != [y.role for y in b.buffers]:
            out.append(
                f"roles {'/'.join(x.role for x in a.buffers)} -> {'/'.join(y.role for y in b.buffers)}"
            )
        elif any(x.shape != y.shape for x, y in pairs):
            x, y = next((x, y) for x, y in pairs if x.shape != y.shape)
            out.append(f"{x.role} per token {list(x.shape)} -> {list(y.shape)}")
        if any(x.dtype != y.dtype for x, y in pairs):
            x, y = next((x, y) for x, y in pairs if x.dtype != y.dtype)
            out.append(f"dtype {x.dtype} -> {y.dtype}")
        break
    return ", ".join(out[:3])


@dataclass(frozen=True)
class TierConfig:
    """One storage tier.

    ``capacity_bytes`` is rounded down to whole pages by the manager (a tier smaller than one page
    is a ConfigError from CacheConfig). ``path`` is the disk tier's directory (None: a fresh
    temporary directory, removed on close); ``device`` is the CUDA device index of a GPU tier.
    ``shared`` (host tier only, default False) backs the host pages with a file under /dev/shm so
    that a peer process on the same node can map it read-only and copy leased pages directly
    (:mod:`raykv.transfer`); a shared host tier is never pinned.
    """

    kind: TierKind
    capacity_bytes: int
    path: str | None = None
    device: int = 0
    pin_memory: bool = True
    shared: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", TierKind.parse(self.kind))
        except ValueError as exc:
            raise ConfigError("kind", str(exc)) from None
        _positive_int("capacity_bytes", self.capacity_bytes)
        if self.path is not None and self.kind is not TierKind.DISK:
            raise ConfigError("path", f"only a disk tier takes a path, not {self.kind.name}")
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0:
            raise ConfigError("device", f"must be a CUDA device index >= 0, got {self.device!r}")
        if not isinstance(self.shared, bool):
            raise ConfigError("shared", f"must be a bool, got {self.shared!r}")
        if self.shared and self.kind is not TierKind.HOST:
            raise ConfigError("shared", f"only a host tier can be shared, not {self.kind.name}")
        if self.kind is TierKind.DISK and self.path is not None:
            _check_writable_dir(self.path)

    @classmethod
    def gpu(cls, capacity_bytes: int, device: int = 0) -> TierConfig:
        return cls(TierKind.GPU, capacity_bytes, device=device)

    @classmethod
    def host(cls, capacity_bytes: int, pin_memory: bool = True, shared: bool = False) -> TierConfig:
        return cls(TierKind.HOST, capacity_bytes, pin_memory=pin_memory, shared=shared)

    @classmethod
    def disk(cls, capacity_bytes: int, path: str | None = None) -> TierConfig:
        return cls(TierKind.DISK, capacity_bytes, path=path)

    def num_pages(self, page_bytes: int) -> int:
        """Whole pages that fit in ``capacity_bytes``."""
        return self.capacity_bytes // page_bytes


def _check_writable_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError("path", f"disk tier directory {path!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError("path", f"disk tier directory {path!r} is not writable: {exc}") from None


@dataclass(frozen=True)
class CacheConfig:
    """Everything a CacheManager needs.

    ``tiers`` are ordered warm to cold (GPU before host before disk), one per kind at most; the
    first is the top tier that engines read. ``max_util_for_resume`` in (0, 1]: ``resume()`` is
    refused when the top tier's pinned fraction would exceed it. ``max_events`` bounds the event
    queue (the oldest are dropped; event ids stay monotonic so consumers see the gap).
    ``verify_disk_checksums`` (default True): the disk tier keeps a CRC-32 of every page it writes
    and checks it on every read; a page that fails is never served (see ``docs/design.md``).
    ``max_blocks_per_salt`` (default None: no quota): at most this many committed blocks per salt
    (tenant; blocks with no salt are one group), counted over all tiers of the manager together;
    a salt over it drops its own least valuable blocks first, never another's
    (:mod:`raykv.core.quota`).
    """

    layout: KVLayout
    tiers: tuple[TierConfig, ...]
    max_util_for_resume: float = 1.0
    max_events: int = 100_000
    verify_disk_checksums: bool = True
    max_blocks_per_salt: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError("layout", "must be a KVLayout")
        tiers = tuple(self.tiers)
        if not tiers:
            raise ConfigError("tiers", "at least one tier is required")
        if not all(isinstance(t, TierConfig) for t in tiers):
            raise ConfigError("tiers", "every tier must be a TierConfig")
        kinds = [t.kind for t in tiers]
        if len(set(kinds)) != len(kinds):
            raise ConfigError("tiers", f"duplicate tier kinds: {[k.name for k in kinds]}")
        if kinds != sorted(kinds):
            raise ConfigError("tiers", "tiers must be ordered warm to cold: gpu, host, disk")
        object.__setattr__(self, "tiers", tiers)
        page = self.layout.page_bytes
        for tier in tiers:
            if tier.capacity_bytes < page:
                raise ConfigError(
                    "capacity_bytes",
                    f"{tier.kind.name} tier holds {tier.capacity_bytes} bytes, "
                    f"less than one page ({page} bytes)",
                )
        util = self.max_util_for_resume
        if isinstance(util, bool) or not isinstance(util, (int, float)):
            raise ConfigError("max_util_for_resume", f"must be a float, got {util!r}")
        if math.isnan(util) or not 0.0 < util <= 1.0:
            raise ConfigError("max_util_for_resume", f"must be in (0, 1], got {util!r}")
        _positive_int("max_events", self.max_events)
        if not isinstance(self.verify_disk_checksums, bool):
            raise ConfigError("verify_disk_checksums", f"must be a bool, got {self.verify_disk_checksums!r}")
        if self.max_blocks_per_salt is not None:
            _positive_int("max_blocks_per_salt", self.max_blocks_per_salt)

    @property
    def tokens_per_block(self) -> int:
        return self.layout.tokens_per_block

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one worker of this config holds: the pages of all its tiers together."""
        return sum(t.num_pages(self.layout.page_bytes) for t in self.tiers)

    def replace(self, **changes: object) -> CacheConfig:
        """``dataclasses.replace`` with validation (kept for discoverability)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

"""What a pull returns (:class:`PulledPages`) and what a client counts (:class:`ClientStats`)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.errors import InvalidArgumentError
from raykv.records import ExportedBlock
from raykv.transfer import wire
from raykv.types import BlockKey


@dataclass(frozen=True)
class PulledPages:
    """The pages of one pull, in request order (``data[i]`` is the page of ``keys[i]``).

    ``checksums`` are the sender's. ``verified``: this process compared every page with them
    (``pull(verify=False)`` leaves that to ``CacheManager.import_blocks``, which always does).
    """

    keys: tuple[BlockKey, ...]
    parent_keys: tuple[BlockKey, ...]
    parent_is_root: tuple[bool, ...]
    num_tokens: tuple[int, ...]
    checksums: tuple[int, ...]
    data: npt.NDArray[np.uint8]
    missing: tuple[BlockKey, ...]
    path: str
    seconds: float
    verified: bool = True

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def to_exported(self) -> list[ExportedBlock]:
        """The pages as ExportedBlock records, ready for ``CacheManager.import_blocks``."""
        return [
            ExportedBlock(k, p, r, n, c, self.data[i].tobytes())
            for i, (k, p, r, n, c) in enumerate(
                zip(self.keys, self.parent_keys, self.parent_is_root, self.num_tokens, self.checksums)
            )
        ]


@dataclass
class ClientStats:
    """Counters per path (``shm``/``ucx``), failures per reason, and each peer's last path."""

    pulls: collections.Counter[str] = field(default_factory=collections.Counter)
    pages: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    last_path: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts (counters become ``{key: count}``), for logs and Ray replies."""
        return {k: dict(v) for k, v in vars(self).items()}


def check_out(out: npt.NDArray[np.uint8] | None, rows: int, page_bytes: int) -> None:
    """ValueError unless ``out`` is None or can take ``rows`` pages of ``page_bytes``."""
    if out is None:
        return
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 2:
        raise InvalidArgumentError("out", "must be a 2-D uint8 numpy array")
    if out.shape[0] < rows or out.shape[1] != page_bytes:
        raise InvalidArgumentError(
            "out", f"needs at least {rows} rows of {page_bytes} bytes, has {out.shape}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("out", "must be writable and C-contiguous")


def merge(
    parts: list[tuple[wire.Header, npt.NDArray[np.uint8], list[int]]],
    keys: list[BlockKey],
    seconds: float,
    out: npt.NDArray[np.uint8] | None = None,
    verified: bool = True,
) -> PulledPages:
    """One PulledPages from the batches of a pull (``missing``: requested keys not found)."""
    headers = [h for h, _, _ in parts]
    found = [BlockKey(k) for h in headers for k in h.keys]
    have = set(found)
    if out is not None:
        data: npt.NDArray[np.uint8] | None = out[: len(found)]  # batches filled consecutive rows
    elif len(parts) == 1:
        data = parts[0][1]
    else:
        data = np.concatenate([d for _, d, _ in parts]) if parts else None
    page_bytes = headers[0].page_bytes if headers else 0
    return PulledPages(
        keys=tuple(found),
        parent_keys=tuple(BlockKey(p) for h in headers for p in h.parents),
        parent_is_root=tuple(r for h in headers for r in h.roots),
        num_tokens=tuple(t for h in headers for t in h.tokens),
        checksums=tuple(s for _, _, sums in parts for s in sums),
        data=data if data is not None else np.empty((0, page_bytes), dtype=np.uint8),
        missing=tuple(k for k in keys if k not in have),
        path=",".join(sorted({h.path for h in headers})) or "none",
        seconds=seconds,
        verified=verified,
    )

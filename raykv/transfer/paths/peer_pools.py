"""A page client's mappings of same-node owners' GPU tiers (the ``gpu_peer`` path's state; see
:mod:`raykv.transfer.paths.gpu_peer`). Kept apart so the client needs no CUDA import to hold one."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import raykv.transfer.net.wire as wire
from raykv.core.errors import StateError

if TYPE_CHECKING:
    from raykv.ipc import AttachedPool
    from raykv.transfer.paths.shm_read import DirectoryLookup


@dataclasses.dataclass(frozen=True)
class PoolInfo:
    """What a ``gpu_pool`` message says: the owner's export socket, device UUID and slots, and
    its slot directory (file and slots; None when it keeps none) for one-sided reads."""

    path: str
    uuid: str
    slots: int
    directory: str | None = None
    directory_slots: int = 0

    @classmethod
    def from_msg(cls, msg: dict[str, Any], rid: int) -> PoolInfo:
        msg = wire.expect_type(msg, "gpu_pool")
        if msg.get("id") != rid:
            raise wire.protocol_error("'gpu_pool' for another request")
        path, uuid, slots = (
            wire.field(msg, "path", str),
            wire.field(msg, "uuid", str),
            wire.field(msg, "slots", int),
        )
        if not (0 < len(path) <= 4096 and len(uuid) <= 128 and 0 < slots < (1 << 40)):
            raise wire.protocol_error("field of 'gpu_pool' out of range")
        directory = msg.get("dir")
        if directory is None:
            return cls(path, uuid, slots)
        dir_slots = wire.field(msg, "dir_slots", int)
        if not (isinstance(directory, str) and 0 < len(directory) <= 4096 and 0 < dir_slots < (1 << 40)):
            raise wire.protocol_error("field of 'gpu_pool' out of range")
        return cls(path, uuid, slots, directory, dir_slots)


class PeerPools:
    """A client's mappings of owners' GPU tiers, by export socket (one per owner and device).

    A mapping is replaced when the owner's pool has grown past it; replaced mappings stay mapped
    until :meth:`close` (a pull may still be copying from them)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, int], AttachedPool] = {}
        self._retired: list[AttachedPool] = []
        self._lock = threading.Lock()
        self.refused: set[tuple[str, int]] = set()
        """Peers (control endpoints) with no GPU path from here (their tier could not be mapped
        here, or they offer none or run on another node; an engine's landing finds that out):
        not asked again."""
        self.known: dict[tuple[str, int], PoolInfo] = {}
        """The last ``gpu_pool`` message of each peer (control endpoint) on this node."""
        self._readers: dict[str, DirectoryLookup | None] = {}

    def reader(self, info: PoolInfo, page_bytes: int) -> DirectoryLookup | None:
        """The owner's slot directory mapped read-only, for :func:`raykv.transfer.paths.shm_read.locate`
        (None when it keeps none or it cannot be mapped; never blocks beyond opening a file)."""
        if info.directory is None:
            return None
        if info.directory not in self._readers:
            from raykv.transfer.paths.shm_read import DirectoryLookup

            tier_path = info.directory.removesuffix(".dir")
            try:
                reader: DirectoryLookup | None = DirectoryLookup(tier_path, info.directory_slots, page_bytes)
            except (OSError, StateError):
                reader = None
            with self._lock:
                self._readers[info.directory] = reader
        return self._readers[info.directory]

    def cached(self, info: PoolInfo, device: int) -> AttachedPool | None:
        """The current mapping of ``info``'s pool on ``device`` if it covers every slot, else None
        (never blocks)."""
        have = self._maps.get((info.path, device))
        return have if have is not None and have.num_slots >= info.slots else None

    def get(self, info: PoolInfo, device: int) -> AttachedPool:
        """The mapping of ``info``'s pool on ``device`` (blocking: maps it when needed)."""
        from raykv.ipc import attach

        key = (info.path, device)
        with self._lock:
            have = self._maps.get(key)
            if have is not None and have.num_slots >= info.slots:
                return have
            fresh = attach(info.path, device=device)
            if have is not None:
                self._retired.append(have)
            self._maps[key] = fresh
            return fresh

    def close(self) -> None:
        with self._lock:
            for pool in [*self._maps.values(), *self._retired]:
                pool.close()
            for reader in self._readers.values():
                if reader is not None:
                    reader.close()
            self._maps.clear()
            self._retired.clear()
            self._readers.clear()
            self.known.clear()

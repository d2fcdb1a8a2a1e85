"""The ``shm_read`` path: same-node pulls with no request at all (one-sided reads).

After a client has once connected to a same-node page server that has a shared host tier, it maps
that tier and its slot directory (:mod:`raykv.tiers.shm_directory`) read-only. A later pull of
keys that are all bound in the directory is served in the calling thread: locate the slots, copy
the pages (one memcpy per run of consecutive slots), and check that every slot still holds its
key at the generation seen before the copy. Nothing is sent to the owner, so a small pull costs
about a memcpy instead of a network round trip. Anything else (a key not bound, a page moved or
evicted meanwhile, a machine whose memory ordering the directory does not support) makes the
client use the request paths (``shm``/``ucx``) as before; nothing half-read is ever returned.

For :meth:`raykv.transfer.PageClient.pull_land` the import reads the rows straight from the
mapping and its ``confirm`` (run after the rows are written, before any block is inserted)
re-checks the generations, so a page that changed during the import rejects it whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from raykv.errors import StateError, TransferError
from raykv.tiers import shm_directory
from raykv.transfer import wire
from raykv.transfer.landing import LeaseCheck
from raykv.transfer.results import PulledPages
from raykv.transfer.shm import ShmMapping, copy_rows
from raykv.types import BlockKey

PATH = "shm_read"


class LocalPeer:
    """A same-node peer's shared host tier and its directory, both mapped read-only.

    Raises TransferError(reason="shm") when either cannot be mapped."""

    def __init__(self, info: wire.ShmInfo) -> None:
        self.path = info.path
        self.mapping = ShmMapping(info.path, info.num_slots, info.page_bytes)
        try:
            self.directory = shm_directory.DirectoryReader(info.path, info.num_slots, info.page_bytes)
        except (OSError, StateError) as exc:
            self.mapping.close()
            raise TransferError(f"cannot map the peer's tier directory ({exc})", reason="shm") from None

    def close(self) -> None:
        self.directory.close()
        self.mapping.close()


def usable() -> bool:
    """Whether this machine may read one-sided (see :func:`raykv.tiers.shm_directory.supported`)."""
    return shm_directory.supported()


def read(
    peer: LocalPeer, keys: Sequence[BlockKey], out: npt.NDArray[np.uint8] | None = None
) -> PulledPages | None:
    """Copy the pages of ``keys`` out of ``peer`` into ``out`` (or a new array); None when any key
    is not bound or any page changed while it was copied (``out`` may then hold partial bytes).

    ``out``, when given, must have at least ``len(keys)`` rows of the peer's page size (the caller
    checks it: :func:`raykv.transfer.results.check_out`)."""
    start = time.perf_counter()
    located = peer.directory.locate(keys)
    if located is None:
        return None
    src, n = peer.mapping.array, len(keys)
    data = out[:n] if out is not None else np.empty((n, src.shape[1]), dtype=np.uint8)
    copy_located(src, located, data)
    if not peer.directory.unchanged(located, keys):
        return None
    return _pulled(keys, located, data, time.perf_counter() - start)


def copy_located(
    src: npt.NDArray[np.uint8], located: shm_directory.Located, out: npt.NDArray[np.uint8]
) -> None:
    """``out[i] = src[located.slots[i]]``: one memcpy for a run of slots (``located.first``; the
    directory has as many slots as the tier, so the run is within ``src``), else a gather."""
    first = located.first
    if first >= 0:
        np.copyto(out, src[first : first + len(out)])
    else:
        copy_rows(src, located.slots, out)


def view(peer: LocalPeer, keys: Sequence[BlockKey]) -> tuple[PulledPages, shm_directory.Located] | None:
    """The pages of ``keys`` as rows of the mapping itself (one run of slots) or a gathered copy,
    and where they were found (for :class:`StableCheck`); None when any key is not bound."""
    located = peer.directory.locate(keys)
    if located is None:
        return None
    src, first = peer.mapping.array, located.first
    if first >= 0:
        rows = src[first : first + len(keys)]
    else:
        rows = np.empty((len(keys), src.shape[1]), dtype=np.uint8)
        copy_rows(src, located.slots, rows)
    return _pulled(keys, located, rows, 0.0), located


def _pulled(
    keys: Sequence[BlockKey], located: shm_directory.Located, data: npt.NDArray[np.uint8], seconds: float
) -> PulledPages:
    return PulledPages.intact(
        tuple(keys),
        tuple(located.parents),  # type: ignore[arg-type]  # 32-byte keys read from the directory
        tuple(located.roots),
        tuple(located.tokens),
        data,
        PATH,
        seconds,
    )


class StableCheck(LeaseCheck):
    """A landing's ``confirm`` for rows read one-sided: fails (reason "stale") when any page
    changed since it was located, and when the pull was cancelled."""

    def __init__(
        self, loop: object, peer: LocalPeer, located: shm_directory.Located, keys: Sequence[bytes]
    ) -> None:
        super().__init__(loop)  # type: ignore[arg-type]
        self._peer, self._located, self._keys = peer, located, keys

    def __call__(self) -> None:
        self._check()
        if not self._peer.directory.unchanged(self._located, self._keys):
            raise TransferError("a page changed while it was read; nothing imported", reason="stale")

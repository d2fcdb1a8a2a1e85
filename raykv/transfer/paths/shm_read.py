"""The ``shm_read`` path: same-node pulls with no request at all (one-sided reads).

After a client has once connected to a same-node page server that has a shared host tier, it maps
that tier and its slot directory (:mod:`raykv.core.tiers.shm_directory`) read-only. A later pull of
keys that are all bound in the directory is served in the calling thread: locate the slots, copy
the pages (one memcpy per run of consecutive slots), and check that every slot still holds its
key at the generation seen before the copy. Nothing is sent to the owner, so a small pull costs
about a memcpy instead of a network round trip. Anything else (a key not bound, a page moved or
evicted meanwhile, a machine whose memory ordering the directory does not support) makes the
client use the request paths (``shm``/``ucx``) as before; nothing half-read is ever returned.

For :meth:`raykv.transfer.PageClient.pull_land` the import reads the rows straight from the
mapping and its ``confirm`` (run after the rows are written, before any block is inserted)
re-checks the generations, so a page that changed during the import rejects it whole.

Two readers give the same answers: the compiled ``raykv.native._shmread.Reader`` (built by ``pip
install`` where a C compiler is present; one C call locates, copies and re-checks) and this
module's Python over :class:`raykv.core.tiers.shm_directory.DirectoryView`, used when the extension
was not built or ``RAYKV_PURE_SHM_READ=1`` (read when a peer is mapped; see
``raykv.native.load("_shmread")``). For one 64 KiB page the checks cost several times the copy in Python.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

import raykv.transfer.net.wire as wire
from raykv import native
from raykv.core.errors import StateError, TransferError, TransferFailure
from raykv.core.threads import run_rows
from raykv.core.tiers import shm_directory
from raykv.core.types import BlockKey
from raykv.transfer.pages.landing import Land, LeaseCheck, run_land
from raykv.transfer.pages.results import PulledPages, check_out
from raykv.transfer.pages.shm import ShmMapping, copy_rows
from raykv.transfer.paths.base import TransferPath

log = logging.getLogger(__name__)
T = TypeVar("T")

_shmread = native.built("_shmread")  # the optional compiled reader (see raykv.native)

PATH = "shm_read"
after_copy: Callable[[], object] | None = None
"""Tests only: called (no arguments) between a read's copy and its re-check, by both readers."""


def compiled_reader(directory: Any, tier: Any, num_slots: int, page_bytes: int, force: bool = False) -> Any:
    """A ``raykv.native._shmread.Reader`` over a directory buffer (:mod:`raykv.core.tiers.shm_directory`'s
    layout for ``num_slots``) and a tier buffer of ``num_slots`` pages of ``page_bytes``, whose
    ``read`` returns what :func:`read` does (``tier`` None: a reader that only locates and
    re-checks, whose ``read`` raises ValueError); None when it is switched off (``RAYKV_PURE_SHM_READ=1``)
    (``force``: whenever the extension was built, for tests comparing both readers). ValueError
    when a buffer is too small for that."""
    if _shmread is None or not (force or native.load("_shmread") is not None):
        return None
    offsets, cells = shm_directory.offsets(num_slots)
    reader = _shmread.Reader(
        directory, tier, num_slots, page_bytes, cells, *offsets, shm_directory.VECTOR_MIN, np.ndarray
    )
    c = _shmread  # the fields of PulledPages.intact(keys, parents, roots, tokens, data, PATH, seconds)
    fields = (
        ("keys", c.KEYS),
        ("parent_keys", c.PARENTS),
        ("parent_is_root", c.ROOTS),
        ("num_tokens", c.TOKENS),
        ("checksums", ()),
        ("data", c.DATA),
        ("missing", ()),
        ("path", PATH),
        ("seconds", c.SECONDS),
        ("verified", True),
    )
    reader.set_result(PulledPages, fields)
    return reader


def tally_python(counters: Sequence[Any], key: str, amounts: Sequence[int]) -> None:
    """``counters[i][key] += amounts[i]`` for every i (``raykv.native._shmread.tally`` does the same
    through the dict C API: a Counter's own item stores cost ~0.1 us each, it defines
    ``__delitem__``, and a one-sided pull counts three)."""
    for counts, amount in zip(counters, amounts):
        counts[key] += amount


class LocalPeer:
    """A same-node peer's shared host tier and its directory, both mapped read-only, and the
    compiled reader over both (``compiled``; None: the Python one reads). ``label``: the peer's
    "host:port" (the client's stats key); ``tally``: :func:`tally_python` or its compiled twin.

    Raises TransferError(reason="shm") when either cannot be mapped."""

    def __init__(self, info: wire.ShmInfo, label: str = "") -> None:
        self.path, self.label = info.path, label
        self.page_bytes = info.page_bytes
        self.mapping = ShmMapping(info.path, info.num_slots, info.page_bytes)
        try:
            self.directory = shm_directory.DirectoryReader(info.path, info.num_slots, info.page_bytes)
        except (OSError, StateError) as exc:
            self.mapping.close()
            raise TransferError(
                f"cannot map the peer's tier directory ({exc})", reason=TransferFailure.SHM
            ) from None
        # the mmaps themselves: releasing the views (close) then never meets a live export
        self.compiled = compiled_reader(
            self.directory.buffer, self.mapping.buffer, info.num_slots, info.page_bytes
        )
        self.tally = tally_python if self.compiled is None else _shmread.tally  # type: ignore[union-attr]

    def close(self) -> None:
        if self.compiled is not None:
            self.compiled.release()  # deferred while a read copies without the GIL
        self.directory.close()
        self.mapping.close()


def register(
    peers: dict[tuple[str, int], LocalPeer],
    retired: list[LocalPeer],
    peer: tuple[str, int],
    info: wire.ShmInfo | None,
    allowed: bool,
) -> None:
    """Map a same-node peer's shared tier and directory for one-sided reads, once per file, into
    ``peers``. ``allowed``: the peer is on this node and one-sided reads are on. A mapping a new
    file replaces moves to ``retired`` (a read may still use it; the client closes it)."""
    if info is None or not allowed or not usable():
        return
    have = peers.get(peer)
    if have is not None and have.path == info.path:
        return
    try:
        fresh = LocalPeer(info, f"{peer[0]}:{peer[1]}")
    except TransferError as exc:
        log.info("one-sided reads from %s unavailable (%s)", peer, exc)
        return
    if have is not None:
        retired.append(have)
    peers[peer] = fresh


def land_on(peer: LocalPeer | None, keys: list[BlockKey], land: Land[T]) -> tuple[T, int] | None:
    """``land(pulled, confirm)`` for the pages of ``keys`` read one-sided from ``peer``, and the
    bytes landed; None, with nothing landed, when the directory cannot serve every key or a page
    changed meanwhile (``confirm`` then fails with reason "stale"). Other errors raise."""
    viewed = _viewed(peer, keys, None)
    if viewed is None:
        return None
    try:
        return land(*viewed), viewed[0].nbytes
    except TransferError as exc:
        _raise_unless_stale(exc)
    return None


async def land_on_loop(peer: LocalPeer | None, keys: list[BlockKey], land: Land[T]) -> tuple[T, int] | None:
    """:func:`land_on` from the event loop: ``land`` runs as :func:`raykv.transfer.pages.landing.run_land`
    runs it (in a worker thread, waited for when the caller is cancelled)."""
    viewed = _viewed(peer, keys, asyncio.get_running_loop())
    if viewed is None:
        return None
    try:
        return await run_land(land, *viewed), viewed[0].nbytes
    except TransferError as exc:
        _raise_unless_stale(exc)
    return None


def _viewed(
    peer: LocalPeer | None, keys: list[BlockKey], loop: asyncio.AbstractEventLoop | None
) -> tuple[PulledPages, StableCheck] | None:
    """The pages of ``keys`` viewed in ``peer``'s tier and the check that they stayed; None when
    the directory cannot serve every key."""
    got = view(peer, keys) if keys and peer is not None else None
    if got is None:
        return None
    assert peer is not None
    return got[0], StableCheck(loop, peer, got[1], keys)


def _raise_unless_stale(exc: TransferError) -> None:
    """Raise ``exc`` unless the landing found a page changed (reason "stale")."""
    if exc.reason is not TransferFailure.STALE:
        raise exc


def usable() -> bool:
    """Whether this machine may read one-sided (see :func:`raykv.core.tiers.shm_directory.supported`)."""
    return shm_directory.supported()


def read(
    peer: LocalPeer, keys: Sequence[BlockKey], out: npt.NDArray[np.uint8] | None = None
) -> PulledPages | None:
    """Copy the pages of ``keys`` out of ``peer`` into ``out`` (or a new array); None when any key
    is not bound or any page changed while it was copied (``out`` may then hold partial bytes).

    ``out``, when given, must be a writable C-contiguous 2-D uint8 numpy array of at least
    ``len(keys)`` rows of the peer's page size (InvalidArgumentError otherwise, as
    :func:`raykv.transfer.pages.results.check_out`); the pages land in its leading rows."""
    fast = peer.compiled
    if fast is None or len(keys) * peer.page_bytes >= SPLIT_READ_BYTES:
        return _read_steps(peer, keys, out)
    into = np.empty((len(keys), peer.page_bytes), dtype=np.uint8) if out is None else out
    try:  # one C call: locate, copy, re-check, the PulledPages (or None)
        return fast.read(keys, into, after_copy, out is None)  # type: ignore[no-any-return]
    except (TypeError, ValueError):  # a bad `out` (or keys not a list of bytes, a closed reader)
        check_out(out, len(keys), peer.page_bytes)  # raises the typed error for a bad `out`
        return _read_steps(peer, keys, out, pure=True)


SPLIT_READ_BYTES = 8 << 20
"""A one-sided read of at least this many bytes runs step by step (:func:`_read_steps`), its copy
in pieces over this thread and the copy threads (:func:`raykv.core.threads.run_rows`): parallel
copies move about twice what one does (docs/benchmarks.md, "Transfers: same node, host pages"). Smaller ones
are one C call."""


def _read_steps(
    peer: LocalPeer, keys: Sequence[BlockKey], out: npt.NDArray[np.uint8] | None, pure: bool = False
) -> PulledPages | None:
    """:func:`read` as separate steps: locate (by the compiled reader unless ``pure``, or none
    was built), copy (in pieces when large), re-check."""
    start = perf_counter()
    src, n = peer.mapping.array, len(keys)
    check_out(out, n, src.shape[1])
    located = peer.directory.locate(keys) if pure else locate(peer, keys)
    if located is None:
        return None
    data = out[:n] if out is not None else np.empty((n, src.shape[1]), dtype=np.uint8)
    copy_located(src, located, data)
    if after_copy is not None:
        after_copy()
    still = peer.directory.unchanged(located, keys) if pure else unchanged(peer, located, keys)
    if not still:
        return None
    return _pulled(keys, located, data, perf_counter() - start)


def copy_located(
    src: npt.NDArray[np.uint8], located: shm_directory.Located, out: npt.NDArray[np.uint8]
) -> None:
    """``out[i] = src[located.slots[i]]``: one memcpy for a run of slots (``located.first``; the
    directory has as many slots as the tier, so the run is within ``src``), else a gather; in
    pieces over the copy threads when large."""
    first, slots = located.first, located.slots

    def piece(a: int, b: int) -> list[None]:
        if first >= 0:
            np.copyto(out[a:b], src[first + a : first + b])
        else:
            copy_rows(src, slots[a:b], out[a:b])
        return []

    run_rows(src.shape[1], len(out), piece)


class DirectoryLookup:
    """A peer's slot directory mapped read-only (``directory``) and, when built, a locate-only
    compiled reader over it (``compiled``, None: the Python view answers): what :func:`locate`
    and :func:`unchanged` need for a tier this process does not map (a GPU tier's directory).
    Raises OSError or StateError as :class:`raykv.core.tiers.shm_directory.DirectoryReader`."""

    def __init__(self, tier_path: str, num_slots: int, page_bytes: int) -> None:
        self.directory = shm_directory.DirectoryReader(tier_path, num_slots, page_bytes)
        self.compiled = compiled_reader(self.directory.buffer, None, num_slots, page_bytes)

    def close(self) -> None:
        if self.compiled is not None:
            self.compiled.release()
        self.directory.close()


def locate(peer: LocalPeer | DirectoryLookup, keys: Sequence[BlockKey]) -> shm_directory.Located | None:
    """Where ``keys`` are bound in ``peer``'s directory (:meth:`DirectoryView.locate`), by the
    compiled reader when there is one; None when any key is not bound."""
    fast = peer.compiled
    if fast is not None and isinstance(keys, (list, tuple)):
        got = fast.locate(keys)
        return None if got is None else shm_directory.Located(*got)
    return peer.directory.locate(keys)


def unchanged(
    peer: LocalPeer | DirectoryLookup, located: shm_directory.Located, keys: Sequence[bytes]
) -> bool:
    """Whether every located slot still holds its key at the generation seen (as
    :meth:`DirectoryView.unchanged`), by the compiled reader when there is one."""
    fast = peer.compiled
    if fast is not None and isinstance(keys, (list, tuple)):
        return bool(fast.unchanged(located.slots, located.gens, keys))
    return peer.directory.unchanged(located, keys)


def view(peer: LocalPeer, keys: Sequence[BlockKey]) -> tuple[PulledPages, shm_directory.Located] | None:
    """The pages of ``keys`` as rows of the mapping itself (one run of slots) or a gathered copy,
    and where they were found (for :class:`StableCheck`); None when any key is not bound."""
    located = locate(peer, keys)
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
        if not unchanged(self._peer, self._located, self._keys):
            raise TransferError(
                "a page changed while it was read; nothing imported", reason=TransferFailure.STALE
            )


class ShmReadPath(TransferPath):
    """The ``shm_read`` path: one-sided, never asked of a server. Its client side is this module's
    :func:`register` (on connecting), :func:`read` and :func:`land_on`/:func:`land_on_loop`,
    called by :class:`raykv.transfer.client.PageClient` before it asks the peer (module functions:
    a small read costs a few microseconds, so no call goes through an object)."""

    name: ClassVar[str] = PATH
    one_sided: ClassVar[bool] = True

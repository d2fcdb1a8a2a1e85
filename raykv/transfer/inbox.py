"""Engine inboxes: leased page slots an engine writes its KV into once, committed by their owner.

A CacheWorker grants each engine paired with it one inbox per tensor-parallel rank
(:meth:`Inboxes.open`): a /dev/shm file (``raykv-inbox-<pid>-*``, mode 0600) of
``slots`` page-sized rows, preceded by one state byte per slot. The engine maps it read-write
(:class:`InboxWriter`), takes free slots (:meth:`InboxWriter.reserve` marks them HELD), copies its
blocks' KV straight into their rows, and sends an :class:`InboxCommit` naming the slots, the
tokens and scope the blocks hold and the key of the block before them. The owner
(:meth:`Inboxes.commit`) checks the slots are the engine's and HELD, derives the blocks' keys
itself from that parent key, the tokens and the scope (an engine never names the keys its
bytes go under, and never writes the owner's matchable pages: the one copy into them is the
owner's), imports them through ``CacheManager.import_pages`` (the one commit path), and frees the
slots, whatever the outcome. A store that finds no free slots is the engine's backpressure: it
is counted and offered again later, never silently dropped.

Each lease also names the owner's store socket (:mod:`raykv.transfer.kv_share`, started with the
first inbox where engine memory can be shared): a CPU engine whose pages are its blocks verbatim
stores through it with one copy (the owner reads the engine's shared KV memory), and uses its
inbox only when that path is unavailable. Both paths key and commit the same way
(:func:`raykv.transfer.kv_share.protocol.commit_records`) and count into :attr:`Inboxes.counters`.

States: FREE (0) -> HELD (1) by the engine, HELD -> FREE by the owner only. A slot the engine marks
HELD but never commits stays held until the inbox closes (the engine unbinds, or opens its inboxes
anew). No locks are needed: each transition has one writer, and a commit reaches the owner only
after the engine wrote the rows it names.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from raykv.core.errors import InvalidArgumentError, OutOfMemoryError, RayKVError, StateError
from raykv.core.keys import MultimodalItem, ReuseScope
from raykv.core.manager import CacheManager
from raykv.core.records import BlockRecords
from raykv.core.tiers.base import is_run
from raykv.core.tiers.host import SHM_DIR
from raykv.transfer.kv_share.memory import supported as sharing_supported
from raykv.transfer.kv_share.owner import StoreOutcome, StoreServer
from raykv.transfer.kv_share.protocol import commit_records
from raykv.transfer.pages.shm import MapStep, OwnerFileError, map_owner_file

log = logging.getLogger(__name__)

INBOX_PREFIX = "raykv-inbox-"
FREE, HELD = 0, 1
_ALIGN = 4096
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Both sides map an inbox with its page tables filled: a store's copy into fresh slots would
otherwise take a page fault per 4 KiB (measured: the first stores into a 256-slot inbox ran at a
third of the later ones' speed)."""


def _header_bytes(slots: int) -> int:
    """Bytes of the state array before the rows (page-aligned, so rows start on a page)."""
    return -(-slots // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class InboxLease:
    """What an engine needs to write into one inbox: its file, id, slot count and page size."""

    path: str
    lease_id: int
    slots: int
    page_bytes: int
    rank: int = 0
    socket: str = ""
    """The owner's store socket (:mod:`raykv.transfer.kv_share`): a CPU engine that can share its
    KV memory stores through it with one copy; empty when the owner runs none."""

    @property
    def size(self) -> int:
        """The file's size in bytes (states and rows)."""
        return _header_bytes(self.slots) + self.slots * self.page_bytes


@dataclass(frozen=True)
class InboxCommit:
    """Blocks ``first_block .. first_block + len(slots) - 1`` of a sequence, written into
    ``slots`` of inbox ``lease_id`` (in block order). ``tokens``: the sequence's tokens through
    the last of these blocks (at least; only full blocks count), ``scope`` and ``mm_items``: what
    else their keys name (the engine rank's scope), ``parent``: the key of block
    ``first_block - 1`` (None when ``first_block`` is 0: the scope's root). ``req_id``: the engine's
    request, for its counters."""

    lease_id: int
    slots: tuple[int, ...]
    tokens: tuple[int, ...]
    scope: ReuseScope
    first_block: int
    parent: bytes | None = None
    mm_items: tuple[MultimodalItem, ...] = ()
    req_id: str = ""


@dataclass(frozen=True)
class InboxResult:
    """What one :meth:`Inboxes.commit` call did: blocks ``stored`` (new here), ``present``
    (held already), ``refused`` (not committed: a bad commit, or the salt's quota), one short
    reason per refused commit or quota refusal, and the call's wall time in microseconds
    (``commit_us``: keying, checks and the copy into the tier)."""

    stored: int = 0
    present: int = 0
    refused: int = 0
    reasons: tuple[str, ...] = ()
    commit_us: int = 0


_REFUSALS: dict[MapStep, str] = {
    "name": "{path!r} is not a raykv inbox",
    "open": "cannot open the inbox {path!r} ({reason})",
    "size": "the inbox {path!r} has an unexpected size",
    "map": "cannot map the inbox {path!r} ({reason})",
}


def _map(path: str, size: int, writable: bool) -> mmap.mmap:
    """Map ``path`` (a regular raykv inbox file of exactly ``size`` bytes, page tables filled);
    StateError otherwise."""
    try:
        return map_owner_file(path, INBOX_PREFIX, size, writable, _POPULATE)
    except OwnerFileError as exc:
        raise StateError(_REFUSALS[exc.step].format(path=path, reason=exc.strerror)) from None


class _Segment:
    """A mapped inbox: ``states`` (uint8 [slots]) and ``rows`` (uint8 [slots, page_bytes])."""

    def __init__(self, mapping: mmap.mmap, slots: int, page_bytes: int) -> None:
        self._mmap: mmap.mmap | None = mapping
        self.states: npt.NDArray[np.uint8] = np.frombuffer(mapping, np.uint8, slots)
        offset = _header_bytes(slots)
        self.rows: npt.NDArray[np.uint8] = np.frombuffer(
            mapping, np.uint8, slots * page_bytes, offset
        ).reshape(slots, page_bytes)

    def unmap(self) -> None:
        if self._mmap is None:
            return
        self.states = np.zeros(0, np.uint8)
        self.rows = np.zeros((0, self.rows.shape[1]), np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still exported: unmapped when it goes
        self._mmap = None


class Inbox:
    """The owner's side of one inbox (a fresh file, every slot FREE). OutOfMemoryError when
    /dev/shm cannot hold it; InvalidArgumentError for fewer than one slot."""

    def __init__(self, slots: int, page_bytes: int, rank: int = 0, socket: str = "") -> None:
        if slots < 1 or page_bytes < 1:
            raise InvalidArgumentError("slots", f"need >= 1 slot, got {slots} x {page_bytes}")
        size = _header_bytes(slots) + slots * page_bytes
        directory = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix=f"{INBOX_PREFIX}{os.getpid()}-", dir=directory)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            os.unlink(path)
            raise OutOfMemoryError(f"inbox: cannot reserve {size} bytes in {directory}: {exc}") from None
        finally:
            os.close(fd)
        self.lease = InboxLease(path, secrets.randbits(63), slots, page_bytes, rank, socket)
        self._segment = _Segment(mapping, slots, page_bytes)

    def take(self, slots: Sequence[int]) -> npt.NDArray[np.uint8]:
        """The rows of ``slots`` (a view when they are one run, else a copy), after checking
        they are distinct slots of this inbox, all HELD. InvalidArgumentError otherwise (nothing
        changes)."""
        seg = self._segment
        n = len(seg.states)
        if not slots or any(type(s) is not int or not 0 <= s < n for s in slots):
            raise InvalidArgumentError("slots", f"need slots of this inbox (0..{n - 1})")
        if len(set(slots)) != len(slots):
            raise InvalidArgumentError("slots", "a slot is named twice")
        if not bool(np.all(seg.states[list(slots)] == HELD)):
            raise InvalidArgumentError("slots", "a slot was not reserved by the engine")
        if is_run(slots):
            return seg.rows[slots[0] : slots[0] + len(slots)]
        return seg.rows[np.asarray(slots, dtype=np.intp)]

    def release(self, slots: Sequence[int]) -> None:
        """Mark the valid ones of ``slots`` FREE (the engine may reuse them)."""
        n = len(self._segment.states)
        ok = [s for s in slots if type(s) is int and 0 <= s < n]
        if ok:
            self._segment.states[ok] = FREE

    def held(self) -> int:
        """Slots the engine holds now."""
        return int(np.count_nonzero(self._segment.states == HELD))

    def close(self) -> None:
        """Unlink and unmap the file (an engine's mapping stays valid until it unmaps)."""
        try:
            os.unlink(self.lease.path)
        except FileNotFoundError:
            pass
        self._segment.unmap()


class InboxWriter:
    """The engine's side of one inbox: maps the lease's file read-write. StateError when the
    file is not that inbox (wrong name, size or type) or cannot be mapped."""

    def __init__(self, lease: InboxLease) -> None:
        self.lease = lease
        self._segment = _Segment(_map(lease.path, lease.size, True), lease.slots, lease.page_bytes)
        self._next = 0  # where the next search for free slots starts (slots are taken round-robin)

    @property
    def rows(self) -> npt.NDArray[np.uint8]:
        """Every slot's row (uint8 [slots, page_bytes]), the memory blocks are written into."""
        return self._segment.rows

    @property
    def states(self) -> npt.NDArray[np.uint8]:
        """Every slot's state (FREE or HELD), shared with the owner: the engine sets HELD only
        (:meth:`reserve`), the owner FREE."""
        return self._segment.states

    def reserve(self, count: int) -> list[int] | None:
        """Mark ``count`` FREE slots HELD and return them (one run of consecutive slots when
        there is one from the round-robin position on, so the rows are one view), or None when
        fewer than ``count`` are free (nothing changes)."""
        states = self._segment.states
        if count < 1 or count > len(states):
            return None
        free = np.flatnonzero(states == FREE)
        if len(free) < count:
            return None
        order = np.concatenate((free[free >= self._next], free[free < self._next]))
        picked = _first_run(order, count)
        slots = [int(s) for s in (picked if picked is not None else order[:count])]
        states[slots] = HELD
        self._next = (slots[-1] + 1) % len(states)
        return slots

    def free_slots(self) -> int:
        """Slots FREE now."""
        return int(np.count_nonzero(self._segment.states == FREE))

    def cancel(self, slots: Sequence[int]) -> None:
        """Give back ``slots`` reserved but not committed (the copy into them failed)."""
        self._segment.states[list(slots)] = FREE

    def close(self) -> None:
        self._segment.unmap()


def _first_run(order: npt.NDArray[np.intp], count: int) -> npt.NDArray[np.intp] | None:
    """The first ``count`` consecutive slot numbers in ``order`` (ascending within each part)."""
    if count == 1:
        return order[:1]
    breaks = np.flatnonzero(np.diff(order) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks + 1, [len(order)]))
    for lo, hi in zip(starts, ends):
        if hi - lo >= count:
            return order[lo : lo + count]
    return None


class Inboxes:
    """A CacheWorker's inboxes, by engine; commits them into ``manager``. Thread-safe (a threaded
    actor calls it): opening and closing are serialized, commits run beside them (an inbox
    closed during a commit stays mapped until the commit's rows are released)."""

    def __init__(self, manager: CacheManager, max_bytes_per_engine: int = 4 << 30) -> None:
        self.manager = manager
        self.max_bytes = max_bytes_per_engine
        self._by_engine: dict[str, list[Inbox]] = {}
        self._by_lease: dict[int, Inbox] = {}
        self._lock = threading.Lock()
        self.counters = {
            "stored": 0,
            "present": 0,
            "refused": 0,
            "commits": 0,
            "commit_us": 0,
            "shared_stores": 0,
            "shared_us": 0,
            "abandoned": 0,
        }
        """Blocks stored, present and refused (either path), inbox commits and their
        microseconds, shared-memory store requests and their microseconds, and blocks of
        shared-memory stores the engine abandoned, since start."""
        self._server: StoreServer | None = None
        self._server_failed = False

    def _store_socket(self) -> str:
        """The store socket's path, its server started on first use; empty where engines cannot
        share their memory or the socket cannot be made (logged once)."""
        with self._lock:
            if self._server is None and not self._server_failed and sharing_supported():
                try:
                    self._server = StoreServer(self.manager, self._by_lease.__contains__, self._count_shared)
                except OSError as exc:
                    self._server_failed = True
                    log.warning("inboxes: no store socket (%s); engines store through their inboxes", exc)
            return self._server.path if self._server is not None else ""

    def _count_shared(self, outcome: StoreOutcome) -> None:
        with self._lock:
            c = self.counters
            c["stored"] += outcome.stored
            c["present"] += outcome.present
            c["refused"] += outcome.refused
            c["abandoned"] += outcome.abandoned
            c["shared_stores"] += 1
            c["shared_us"] += outcome.us

    def open(self, engine: str, ranks: int, nbytes: int) -> tuple[InboxLease, ...]:
        """One inbox of ``nbytes`` (whole pages of the manager's layout) for each of the engine's
        ``ranks`` ranks, replacing any it had (their slots are dropped). InvalidArgumentError for
        an empty engine name, ``ranks`` < 1, or a size under one page or over the limit."""
        page = self.manager.config.layout.page_bytes
        if not (isinstance(engine, str) and engine):
            raise InvalidArgumentError("engine", "must be a non-empty string")
        if type(ranks) is not int or ranks < 1:
            raise InvalidArgumentError("ranks", f"must be an int >= 1, got {ranks!r}")
        if type(nbytes) is not int or not page <= nbytes * ranks <= self.max_bytes:
            raise InvalidArgumentError("nbytes", f"need {page} .. {self.max_bytes // ranks} bytes per rank")
        made: list[Inbox] = []
        path = self._store_socket()
        try:
            for rank in range(ranks):
                made.append(Inbox(nbytes // page, page, rank, path))
        except BaseException:
            for inbox in made:
                inbox.close()
            raise
        self.close_engine(engine)
        with self._lock:
            self._by_engine[engine] = made
            for inbox in made:
                self._by_lease[inbox.lease.lease_id] = inbox
        return tuple(inbox.lease for inbox in made)

    def close_engine(self, engine: str) -> None:
        """Close ``engine``'s inboxes (none: nothing happens)."""
        with self._lock:
            closing = self._by_engine.pop(engine, [])
            for inbox in closing:
                self._by_lease.pop(inbox.lease.lease_id, None)
        for inbox in closing:
            inbox.close()

    def close(self) -> None:
        """Close every inbox (the owner is shutting down or laying its pages out anew)."""
        for engine in list(self._by_engine):
            self.close_engine(engine)
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()

    def engines(self) -> dict[str, dict[str, int]]:
        """Per engine: ``inboxes``, ``slots`` and ``held`` (slots written, not committed yet)."""
        return {
            e: {"inboxes": len(b), "slots": sum(i.lease.slots for i in b), "held": sum(i.held() for i in b)}
            for e, b in self._by_engine.items()
        }

    def commit(self, commits: Sequence[InboxCommit]) -> InboxResult:
        """Commit each of ``commits`` (see the module docstring); one refused commit never stops
        the others. Slots of a known inbox are freed whatever happens to their commit."""
        start = time.perf_counter()
        stored = present = refused = 0
        reasons: list[str] = []
        for item in commits:
            try:
                new, held, quota = self._commit_one(item)
                stored, present, refused = stored + new, present + held, refused + quota
                if quota:
                    reasons.append(f"{quota} blocks refused by the salt's quota (max_blocks_per_salt)")
            except RayKVError as exc:
                refused += len(item.slots) if isinstance(item, InboxCommit) else 0
                reasons.append(f"{type(exc).__name__}: {exc}"[:200])
        with self._lock:
            counters = self.counters
            counters["stored"] += stored
            counters["present"] += present
            counters["refused"] += refused
            counters["commits"] += len(commits)
            took = int((time.perf_counter() - start) * 1e6)
            counters["commit_us"] += took
        return InboxResult(stored, present, refused, tuple(reasons), took)

    def _commit_one(self, item: InboxCommit) -> tuple[int, int, int]:
        """Import one commit's blocks; (new, already held, refused by the salt's quota). Frees
        its slots."""
        if not isinstance(item, InboxCommit):
            raise InvalidArgumentError("commit", f"must be an InboxCommit, got {type(item).__name__}")
        inbox = self._by_lease.get(item.lease_id)
        if inbox is None:
            raise StateError("unknown inbox lease (the engine must open its inboxes again)")
        try:
            records = self._records(item)
            rows = inbox.take(item.slots)
            result = self.manager.import_pages(records, rows, None, False)
        finally:
            inbox.release(item.slots)
        return len(result.imported), len(result.already_present), len(result.refused)

    def _records(self, item: InboxCommit) -> BlockRecords:
        """The commit's blocks, keyed here from its parent key, tokens, scope and items."""
        tpb = self.manager.config.layout.tokens_per_block
        first = item.first_block
        return commit_records(
            tpb, len(item.slots), first, item.parent, item.scope, item.tokens, item.mm_items
        )

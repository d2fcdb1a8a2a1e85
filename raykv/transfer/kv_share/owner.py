"""The owner's store socket: it copies a CPU engine's stored blocks out of the engine's own KV
memory into its matchable pages, the one copy of a store.

A :class:`StoreServer` listens on a Unix socket in a private directory (mode 0700) and takes
connections from processes of its own user only (SO_PEERCRED). An engine rank says ``hello``
(:mod:`raykv.transfer.kv_share.protocol`) with a lease id its owner granted (anything else is
refused), the descriptors of its shared KV memory (:func:`raykv.transfer.kv_share.memory.share_memory`)
and the segments a page is made of; the server maps each region read-only. Each ``store``
request then names, per commit, the engine blocks and what keys them; the server keys the blocks
itself (:func:`~raykv.transfer.kv_share.protocol.commit_records`) and imports them through the one
import procedure (:func:`raykv.core.export_import.import_written`), its writer gathering each new
page's segments straight from the engine's memory into the newly allocated top-tier slots.

Abandoned stores: an engine waits a bounded time for the answer (vLLM may reuse a block once the
step that stored it ends). When it gives up it increments the epoch word of a page it shares and
goes on. The server reads that word after its gather and before the blocks are inserted: a
changed epoch aborts the import (the pages are given back, counted ``abandoned``). On x86-64
(:func:`~raykv.transfer.kv_share.memory.supported`) loads are not reordered with older loads,
and the engine's epoch store precedes its later writes to the blocks: an unchanged epoch after
the gather means the gather read no block the engine had rewritten.

One thread per connection serves its requests in order; the accept loop runs on its own thread.
:meth:`StoreServer.close` stops both and removes the socket.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.core import threads
from raykv.core.errors import InvalidArgumentError, RayKVError, StateError
from raykv.core.export_import import import_written
from raykv.core.manager import CacheManager
from raykv.core.tiers.copy_plan import runs
from raykv.core.types import DEFAULT_PRIORITY, PageId, TierKind
from raykv.transfer.kv_share.memory import PAGE, ReadOnlyRegion, gather
from raykv.transfer.kv_share.protocol import close_fds, commit_records, parse_commit, recv_frame, send_frame

log = logging.getLogger(__name__)

MAX_SEGMENTS = 1 << 16
MAX_CONNECTIONS = 256
"""Connections served at once (one per engine rank); more are closed at once."""
HELLO_TIMEOUT_S = 10.0
"""A connection must say hello within this long (its thread is then freed)."""


@dataclass(frozen=True)
class StoreOutcome:
    """One store request's blocks: ``stored`` (new), ``present`` (held already), ``refused``
    (a bad commit, the salt's quota, no room), ``abandoned`` (the engine gave up waiting), the
    reasons of refusals and the owner's wall time in microseconds."""

    stored: int = 0
    present: int = 0
    refused: int = 0
    abandoned: int = 0
    reasons: tuple[str, ...] = ()
    us: int = 0


class Abandoned(StateError):
    """The engine moved on before the gather was known to be complete."""


class EngineMemory:
    """One engine rank's shared KV memory as this owner mapped it, and its page's segments."""

    def __init__(self, msg: dict[str, Any], fds: list[int], page_bytes: int) -> None:
        """Map ``fds`` (this takes them: each is closed, mapped or not) as ``msg`` describes.
        InvalidArgumentError for a bad description, StateError for a region that cannot be
        mapped."""
        self.regions: list[ReadOnlyRegion] = []
        self.lease = 0
        """The lease the engine proved (checked again at each store: a closed inbox ends it)."""
        taken = 0
        try:
            pairs, table, self.blocks = _described(msg, len(fds), page_bytes)
            for (start, size), fd in zip(pairs, fds):
                taken += 1
                self.regions.append(ReadOnlyRegion(fd, start, size))
            taken += 1
            self.epoch_page: ReadOnlyRegion | None = ReadOnlyRegion(fds[-1], 0, PAGE)
        except BaseException:
            close_fds(fds[taken:])
            self.epoch_page = None
            self.close()
            raise
        self.addr, self.stride, self.length = table[:, 0], table[:, 1], table[:, 2]
        order = np.argsort([r.start for r in self.regions])
        self._starts = np.asarray([self.regions[i].start for i in order], dtype=np.int64)
        self._ends = self._starts + np.asarray([self.regions[i].size for i in order], dtype=np.int64)
        self._bases = np.asarray([self.regions[i].address for i in order], dtype=np.int64)

    def epoch(self) -> int:
        """The engine's epoch word now."""
        assert self.epoch_page is not None
        return self.epoch_page.u64(0)

    def sources(self, block_ids: list[int]) -> npt.NDArray[np.uint64]:
        """Local addresses ``[len(block_ids), segments]`` of the blocks' segments (page order).
        InvalidArgumentError naming the first block outside the engine's blocks or its shared
        memory."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ((ids < 0) | (ids >= self.blocks)).any():
            raise InvalidArgumentError("blocks", f"a block id outside 0 .. {self.blocks - 1}")
        engine = self.addr[None, :] + ids[:, None] * self.stride[None, :]
        where = np.searchsorted(self._starts, engine, side="right") - 1
        inside = (where >= 0) & (engine + self.length[None, :] <= self._ends[np.maximum(where, 0)])
        if not inside.all():
            bad = int(ids[np.flatnonzero(~inside.all(axis=1))[0]])
            raise InvalidArgumentError("blocks", f"block {bad} is not in the engine's shared memory")
        return (self._bases[where] + engine - self._starts[where]).astype(np.uint64)

    def close(self) -> None:
        for region in self.regions:
            region.close()
        if self.epoch_page is not None:
            self.epoch_page.close()


def _described(msg: dict[str, Any], fds: int, page_bytes: int) -> tuple[list[tuple[int, int]], Any, int]:
    """A hello's regions (``[(start, size), ...]``), segment table (int64 ``[n, 3]``) and block
    count, checked: one descriptor per region plus the epoch page's, segments that make a page
    of ``page_bytes``. InvalidArgumentError otherwise."""
    regions, segments, blocks = msg.get("regions"), msg.get("segments"), msg.get("blocks")
    if not isinstance(regions, list) or not regions or fds != len(regions) + 1:
        raise InvalidArgumentError("regions", "one descriptor per region, then the epoch page's")
    pairs = []
    for entry in regions:
        if not isinstance(entry, list) or len(entry) != 2 or any(type(v) is not int or v <= 0 for v in entry):
            raise InvalidArgumentError("regions", "each region is [start, size], positive ints")
        pairs.append((entry[0], entry[1]))
    if not isinstance(segments, list) or not 0 < len(segments) <= MAX_SEGMENTS or type(blocks) is not int:
        raise InvalidArgumentError("segments", f"need 1 .. {MAX_SEGMENTS} segments and a block count")
    if any(
        not isinstance(seg, list) or len(seg) != 3 or any(type(v) is not int for v in seg) for seg in segments
    ):
        raise InvalidArgumentError("segments", "each segment is [address, stride, length], ints")
    if (
        type(blocks) is not int
        or blocks < 1
        or any(a < 0 or s < 0 or a + (blocks - 1) * s + n >= 1 << 56 for a, s, n in segments)
    ):  # Python ints: every address computed later fits int64 with room to spare
        raise InvalidArgumentError("segments", "addresses, strides and block count out of range")
    table = np.asarray(segments, dtype=np.int64).reshape(len(segments), 3)
    if int(table[:, 2].sum()) != page_bytes or (table[:, 2] <= 0).any() or (table[:, :2] < 0).any():
        raise InvalidArgumentError("segments", f"segments must make a page of {page_bytes} bytes")
    return pairs, table, blocks


class StoreServer:
    """Serves store requests into ``manager`` on a fresh Unix socket (:attr:`path`).
    ``lease_ok(lease_id)`` says whether a hello's lease is one this owner granted;
    ``on_outcome`` sees every request's :class:`StoreOutcome` (for counters).
    OSError when the socket cannot be made."""

    def __init__(
        self,
        manager: CacheManager,
        lease_ok: Callable[[int], bool],
        on_outcome: Callable[[StoreOutcome], None],
    ) -> None:
        self.manager = manager
        self._lease_ok = lease_ok
        self._on_outcome = on_outcome
        self._dir = tempfile.mkdtemp(prefix="raykv-store-")  # mode 0700: this user only
        self.path = os.path.join(self._dir, "s")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._accepting = threading.Thread(target=self._accept_loop, daemon=True, name="raykv-store-accept")
        self._accepting.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            with self._lock:
                if self._closed or uid != os.getuid() or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="raykv-store").start()

    def _serve(self, conn: socket.socket) -> None:
        memory: EngineMemory | None = None
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            memory = self._hello(conn)
            if memory is None:
                return
            conn.settimeout(None)  # an engine may store nothing for a long while
            while True:
                msg, _ = recv_frame(conn)
                send_frame(conn, self._store(memory, msg))
        except (EOFError, OSError, StateError) as exc:
            if not isinstance(exc, EOFError) and not self._closed:
                log.info("store socket: a connection ended (%s)", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if memory is not None:
                memory.close()

    def _hello(self, conn: socket.socket) -> EngineMemory | None:
        """Check a hello and map its memory; answers it. None when refused."""
        msg, fds = recv_frame(conn, want_fds=True)
        try:
            lease = msg.get("lease")
            if msg.get("op") != "hello" or type(lease) is not int or not self._lease_ok(lease):
                raise InvalidArgumentError("lease", "not a lease this worker granted")
            page = self.manager.config.layout.page_bytes
            if msg.get("page") != page:
                raise InvalidArgumentError("page", f"pages of {msg.get('page')} bytes for a worker of {page}")
        except RayKVError as exc:
            close_fds(fds)
            send_frame(conn, {"error": f"{type(exc).__name__}: {exc}"[:300]})
            return None
        try:
            memory = EngineMemory(msg, fds, page)  # takes the descriptors
            memory.lease = lease
        except RayKVError as exc:
            send_frame(conn, {"error": f"{type(exc).__name__}: {exc}"[:300]})
            return None
        send_frame(conn, {"ok": True})
        return memory

    def _store(self, memory: EngineMemory, msg: dict[str, Any]) -> dict[str, Any]:
        """One store request: every commit imported or refused on its own."""
        start = time.perf_counter()
        seq, epoch, commits = msg.get("seq"), msg.get("epoch"), msg.get("commits")
        if (
            msg.get("op") != "store"
            or type(seq) is not int
            or type(epoch) is not int
            or not isinstance(commits, list)
        ):
            return {"error": "a malformed store request"}
        if not self._lease_ok(memory.lease):
            return {"error": "the engine's lease is closed (it must open its inboxes again)"}
        per: list[list[int]] = []  # [stored, present, refused, abandoned] per commit
        reasons: list[str] = []
        for item in commits:
            n = len(item[0]) if isinstance(item, list) and item and isinstance(item[0], list) else 0
            try:
                new, held, quota, gone = self._commit(memory, item, epoch)
                per.append([new, held, quota, gone])
                if quota:
                    reasons.append(f"{quota} blocks refused by the salt's quota (max_blocks_per_salt)")
            except Abandoned:
                per.append([0, 0, 0, n])
            except (RayKVError, TypeError, ValueError) as exc:
                per.append([0, 0, n, 0])
                reasons.append(f"{type(exc).__name__}: {exc}"[:200])
        totals = (
            dict(zip(("stored", "present", "refused", "abandoned"), (sum(c) for c in zip(*per))))
            if per
            else {}
        )
        us = int((time.perf_counter() - start) * 1e6)
        self._on_outcome(StoreOutcome(**totals, reasons=tuple(reasons), us=us))
        return {"seq": seq, **totals, "per": per, "reasons": reasons[:8], "us": us}

    def _commit(self, memory: EngineMemory, item: Any, epoch: int) -> tuple[int, int, int, int]:
        """Import one commit's blocks; (new, held already, refused, abandoned)."""
        blocks, first, parent, tokens, scope, mm, _ = parse_commit(item)
        tpb = self.manager.config.layout.tokens_per_block
        records = commit_records(tpb, len(blocks), first, parent, scope, tokens, mm)
        sources = memory.sources(blocks)
        if memory.epoch() != epoch:
            raise Abandoned("the engine gave up this store")

        def write(slots: list[PageId], new: list[int]) -> None:
            self._write(slots, sources[new], memory.length)
            if memory.epoch() != epoch:  # after the gather: see the module docstring
                raise Abandoned("the engine gave up this store")

        try:
            result = import_written(self.manager, records, write, DEFAULT_PRIORITY)
        except Abandoned:
            return 0, 0, 0, len(blocks)
        return len(result.imported), len(result.already_present), len(result.refused), 0

    def _write(
        self, slots: list[PageId], sources: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64]
    ) -> None:
        """Gather page ``i`` from ``sources[i]`` into top-tier slot ``slots[i]`` (under the
        manager's lock), over the copy threads: straight into a host tier's rows, else through
        host rows."""
        mgr = self.manager
        pool: Any = mgr.pools[0]
        page = int(lengths.sum())
        if pool.kind is TierKind.HOST:
            mgr.copy.settle(0, slots)
            array = pool.array
            threads.run_rows(
                page, len(slots), lambda a, b: _gather_slots(array, slots[a:b], sources[a:b], lengths)
            )
            return
        rows = np.empty((len(slots), page), dtype=np.uint8)
        threads.run_rows(
            page, len(slots), lambda a, b: _gather_slots(rows, list(range(a, b)), sources[a:b], lengths)
        )
        mgr.copy.write(0, slots, rows)

    def close(self) -> None:
        """Stop accepting, end every connection (their regions are unmapped as their threads
        end), remove the socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepting.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


def _gather_slots(
    array: npt.NDArray[np.uint8],
    slots: Sequence[int],
    sources: npt.NDArray[np.uint64],
    lengths: npt.NDArray[np.int64],
) -> list[None]:
    """Pages ``sources[i]`` into rows ``slots[i]`` of ``array``: one gather per run of slots."""
    ids = np.asarray(slots, dtype=np.int64)
    for i, slot, count in runs(np.arange(len(ids), dtype=np.int64), ids):
        _gather_rows(array[slot : slot + count], sources[i : i + count], lengths)
    return []


def _gather_rows(
    rows: npt.NDArray[np.uint8], sources: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64]
) -> None:
    """Pages ``rows`` (consecutive rows) from their segments' addresses ``sources``."""
    gather(rows, sources.reshape(-1), np.tile(lengths, len(rows)))

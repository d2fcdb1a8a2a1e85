"""The engine's side of shared-memory stores: its KV memory shared read-only with its
CacheWorker, and store requests the worker answers once its one copy is done.

:class:`SharedKV` shares the engine's KV memory (:func:`raykv.transfer.kv_share.memory.share_memory`),
connects to its owner's store socket (:mod:`raykv.transfer.kv_share.owner`) with a lease the
owner granted, and sends the descriptors and the page's segments. :meth:`SharedKV.store` then
sends one request for a step's commits and waits for the answer, at most ``timeout_s``: vLLM may
reuse a block once the step that computed it ends, so the owner's copy must be over by then. When
the wait runs out, the store is abandoned (the epoch word moves on; the owner then discards
whatever it copied) and :meth:`store` returns None.

A block is shareable when every segment of it lies in the shared memory (a tensor's first and last
page may stay private: :meth:`covers`); a store of other blocks goes through the inbox.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from raykv.core.errors import StateError
from raykv.transfer.kv_share.memory import MIN_BYTES, PAGE, SharedRegion, share_memory
from raykv.transfer.kv_share.protocol import recv_frame, send_frame

log = logging.getLogger(__name__)


class SharedKV:
    """Engine rank memory ``memories`` (``[(address, bytes), ...]``, distinct ranges) shared with
    the owner listening at ``path``, for pages made of ``segments`` (``[(address of block 0's
    segment, stride between blocks, length), ...]`` in page order) of ``num_blocks`` blocks.
    StateError when the memory cannot be shared, the socket cannot be reached or the owner
    refuses the hello (the engine's memory may then be shared already: harmless, its bytes and
    addresses are unchanged)."""

    def __init__(
        self,
        path: str,
        lease_id: int,
        memories: Sequence[tuple[int, int]],
        segments: Sequence[tuple[int, int, int]],
        num_blocks: int,
        page_bytes: int,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self._seq = 0
        regions = [r for r in (share_memory(a, n) for a, n in memories) if r is not None]
        if not regions:
            raise StateError(f"no range of the engine's KV memory is {MIN_BYTES >> 20} MiB or more")
        self.covered = _covered(regions, segments, num_blocks)
        epoch_fd = os.memfd_create("raykv-engine-epoch", os.MFD_CLOEXEC)
        fds = [r.fd for r in regions] + [epoch_fd]
        try:
            os.ftruncate(epoch_fd, PAGE)
            self._epoch_map = mmap.mmap(epoch_fd, PAGE)
            self._epoch = np.frombuffer(self._epoch_map, np.uint64, 1)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            hello = {
                "op": "hello",
                "lease": lease_id,
                "page": page_bytes,
                "blocks": num_blocks,
                "regions": [[r.start, r.size] for r in regions],
                "segments": [[int(a), int(s), int(n)] for a, s, n in segments],
            }
            send_frame(self._sock, hello, fds)
            answer, _ = recv_frame(self._sock)
        except (OSError, EOFError) as exc:
            if hasattr(self, "_sock"):
                self._sock.close()
            raise StateError(f"the store socket {path!r} failed: {exc}") from None
        finally:
            for fd in fds:  # the owner has its own; the mappings keep the memory
                os.close(fd)
        if not answer.get("ok"):
            self._sock.close()
            raise StateError(f"the owner refused shared stores: {answer.get('error')}")

    def covers(self, block_ids: Sequence[Any]) -> bool:
        """Whether every one of ``block_ids`` is wholly in the shared memory."""
        ids = np.asarray(block_ids, dtype=np.int64)
        n = len(self.covered)
        return bool(len(ids)) and bool(((ids >= 0) & (ids < n)).all()) and bool(self.covered[ids].all())

    def store(self, commits: list[Any]) -> dict[str, Any] | None:
        """Have the owner copy and commit ``commits`` (:func:`~raykv.transfer.kv_share.protocol.commit_wire`
        lists); its answer (``stored``, ``present``, ``refused``, ``abandoned``, ``per``: those
        four per commit, ``reasons``, ``us``), or None when it did not answer within
        ``timeout_s`` (the store is abandoned: nothing of it is committed after this returns).
        StateError when the connection broke (this SharedKV is unusable then)."""
        self._seq += 1
        epoch = int(self._epoch[0])
        deadline = time.monotonic() + self.timeout_s
        try:
            send_frame(self._sock, {"op": "store", "seq": self._seq, "epoch": epoch, "commits": commits})
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                answer, _ = recv_frame(self._sock)
                if answer.get("seq") == self._seq or "error" in answer:
                    break  # an earlier, abandoned store's answer is skipped
        except TimeoutError:
            self._epoch[0] = epoch + 1  # before any later write to the blocks (x86-64 store order)
            return None
        except (OSError, EOFError) as exc:
            self._epoch[0] = epoch + 1
            raise StateError(f"the store socket failed: {exc}") from None
        if "error" in answer:
            raise StateError(f"the owner refused a store: {answer['error']}")
        return answer

    def close(self) -> None:
        """Close the connection (the owner unmaps the engine's memory)."""
        self._sock.close()


def _covered(regions: list[SharedRegion], segments: Sequence[tuple[int, int, int]], num_blocks: int) -> Any:
    """Per block, whether each of its segments lies within one region."""
    ids = np.arange(num_blocks, dtype=np.int64)
    ok = np.ones(num_blocks, dtype=bool)
    for address, stride, length in segments:
        starts = address + ids * stride
        inside = np.zeros(num_blocks, dtype=bool)
        for r in regions:
            inside |= (starts >= r.start) & (starts + length <= r.start + r.size)
        ok &= inside
    return ok

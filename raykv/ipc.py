"""Share a GPU tier with an engine process on the same GPU, zero copy.

The process that owns the pool (the CacheWorker) runs a :class:`PoolExporter`: a Unix socket
(mode 0600, in a private 0700 directory) that, for each connecting process of the same user
(checked with SO_PEERCRED), sends a JSON description of the pool (layout, page size, slot count,
chunk size, device UUID) and then one POSIX file descriptor per physical chunk of the pool's CUDA
virtual memory (SCM_RIGHTS). The engine calls :func:`attach`, which imports the chunks, maps them
contiguously in its own address space and returns an :class:`AttachedPool` with the same tensor
views as the owner (``tensor``, ``layer_view``, ``k_view``, ``v_view``, ``buffer_view``): page id
``p`` names the same bytes in both processes.

Contract: an attachment sees the pool as it was when it attached (re-attach after the owner
resizes it). The owner's pool switches to host-side waits once exported (``GpuPool.shared``), so
pages the manager hands out are complete when its call returns; the engine orders its own writes
before calling back into the manager (e.g. ``torch.cuda.synchronize()`` before commit). Needs the
VMM pool (not the plain-allocation fallback).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
from typing import Any

from raykv.core.config import BufferSpec, KVLayout, LayerSpec
from raykv.core.errors import StateError, TransferError, TransferFailure
from raykv.core.tiers.cuda_util import device_by_uuid, device_uuid, ensure_context
from raykv.core.tiers.gpu import GpuPool, PageViews
from raykv.core.tiers.vmm import ImportedArena, torch_view

MAGIC = "raykv-gpu-pool"
VERSION = 1
FDS_PER_MESSAGE = 250
MAX_HEADER = 1 << 20


def layout_to_json(layout: KVLayout) -> dict[str, Any]:
    layers = [
        {"layer_id": layer.layer_id, "buffers": [[b.role, list(b.shape), b.dtype] for b in layer.buffers]}
        for layer in layout.layers
    ]
    return {"tokens_per_block": layout.tokens_per_block, "layers": layers}


def layout_from_json(data: dict[str, Any]) -> KVLayout:
    layers = tuple(
        LayerSpec(int(layer["layer_id"]), tuple(BufferSpec(r, tuple(s), d) for r, s, d in layer["buffers"]))
        for layer in data["layers"]
    )
    return KVLayout(layers=layers, tokens_per_block=int(data["tokens_per_block"]))


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise TransferError("GPU pool socket closed mid-message", reason=TransferFailure.CLOSED)
        buf += chunk
    return bytes(buf)


class PoolExporter:
    """Serves a VMM-backed :class:`GpuPool` to local processes of the same user over ``path``."""

    def __init__(self, pool: GpuPool, path: str | None = None) -> None:
        if pool.arena is None or not pool.arena.exportable:
            raise StateError("sharing a GPU tier needs an exportable CUDA virtual-memory pool")
        self.pool = pool
        self._dir = None if path is not None else tempfile.mkdtemp(prefix="raykv-gpu-")
        self.path = path if path is not None else os.path.join(self._dir or "", "pool.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._closed = threading.Event()
        pool.shared = True
        pool.events.wait_all()
        self._thread = threading.Thread(target=self._serve, name="raykv-gpu-export", daemon=True)
        self._thread.start()

    def describe(self) -> dict[str, Any]:
        """The header sent to each attaching process."""
        pool, arena = self.pool, self.pool.arena
        assert arena is not None
        return {
            "magic": MAGIC,
            "version": VERSION,
            "device_uuid": device_uuid(arena.device),
            "page_bytes": pool.page_bytes,
            "num_slots": pool.num_slots,
            "chunk_bytes": arena.chunk_bytes,
            "num_chunks": arena.num_chunks,
            "layout": layout_to_json(pool.layout),
        }

    def _serve(self) -> None:
        assert self.pool.arena is not None
        ensure_context(self.pool.arena.device)
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._handle(conn)
                except (OSError, StateError, TransferError):
                    continue  # one bad client must not stop the server

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            return
        assert self.pool.arena is not None
        header = json.dumps(self.describe()).encode()
        fds = self.pool.arena.export_fds()
        try:
            conn.sendall(struct.pack("!I", len(header)) + header)
            for first in range(0, len(fds), FDS_PER_MESSAGE):
                socket.send_fds(conn, [b"F"], fds[first : first + FDS_PER_MESSAGE])
            _recv_exact(conn, 1)  # the peer's ack: it holds the fds now
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Stop serving (existing attachments keep their mappings). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5.0)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._dir is not None:
            os.rmdir(self._dir)

    def __enter__(self) -> PoolExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AttachedPool(PageViews):
    """The owner's GPU pool mapped into this process: same pages, same views, same page ids."""

    def __init__(self, header: dict[str, Any], arena: ImportedArena) -> None:
        self.layout = layout_from_json(header["layout"])
        self.page_bytes = int(header["page_bytes"])
        self.num_slots = int(header["num_slots"])
        self.arena = arena
        self.device = arena.device
        self.base_address = arena.base
        nbytes = self.num_slots * self.page_bytes
        self.tensor = torch_view(arena.base, nbytes, arena.device, arena).view(
            self.num_slots, self.page_bytes
        )

    def page(self, slot: int) -> Any:
        return self.tensor[slot]

    def close(self) -> None:
        """Unmap the pool from this process; drop every view first. Idempotent."""
        import torch

        torch.cuda.synchronize(self.device)
        self.tensor = None
        self.arena.close()


def attach(path: str, timeout: float = 10.0, device: int | None = None) -> AttachedPool:
    """Map the GPU pool served at ``path`` (a :class:`PoolExporter`'s socket) into this process.

    ``device``: the device that reads and writes the mapping (default: the pool's own device; a
    peer device reads it over NVLink or PCIe, see :class:`raykv.core.tiers.vmm.ImportedArena`).
    Raises TransferError when nothing serves there or the reply is malformed, CudaError when the
    driver refuses the import.
    """
    fds: list[int] = []
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        header = _receive(conn, path, fds)
        if device is None:
            device = device_by_uuid(str(header["device_uuid"]))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        conn.close()
    return AttachedPool(header, ImportedArena(device, fds, int(header["chunk_bytes"])))


def _receive(conn: socket.socket, path: str, fds: list[int]) -> dict[str, Any]:
    """Read the header and every chunk's fd (appended to ``fds``), then acknowledge."""
    try:
        conn.connect(path)
    except OSError as exc:
        raise TransferError(
            f"no GPU pool served at {path}: {exc}", reason=TransferFailure.UNAVAILABLE
        ) from None
    (size,) = struct.unpack("!I", _recv_exact(conn, 4))
    if size > MAX_HEADER:
        raise TransferError(f"GPU pool header too large ({size} bytes)", reason=TransferFailure.PROTOCOL)
    header: dict[str, Any] = json.loads(_recv_exact(conn, size))
    if header.get("magic") != MAGIC or header.get("version") != VERSION:
        raise TransferError(
            f"{path} does not serve a raykv GPU pool (version {VERSION})", reason=TransferFailure.PROTOCOL
        )
    while len(fds) < int(header["num_chunks"]):
        _msg, got, _flags, _addr = socket.recv_fds(conn, 1, FDS_PER_MESSAGE)
        if not got:
            raise TransferError(
                "GPU pool socket closed before every chunk arrived", reason=TransferFailure.CLOSED
            )
        fds.extend(got)
    conn.sendall(b"A")
    return header

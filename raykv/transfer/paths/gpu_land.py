"""Land a same-node owner's GPU pages straight in the caller's device memory, no CacheManager.

This is how an inference engine on a GPU reads its CacheWorker's GPU tier (the vLLM connector's
worker side, :mod:`raykv.integrations.vllm.worker`): the owner's CUDA virtual-memory pool is
mapped into the engine's process (:mod:`raykv.ipc`, by the ``gpu_peer`` path's socket) and the
pages are copied device to device into the engine's own blocks by ``land``. Nothing crosses a
network or host memory, and nothing is imported anywhere: the engine's blocks are the
destination.

Two ways, tried in this order by :meth:`raykv.transfer.client.PageClient.land_gpu`:

- one-sided (:func:`land_gpu_local`): once a first request has told this client where the
  owner's pool and slot directory are, a load whose keys the directory lists is copied with no
  request at all, then every slot is re-checked (generation and key); a page that changed
  meanwhile makes the landing void (reason "stale") and the caller asks the owner instead.
- request (:func:`land_gpu_request`): a ``gpu_peer`` pull; the owner leases the blocks and
  answers with the slots of the leading run of them on its GPU tier; ``land`` copies them while
  the lease holds, and the owner's acknowledgement of ``done`` confirms that it held. When it
  did not, TransferError is raised and whatever ``land`` wrote must not be used.

``land(rows, slots, start, confirm)``: ``rows`` is the owner's whole pool as a uint8
``[num_slots, page_bytes]`` tensor on the caller's device; write pages ``slots`` (those of keys
``start .. start + len(slots) - 1``) where they belong, wait until the copies completed, then call
``confirm()`` (it raises TransferError when a one-sided read saw a page change).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import raykv.transfer.net.wire as wire
import raykv.transfer.paths.shm_read as shm_read
from raykv.core.errors import CudaError, TransferError, TransferFailure
from raykv.core.types import BlockKey
from raykv.transfer.net.connection import ClientConn
from raykv.transfer.paths.gpu_read import LOCAL_PATH
from raykv.transfer.paths.peer_pools import PoolInfo
from raykv.transfer.paths.pull_client import PullClient

PATH = "gpu_peer"
GpuLand = Callable[[Any, list[int], int, Callable[[], None]], None]
"""``land(rows, slots, start, confirm)``: see the module docstring."""


@dataclass(frozen=True)
class GpuLanding:
    """What :meth:`raykv.transfer.PageClient.land_gpu` did: how many leading keys landed, and
    by which path (``gpu_read``: one-sided from the owner's directory; ``gpu_peer``: requested
    under a lease; None when nothing landed)."""

    landed: int
    path: str | None


def land_gpu_local(
    client: PullClient, peer: tuple[str, int], keys: list[BlockKey], device: int, land: GpuLand
) -> bool:
    """The one-sided landing of every key of ``keys`` from ``peer``'s mapped GPU tier on
    ``device``; True when landed and confirmed unchanged. False, with nothing to trust in what
    ``land`` wrote, when the path cannot serve every key (no earlier request to this owner, a key
    not in its directory) or a page changed while it was copied."""
    info = client.gpu_pools.known.get(peer)
    config = client.config
    if info is None or info.directory is None or not (config.use_gpu_peer and config.use_shm_read):
        return False
    source = client.gpu_pools.cached(info, device)
    reader = client.gpu_pools.reader(info, source.page_bytes) if source is not None else None
    if source is None or reader is None:
        return False
    located = shm_read.locate(reader, keys)
    if located is None or max(located.slots) >= source.num_slots:
        return False

    def confirm() -> None:
        if not shm_read.unchanged(reader, located, keys):
            raise TransferError("a page changed while it was copied", reason=TransferFailure.STALE)

    try:
        land(source.tensor, list(located.slots), 0, confirm)
    except TransferError as exc:
        if exc.reason is not TransferFailure.STALE:
            raise
        return False
    client.count(LOCAL_PATH, peer, len(keys), len(keys) * source.page_bytes)
    return True


async def land_gpu_request(
    client: PullClient, peer: tuple[str, int], keys: list[BlockKey], device: int, land: GpuLand
) -> int | None:
    """Ask ``peer`` for ``keys`` over ``gpu_peer`` and land the leading run of them that is on
    its GPU tier (in batches within the server's limits, up to the first batch that comes back
    short); how many leading keys landed. None, with nothing asked, when the path is not
    available: switched off here, or the peer is on another node, offers no GPU tier or its pool
    cannot be mapped on ``device`` (those three do not change while the peer runs, so the peer
    joins ``client.gpu_pools.refused`` and is not asked again). TransferError when a batch
    fails: what ``land`` wrote for it must not be used (the earlier batches stand)."""
    conn = await client.checkout(peer)
    if not client.config.use_gpu_peer or conn.peer in client.gpu_pools.refused:
        client.checkin(peer, conn)
        return None
    if not (conn.gpu and conn.node == client.node_id):
        client.gpu_pools.refused.add(conn.peer)
        client.checkin(peer, conn)
        return None
    done = 0
    try:
        per_batch = max(1, min(conn.max_keys, conn.max_payload // max(1, conn.page_bytes)))
        while done < len(keys):
            batch = keys[done : done + per_batch]
            got = await _land_batch(client, conn, batch, device, land, done)
            if got is None:
                client.checkin(peer, conn)
                return None if done == 0 else done
            done += got
            if got < len(batch):
                break
    except BaseException:
        conn.close()
        raise
    client.checkin(peer, conn)
    return done


async def _land_batch(
    client: PullClient, conn: ClientConn, keys: list[BlockKey], device: int, land: GpuLand, start: int
) -> int | None:
    """One ``gpu_peer`` request: the leading keys landed, or None when the owner's pool cannot
    be mapped on ``device`` (the lease ended by done/ack, nothing landed)."""
    info, header = await ask_gpu_pool(client, conn, keys)
    rid = header.request_id
    source = await _mapped(client, conn, info, device)
    if source is None:
        await conn.finish(rid)
        return None
    slots = [int(s) for s in header.layout]
    if slots and max(slots) >= source.num_slots:
        raise wire.protocol_error("the peer named a slot outside its GPU tier")
    n = leading_run(keys, header.keys)
    if n:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, land, source.tensor, slots[:n], start, lambda: None)
    await conn.finish(rid)  # the owner acknowledges that its lease held while we copied
    client.count(PATH, conn.peer, n, n * header.page_bytes)
    return n


async def _mapped(client: PullClient, conn: ClientConn, info: PoolInfo, device: int) -> Any:
    """The owner's pool mapped on ``device`` (mapping it the first time), or None when the driver
    refuses (then this owner is never asked over this path again)."""
    source = client.gpu_pools.cached(info, device)
    if source is not None:
        return source
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, client.gpu_pools.get, info, device)
    except (CudaError, TransferError):
        client.gpu_pools.refused.add(conn.peer)
        return None


async def ask_gpu_pool(
    client: PullClient, conn: ClientConn, keys: list[BlockKey]
) -> tuple[PoolInfo, wire.Header]:
    """Send one ``gpu_peer`` pull of ``keys`` on ``conn`` and read the owner's answer: where its
    pool is (remembered in ``client.gpu_pools.known`` for one-sided reads) and the header with
    the slots of the blocks it leased. The request is open until ``conn.finish`` (done/ack)
    or the connection closes. TransferError "protocol" for an answer to another request."""
    rid = client.new_request()
    await conn.send({"t": "pull", "id": rid, "keys": list(keys), "path": PATH, "tag": 0, "ack": True})
    limit = min(conn.max_payload, client.config.max_payload_bytes)
    info = PoolInfo.from_msg(await conn.read(), rid)
    client.gpu_pools.known[conn.peer] = info
    header = wire.Header.from_msg(await conn.read(), list[bytes](keys), limit)
    if header.request_id != rid or header.page_bytes != conn.page_bytes or header.path != PATH:
        raise wire.protocol_error("header does not answer this request")
    return info, header


def leading_run(asked: Sequence[bytes], answered: Sequence[bytes]) -> int:
    """How many of ``asked`` from the first are ``answered``'s first keys, in order."""
    n = 0
    for want, got in zip(asked, answered):
        if bytes(want) != bytes(got):
            break
        n += 1
    return n

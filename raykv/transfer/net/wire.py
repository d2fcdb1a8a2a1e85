"""Control messages: length-prefixed msgpack maps with explicit limits, validated field by field.

Framing on the control stream: a 4-byte big-endian length, then one msgpack map of at most
``max_header_bytes``. A longer length prefix, bytes that are not msgpack, or a map with missing or
ill-typed fields is a :class:`raykv.core.errors.TransferError` with ``reason="protocol"``; nothing is
allocated for a refused message beyond its (bounded) bytes.

Messages (``t`` field):

=========  =========  ==================================================================
hello      s -> c     protocol version, server nonce (see :mod:`raykv.transfer.net.auth`)
auth       c -> s     client proof, client nonce, client node id, client UCX worker address
welcome    s -> c     server proof, node id, page size, limits, shared-memory file, UCX address,
                      ``gpu``: whether same-node peers may map its GPU tier (gpu_peer path)
pull       c -> s     request id, keys (<= max_keys), wanted path ("shm"/"ucx"/"direct"/
                      "gpu_peer"), tag base, shm only: ``sums`` (send checksums), ``ack``
                      (acknowledge ``done``; gpu_peer always acknowledges); ucx: ``posted``
                      (chunk 0's receive is posted: send that chunk first, before the header;
                      an empty message when nothing was found), ``split`` (posted only, 0 <
                      split < keys: chunk 1's receive is posted too; chunk 0 holds the first
                      ``split`` pages found, chunk 1 the rest, sent empty when there are none)
gpu_pool   s -> c     gpu_peer path, right before its header: the GPU tier's export socket,
                      device UUID and slot count (:mod:`raykv.transfer.paths.gpu_peer`)
header     s -> c     keys found (request order), parent keys, parent_is_root, num_tokens,
                      page size, path, payload layout: pages per chunk (ucx, direct) or slots
                      (shm, gpu_peer); direct: a device digest per page
                      (:mod:`raykv.transfer.paths.direct`)
sums       s -> c     one CRC-32 (:func:`raykv.core.records.page_checksum`) per page, sent right
                      after the header's payload has been handed to UCX (see below); for a
                      payload of at most 1 MiB, or pages whose checksums the server kept from
                      an earlier send, they travel in ``header`` instead. Always on the ucx
                      path; on the shm path only when the pull asked for ``sums``
done       c -> s     the client has the pages (shm, gpu_peer: it stopped reading the tier)
ack        s -> c     shm and gpu_peer paths, when asked: the lease was held until ``done``
                      arrived, so every byte the client read was the leased page
error      both       reason + message; the connection is closed after it
=========  =========  ==================================================================

The checksums travel in ``sums`` rather than in ``header`` so the sender can checksum chunk i+1
while chunk i is on the wire, and the receiver can checksum each chunk as it lands: the two CRC
passes overlap with the transfer instead of adding to it. The receiver compares every page before
anything is imported.

The shm path needs no checksums: the client copies the pages straight out of the owner's memory
while the owner holds a lease on them, so nothing travels that could be corrupted (a checksum
guards transit, not local memory). The client must know instead that the lease lasted until it
finished reading (a failing server ends its leases at once): either checksums computed under the
lease match what it read, or the server acknowledges its ``done``.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from raykv.core.errors import TransferError, TransferFailure

VERSION = 4  # 3: ucx pulls may post their first receive with the request (``posted``); 4: ``split``
PATHS = ("shm", "ucx", "direct", "gpu_peer")
_LEN = struct.Struct(">I")


def protocol_error(message: str) -> TransferError:
    return TransferError(message, reason=TransferFailure.PROTOCOL)


def encode(msg: dict[str, Any], max_bytes: int) -> bytes:
    """Frame one message; ValueError-free: raises TransferError if it exceeds ``max_bytes``."""
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > max_bytes:
        raise TransferError(
            f"control message of {len(body)} bytes exceeds {max_bytes}", reason=TransferFailure.LIMIT
        )
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """Parse one message body (no framing); TransferError(protocol) unless it is a map with ``t``."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise protocol_error(f"malformed control message ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise protocol_error("control message is not a map with a type")
    return msg


async def read_message(
    reader: asyncio.StreamReader, max_bytes: int, frame_timeout_s: float | None = None, first: bytes = b""
) -> dict[str, Any]:
    """Read one framed message. EOF: TransferError(reason="closed"); oversize: reason="protocol".

    ``frame_timeout_s``: once the frame's first byte is here, the rest of it must arrive within
    this many seconds (TransferError "timeout"); None: no limit. Waiting for that first byte has
    no limit here: the caller bounds it (an auth deadline, an idle timeout, a pull's timeout).
    ``first``: the frame's leading bytes when the caller has already read them (at most 4)."""
    try:
        if frame_timeout_s is None:
            return decode(await _read_body(reader, max_bytes, first))
        if not first:
            first = await reader.readexactly(1)
        try:
            async with asyncio.timeout(frame_timeout_s):
                body = await _read_body(reader, max_bytes, first)
        except TimeoutError:
            raise TransferError(
                f"control message not complete within {frame_timeout_s:g} s", reason=TransferFailure.TIMEOUT
            ) from None
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise TransferError(
            f"connection closed by peer ({type(exc).__name__})", reason=TransferFailure.CLOSED
        ) from None
    return decode(body)


async def _read_body(reader: asyncio.StreamReader, max_bytes: int, first: bytes) -> bytes:
    """The body of one frame whose first ``len(first)`` bytes were already read."""
    prefix = first + await reader.readexactly(_LEN.size - len(first))
    (length,) = _LEN.unpack(prefix)
    if length > max_bytes:
        raise protocol_error(f"control message of {length} bytes exceeds the {max_bytes}-byte limit")
    return await reader.readexactly(length)


def expect_type(msg: dict[str, Any], kind: str) -> dict[str, Any]:
    """``msg`` if its type is ``kind``; a peer ``error`` message becomes a TransferError."""
    if msg["t"] == "error":
        text = msg.get("message") if isinstance(msg.get("message"), str) else "peer error"
        reason = TransferFailure.from_peer(msg.get("reason"))
        raise TransferError(f"peer refused: {str(text)[:200]}", reason=reason)
    if msg["t"] != kind:
        raise protocol_error(f"expected a {kind!r} message, got {str(msg['t'])[:20]!r}")
    return msg


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], size: int | None = None) -> Any:
    """A field of ``kind`` (bytes of exactly ``size`` when given); TransferError(protocol) else."""
    value: Any = msg.get(name)
    if isinstance(value, bool) and kind is int:
        raise protocol_error(f"field {name!r} must be an int")
    if not isinstance(value, kind):
        raise protocol_error(f"field {name!r} missing or of the wrong type")
    if size is not None and len(value) != size:  # type: ignore[arg-type]
        raise protocol_error(f"field {name!r} must be {size} bytes")
    return value


def int_list(msg: dict[str, Any], name: str, length: int, lo: int, hi: int) -> list[int]:
    """A list of ``length`` ints in ``lo ..= hi``."""
    values = field(msg, name, list)
    if len(values) != length:
        raise protocol_error(f"field {name!r} has {len(values)} entries, expected {length}")
    # msgpack decodes integers as exactly ``int`` (a bool is not one): one pass, then the range.
    if values and not (all(type(v) is int for v in values) and lo <= min(values) and max(values) <= hi):
        raise protocol_error(f"field {name!r} holds a value outside {lo}..{hi}")
    return values


def key_list(msg: dict[str, Any], name: str, max_keys: int) -> list[bytes]:
    """A list of at most ``max_keys`` 32-byte keys."""
    values = field(msg, name, list)
    if len(values) > max_keys:
        raise TransferError(
            f"{len(values)} keys exceed the limit of {max_keys}", reason=TransferFailure.LIMIT
        )
    if not all(type(v) is bytes and len(v) == 32 for v in values):
        raise protocol_error(f"field {name!r} must hold 32-byte keys")
    return values


@dataclass(frozen=True)
class ShmInfo:
    """The server's shared host tier: its file and geometry."""

    path: str
    num_slots: int
    page_bytes: int

    def to_msg(self) -> dict[str, Any]:
        return {"path": self.path, "slots": self.num_slots, "page_bytes": self.page_bytes}

    @classmethod
    def from_msg(cls, msg: Any) -> ShmInfo | None:
        if msg is None:
            return None
        if not isinstance(msg, dict):
            raise protocol_error("field 'shm' must be a map or nil")
        path = field(msg, "path", str)
        slots = field(msg, "slots", int)
        page = field(msg, "page_bytes", int)
        if slots < 1 or page < 1 or len(path) > 4096:
            raise protocol_error("field 'shm' is out of range")
        return cls(path, slots, page)


@dataclass(frozen=True)
class Header:
    """What the server found for one pull, and how the payload is laid out."""

    request_id: int
    path: str
    page_bytes: int
    keys: tuple[bytes, ...]
    parents: tuple[bytes, ...]
    roots: tuple[bool, ...]
    tokens: tuple[int, ...]
    layout: tuple[int, ...]  # ucx: pages per chunk; shm: the slot of each page
    sums: tuple[int, ...] | None = None  # small payloads: the checksums, no ``sums`` message

    def to_msg(self) -> dict[str, Any]:
        return {
            "t": "header",
            "id": self.request_id,
            "path": self.path,
            "page_bytes": self.page_bytes,
            "keys": list(self.keys),
            "parents": list(self.parents),
            "roots": list(self.roots),
            "tokens": list(self.tokens),
            "layout": list(self.layout),
            "sums": list(self.sums) if self.sums is not None else None,
        }

    @classmethod
    def from_msg(cls, msg: dict[str, Any], requested: list[bytes], max_payload: int) -> Header:
        """Validate a header against the request it answers (keys: a subsequence of it)."""
        msg = expect_type(msg, "header")
        page = field(msg, "page_bytes", int)
        path = field(msg, "path", str)
        if path not in PATHS or page < 1:
            raise protocol_error("header path or page size out of range")
        keys = key_list(msg, "keys", len(requested))
        _check_subsequence(keys, requested)
        n = len(keys)
        if n * page > max_payload:
            raise TransferError(
                f"payload of {n * page} bytes exceeds {max_payload}", reason=TransferFailure.LIMIT
            )
        parents = key_list(msg, "parents", n)
        if len(parents) != n:
            raise protocol_error("header lists a parent per key")
        roots = field(msg, "roots", list)
        if len(roots) != n or not all(isinstance(r, bool) for r in roots):
            raise protocol_error("header lists a parent_is_root flag per key")
        tokens = int_list(msg, "tokens", n, 1, 1 << 31)
        layout = field(msg, "layout", list)
        if path in ("ucx", "direct"):
            counts = int_list(msg, "layout", len(layout), 1, n)
            if sum(counts) != n:
                raise protocol_error("header chunk sizes do not add up to the page count")
        else:
            int_list(msg, "layout", n, 0, (1 << 40))
        rid = field(msg, "id", int)
        sums = None if msg.get("sums") is None else tuple(int_list(msg, "sums", n, 0, 0xFFFFFFFF))
        return cls(
            rid, path, page, tuple(keys), tuple(parents), tuple(roots), tuple(tokens), tuple(layout), sums
        )


def _check_subsequence(found: list[bytes], requested: list[bytes]) -> None:
    if len(found) == len(requested):  # every key found: the common case, one comparison
        ok = found == requested
    else:
        it = iter(requested)
        ok = all(any(k == r for r in it) for k in found)
    if not ok:
        raise protocol_error("header keys are not the requested keys in request order")


def error_message(request_id: int | None, reason: str, message: str) -> dict[str, Any]:
    return {"t": "error", "id": request_id, "reason": reason, "message": message[:500]}

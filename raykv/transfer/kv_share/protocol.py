"""The store socket's messages, and the keying of committed blocks both store paths share.

Framing on a Unix stream socket: a 4-byte little-endian length, then one msgpack map of at most
:data:`MAX_FRAME` bytes; the hello frame carries file descriptors (SCM_RIGHTS) with its first
byte. Messages, engine to owner:

- ``hello``: ``lease`` (the inbox lease id the owner granted this engine rank: the engine's proof
  that it was paired), ``page`` (page bytes), ``blocks`` (engine blocks per segment),
  ``regions`` (``[[start, size], ...]``: engine addresses of the shared memory, one descriptor
  each, in order, then the epoch page's descriptor) and ``segments`` (``[[addr, stride, length],
  ...]``: a page is these segments back to back; block ``b``'s segment ``k`` is ``length`` bytes
  at engine address ``addr + b * stride``). Answer: ``{"ok": True}`` or ``{"error": text}``.
- ``store``: ``seq``, ``epoch`` (the engine's epoch word when it sent the request) and
  ``commits``, each ``[blocks, first, parent, tokens, scope, mm, req]`` (:func:`commit_wire`).
  Answer: ``seq``, ``stored``, ``present``, ``refused``, ``abandoned`` (blocks), ``reasons``
  and ``us`` (the owner's wall time), or ``{"error": text}``.

Every value from the wire is validated before use; a bad one is an InvalidArgumentError (the
owner answers it and goes on), a bad frame a StateError (the owner closes the connection).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from raykv.core.errors import InvalidArgumentError, StateError
from raykv.core.keys import (
    MultimodalItem,
    ReuseScope,
    chain_keys,
    check_mm_items,
    clip_mm_items,
    tokens_to_array,
)
from raykv.core.records import BlockRecords

MAX_FRAME = 64 << 20
"""The largest frame either side accepts (a store of a million tokens is about 5 MiB)."""
MAX_FDS = 256
_LEN = struct.Struct("<I")


def send_frame(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send ``msg`` as one frame (``fds`` with its first byte). OSError when the peer is gone."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise InvalidArgumentError("message", f"{len(body)} bytes is over the {MAX_FRAME}-byte frame limit")
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket, want_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: (message, descriptors received with it; the caller owns them).
    EOFError when the peer closed between frames; StateError for a short, oversized or
    undecodable frame (descriptors received are closed then); OSError (e.g. a timeout) passes."""
    fds: list[int] = []
    try:
        if want_fds:
            head, fds, _, _ = socket.recv_fds(sock, _LEN.size, MAX_FDS)
            if not head:
                raise EOFError("the peer closed the store socket")
            head += _recv_exact(sock, _LEN.size - len(head))
        else:
            head = _recv_exact(sock, _LEN.size, eof_ok=True)
        (size,) = _LEN.unpack(head)
        if size > MAX_FRAME:
            raise StateError(f"a {size}-byte store frame is over the limit")
        msg = msgpack.unpackb(_recv_exact(sock, size), raw=False, strict_map_key=True)
        if not isinstance(msg, dict):
            raise StateError("a store frame that is not a map")
        return msg, fds
    except (ValueError, msgpack.UnpackException) as exc:
        close_fds(fds)
        raise StateError(f"an undecodable store frame ({type(exc).__name__})") from None
    except BaseException:
        close_fds(fds)
        raise


def _recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if eof_ok and got == 0:
                raise EOFError("the peer closed the store socket")
            raise StateError("the store socket closed inside a frame")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def close_fds(fds: Sequence[int]) -> None:
    """Close each of ``fds``, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- commits -----------------------------------------------------------------------------------
def commit_wire(
    blocks: Sequence[Any],
    first: int,
    parent: bytes | None,
    tokens: Sequence[int],
    scope: ReuseScope,
    mm_items: Sequence[MultimodalItem],
    req_id: str,
) -> list[Any]:
    """One commit of a store request: engine blocks ``blocks`` are the sequence's blocks
    ``first ..``; ``tokens`` run through the last of them, ``parent`` is block ``first - 1``'s
    key (None for block 0)."""
    array = np.asarray(tokens, dtype=np.uint32).tobytes()
    mm = [[it.digest, it.start, it.length] for it in mm_items]
    return [
        [int(b) for b in blocks],
        first,
        parent,
        array,
        [scope.lora_id, scope.salt, scope.model],
        mm,
        req_id,
    ]


def parse_commit(
    item: Any,
) -> tuple[list[int], int, bytes | None, Any, ReuseScope, tuple[MultimodalItem, ...], str]:
    """The fields of :func:`commit_wire`'s list, checked for type (InvalidArgumentError)."""
    if not isinstance(item, list) or len(item) != 7:
        raise InvalidArgumentError("commit", "must be a list of 7 fields")
    blocks, first, parent, tokens, scope, mm, req = item
    if not isinstance(blocks, list) or not blocks or any(type(b) is not int for b in blocks):
        raise InvalidArgumentError("blocks", "must be a non-empty list of block ids")
    if type(tokens) is not bytes or len(tokens) % 4:
        raise InvalidArgumentError("tokens", "must be uint32 token ids as bytes")
    if not isinstance(scope, list) or len(scope) != 3:
        raise InvalidArgumentError("scope", "must be [lora_id, salt, model]")
    if not isinstance(mm, list) or any(not isinstance(m, list) or len(m) != 3 for m in mm):
        raise InvalidArgumentError("mm_items", "must be a list of [digest, start, length]")
    items = tuple(MultimodalItem(*m) for m in mm)
    return blocks, first, parent, np.frombuffer(tokens, np.uint32), ReuseScope(*scope), items, str(req)


def commit_records(
    tpb: int,
    n: int,
    first: int,
    parent: bytes | None,
    scope: ReuseScope,
    tokens: Any,
    mm_items: Sequence[MultimodalItem],
) -> BlockRecords:
    """The records of ``n`` blocks ``first ..`` of a sequence, keyed by the owner itself from
    the key of block ``first - 1`` (``parent``; None when ``first`` is 0: the scope's root), the
    tokens through them and the multimodal items: an engine never names the keys its bytes go
    under. InvalidArgumentError for a parent that does not match ``first``, too few tokens, or a
    bad scope, token or item."""
    if type(first) is not int or first < 0 or (parent is None) != (first == 0):
        raise InvalidArgumentError("parent", "need a parent key exactly when first_block > 0")
    if not isinstance(scope, ReuseScope):
        raise InvalidArgumentError("scope", "must be a ReuseScope")
    root = scope.root_key() if parent is None else parent
    if type(root) is not bytes or len(root) != 32:
        raise InvalidArgumentError("parent", "must be a 32-byte key")
    array = tokens_to_array(tokens)
    end = (first + n) * tpb
    if len(array) < end:
        raise InvalidArgumentError("tokens", f"{len(array)} tokens for blocks up to {first + n}")
    items = clip_mm_items(check_mm_items(mm_items, None), end)
    keys = chain_keys(root, array[:end], tpb, first, items)
    parents = [root, *keys[:-1]]
    roots = [first == 0] + [False] * (n - 1)
    return BlockRecords(keys, parents, roots, list(itertools.repeat(tpb, n)))

"""A client's authenticated control connection to one page server (see :mod:`raykv.transfer.net.auth`
for the challenge-response and :mod:`raykv.transfer.net.wire` for the messages): what the client's
transfer paths use to talk to the server (:meth:`ClientConn.send`, :meth:`ClientConn.finish`,
:meth:`ClientConn.open_endpoint`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import raykv.transfer.net.wire as wire
from raykv.core.errors import TransferError, TransferFailure
from raykv.transfer.net.auth import CLIENT_LABEL, NONCE_BYTES, SERVER_LABEL, AuthToken, new_nonce
from raykv.transfer.net.config import TransferConfig
from raykv.transfer.net.runtime import abort_endpoint, ucx_address, ucx_endpoint


@dataclass
class ClientConn:
    """One connection and what the server's ``welcome`` said (limits already capped by ours).

    ``max_header_bytes``: this client's control-message limit; ``ucx_ctx``: its UCX context
    (None without UCX); ``endpoint``: the UCX endpoint to the server once opened. ``idle_s``: the
    server's idle timeout (None: not announced); ``idle_since``: ``time.monotonic()`` at the last checkin."""

    peer: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    node: str
    page_bytes: int
    max_keys: int
    max_payload: int
    shm: wire.ShmInfo | None
    server_ucx: bytes | None
    endpoint: Any = None
    gpu: bool = False  # the server offers the gpu_peer path (raykv.transfer.paths.gpu_peer)
    pending: bytes = b""  # a framed ``done`` not written yet: goes before the next message
    max_header_bytes: int = 1 << 16
    ucx_ctx: Any = None
    idle_s: float | None = None
    idle_since: float = 0.0

    def stale(self, now: float) -> bool:
        """Idle for more than half the server's idle timeout: the server may close it at any
        moment, so a pull should not start on it."""
        return self.idle_s is not None and now - self.idle_since > self.idle_s / 2

    def write(self, data: bytes) -> None:
        """Write ``data`` to the stream, after a ``done`` still pending (in the same write)."""
        data, self.pending = self.pending + data, b""
        self.writer.write(data)

    def flush(self) -> None:
        """Write the pending ``done`` unless a message already took it along or the stream closed."""
        if self.pending and not self.writer.is_closing():
            self.writer.write(self.pending)
        self.pending = b""

    def close(self) -> None:
        """Abort the UCX endpoint (cancelling its receives) and close the stream."""
        self.drop_endpoint()
        self.writer.close()

    def drop_endpoint(self) -> None:
        """Abort the UCX endpoint (its posted receives are cancelled: nothing lands afterwards);
        the next :meth:`open_endpoint` opens a new one."""
        abort_endpoint(self.endpoint)
        self.endpoint = None

    def closed(self) -> bool:
        """Whether the server closed the stream (EOF) or it is closing."""
        return self.reader.at_eof() or self.writer.is_closing()

    async def send(self, msg: dict[str, Any]) -> None:
        """Write one control message (after a pending ``done``) and wait until the stream took it;
        TransferError "limit" for a message over ``max_header_bytes``."""
        self.write(wire.encode(msg, self.max_header_bytes))
        await self.writer.drain()

    async def read(self, kind: str | None = None) -> dict[str, Any]:
        """The next control message (of type ``kind`` when given: a peer ``error`` raises its
        TransferError, another type "protocol"); EOF raises "closed"."""
        msg = await wire.read_message(self.reader, self.max_header_bytes)
        return msg if kind is None else wire.expect_type(msg, kind)

    async def finish(self, request_id: int) -> None:
        """Say ``done`` for ``request_id`` and wait for the server's ``ack``: the lease lasted
        until we stopped reading (an error or EOF instead raises: the pages read may not be the
        leased ones)."""
        await self.send({"t": "done", "id": request_id})
        msg = await self.read("ack")
        if msg.get("id") != request_id:
            raise wire.protocol_error("'ack' for another request")

    async def open_endpoint(self) -> Any:
        """The UCX endpoint to the server, opened on first use (TransferError "unavailable" when
        either side has no UCX); valid until :meth:`drop_endpoint` or :meth:`close`."""
        if self.endpoint is None:
            if self.ucx_ctx is None or self.server_ucx is None:
                raise TransferError("no UCX path to this peer", reason=TransferFailure.UNAVAILABLE)
            self.endpoint = await ucx_endpoint(self.ucx_ctx, self.server_ucx)
        return self.endpoint


async def handshake(
    token: AuthToken,
    config: TransferConfig,
    node_id: str,
    ucx_ctx: Any,
    peer: tuple[str, int],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> ClientConn:
    """Run the client side of the mutual challenge-response on a fresh stream; TransferError
    ("protocol", "auth", "closed") when the server does not speak it or fails to prove the token.
    ``ucx_ctx``: this process's UCX context (None without UCX), whose worker address the server
    gets."""
    ucx = ucx_address(ucx_ctx) if ucx_ctx is not None else None
    hello = wire.expect_type(await wire.read_message(reader, 4096), "hello")
    if hello.get("v") != wire.VERSION:
        raise wire.protocol_error(f"unsupported protocol version {str(hello.get('v'))[:10]}")
    server_nonce = wire.field(hello, "nonce", bytes, NONCE_BYTES)
    nonce = new_nonce()
    auth = {
        "t": "auth",
        "mac": token.proof(CLIENT_LABEL, server_nonce, nonce),
        "nonce": nonce,
        "node": node_id,
        "ucx": ucx,
    }
    writer.write(wire.encode(auth, 1 << 17))
    await writer.drain()
    welcome = wire.expect_type(await wire.read_message(reader, config.max_header_bytes), "welcome")
    if not token.check(welcome.get("mac"), SERVER_LABEL, nonce, server_nonce):
        raise TransferError("the server failed authentication", reason=TransferFailure.AUTH)
    server_ucx = welcome.get("ucx")
    return ClientConn(
        peer,
        reader,
        writer,
        wire.field(welcome, "node", str),
        wire.field(welcome, "page_bytes", int),
        max(1, min(wire.field(welcome, "max_keys", int), config.max_keys)),
        max(1, min(wire.field(welcome, "max_payload", int), config.max_payload_bytes)),
        wire.ShmInfo.from_msg(welcome.get("shm")),
        server_ucx if isinstance(server_ucx, bytes) and server_ucx else None,
        gpu=welcome.get("gpu") is True,
        idle_s=_idle_seconds(welcome.get("idle_s")),
        max_header_bytes=config.max_header_bytes,
        ucx_ctx=ucx_ctx,
    )


def _idle_seconds(value: object) -> float | None:
    """The ``idle_s`` of a ``welcome``: a positive finite number of seconds, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 < value < float("inf") else None

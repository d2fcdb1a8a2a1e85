"""A client's authenticated control connection to one page server (see :mod:`raykv.transfer.auth`
for the challenge-response and :mod:`raykv.transfer.wire` for the messages)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from raykv.core.errors import TransferError, TransferFailure
from raykv.transfer import wire
from raykv.transfer.auth import CLIENT_LABEL, NONCE_BYTES, SERVER_LABEL, AuthToken, new_nonce
from raykv.transfer.config import TransferConfig
from raykv.transfer.runtime import abort_endpoint


@dataclass
class ClientConn:
    """One connection and what the server's ``welcome`` said (limits already capped by ours)."""

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
    gpu: bool = False  # the server offers the gpu_peer path (raykv.transfer.gpu_peer)
    pending: bytes = b""  # a framed ``done`` not written yet: goes before the next message

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
        abort_endpoint(self.endpoint)
        self.endpoint = None
        self.writer.close()


async def handshake(
    token: AuthToken,
    config: TransferConfig,
    node_id: str,
    ucx: bytes | None,
    peer: tuple[str, int],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> ClientConn:
    """Run the client side of the mutual challenge-response on a fresh stream; TransferError
    ("protocol", "auth", "closed") when the server does not speak it or fails to prove the token.
    ``ucx``: this process's UCX worker address (None without UCX)."""
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
    )

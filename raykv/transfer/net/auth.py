"""The deployment-wide shared token and the challenge-response that proves it.

Mutual challenge-response on every connection, before anything else is read:

1. server -> client: ``hello`` with a random 32-byte nonce ``ns``.
2. client -> server: ``auth`` with its own nonce ``nc`` and
   ``HMAC-SHA256(token, "raykv/1 client" || ns || nc)``.
3. server -> client: ``welcome`` with ``HMAC-SHA256(token, "raykv/1 server" || nc || ns)``.

Both sides compare with :func:`hmac.compare_digest`. The labels keep one side's proof from being
replayed as the other's. The token itself never leaves the process, and :class:`AuthToken` hides
it from ``repr``/``str`` (so it cannot end up in logs or error messages by accident).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from raykv.core.errors import InvalidArgumentError

NONCE_BYTES = 32
MIN_TOKEN_BYTES = 16
CLIENT_LABEL = b"raykv/1 client"
SERVER_LABEL = b"raykv/1 server"


class AuthToken:
    """A secret shared by every worker of one deployment. Never printed."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_TOKEN_BYTES:
            raise InvalidArgumentError("token", f"must be at least {MIN_TOKEN_BYTES} bytes")
        self._secret = bytes(secret)

    @classmethod
    def generate(cls) -> AuthToken:
        """A fresh random 32-byte token."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def coerce(cls, token: AuthToken | bytes) -> AuthToken:
        """``token`` itself, or an AuthToken wrapping raw bytes (ValueError if too short)."""
        return token if isinstance(token, AuthToken) else cls(token)

    def proof(self, label: bytes, first: bytes, second: bytes) -> bytes:
        """HMAC-SHA256 over ``label || first || second`` (fixed-size nonces: no ambiguity)."""
        return hmac.new(self._secret, label + first + second, hashlib.sha256).digest()

    def check(self, mac: object, label: bytes, first: bytes, second: bytes) -> bool:
        """Constant-time comparison of ``mac`` with :meth:`proof`; False for a non-bytes ``mac``."""
        if not isinstance(mac, bytes):
            return False
        return hmac.compare_digest(mac, self.proof(label, first, second))

    def __repr__(self) -> str:
        return "AuthToken(<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AuthToken) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(hashlib.sha256(b"raykv-token-id" + self._secret).digest())

    def __reduce__(self) -> tuple[Any, ...]:
        return (AuthToken, (self._secret,))


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)

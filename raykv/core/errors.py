"""The whole raykv error hierarchy.

Every error pickles with its message and attributes intact, because errors cross actor boundaries.
Argument and configuration errors subclass ValueError, lookups that find nothing subclass KeyError,
capacity problems subclass CapacityError.
"""

from __future__ import annotations

import enum
from typing import Any


def _rebuild(cls: type[RayKVError], message: str, attrs: dict[str, Any]) -> RayKVError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(attrs)
    return err


class RayKVError(Exception):
    """Base of every raykv error. ``str(err)`` is the message; extra context lives in attributes."""

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.__dict__.update(attrs)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and isinstance(other, RayKVError)
            and other.message == self.message
            and other.__dict__ == self.__dict__
        )

    def __hash__(self) -> int:
        return hash((type(self), self.message))


class ConfigError(RayKVError, ValueError):
    """A configuration value is invalid. ``field`` names the offending field."""

    field: str

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)


class InvalidArgumentError(RayKVError, ValueError):
    """A call argument is invalid. ``argument`` names it."""

    argument: str

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}", argument=argument)


class NotFoundError(RayKVError, KeyError):
    """A lookup found nothing (a layer/role pair not in the layout, an unknown key)."""


class RoleNotFoundError(NotFoundError):
    """The layout has no buffer with this role in this layer."""


class StateError(RayKVError, RuntimeError):
    """The call is not allowed in the object's current state (closed cache, open requests)."""


class ResourceBusyError(StateError):
    """Refused because requests are still open; ``num_open`` says how many."""

    num_open: int


class CapacityError(RayKVError):
    """Not enough capacity for the request."""


class OutOfPagesError(CapacityError):
    """No free page could be made on a tier: nothing more can be evicted there."""


class OutOfMemoryError(CapacityError):
    """A tier could not reserve the memory or file space it was configured with."""


class ImportRejectedError(RayKVError, ValueError):
    """An import batch was rejected as a whole (missing parent, size mismatch, bad record)."""


class IntegrityError(ImportRejectedError):
    """A page's bytes do not match their checksum; nothing was imported."""


class TransferFailure(enum.StrEnum):
    """Why a page transfer failed: every :class:`TransferError` carries one as ``reason``.

    A ``StrEnum``: each member equals (and formats as) its value, so ``err.reason == "timeout"``
    holds and the values are the labels of the failure metrics (``ClientStats.failures``,
    ``ServerStats.errors``, ``raykv_transfer_failures``: no other label exists).

    - ``auth``: a side failed the token's challenge-response (wrong or missing shared token).
    - ``protocol``: the peer sent something malformed or unexpected (bad framing, a wrong message
      type or field, a header that does not answer the request, a slot outside the peer's tier).
    - ``limit``: a message, key list or payload exceeds the configured limits.
    - ``integrity``: a page failed its checksum or digest (``bad_keys`` names them, when known).
    - ``timeout``: the pull (or one wait inside it) ran past its deadline.
    - ``closed``: the peer closed or broke the connection (or went away during a stall).
    - ``connect``: no connection could be opened to the peer's address.
    - ``ucx``: a UCX operation failed (endpoint, send or receive).
    - ``unavailable``: the path asked for cannot be used with this peer (no UCX, no page server,
      no ``gpu_peer`` between these processes, the peer's GPU tier cannot be mapped); nothing was
      imported and the caller may take another path.
    - ``state``: the call is not allowed in the current state (a closed manager cannot lease,
      a synchronous close from the runtime's own loop).
    - ``fault``: a test hook (``ServerFaults``) dropped the connection.
    - ``rejected``: the importing manager refused the batch (page size, partial block, record).
    - ``cancelled``: the pull was cancelled while its pages were being received or imported.
    - ``shm``: a same-node shared-memory mapping (the peer's host tier or its slot directory)
      cannot be used; the caller uses the request paths instead.
    - ``stale``: a page changed while it was read one-sided (``shm_read``/``gpu_read``); nothing
      of it was imported and the keys are asked of the owner.
    - ``refused``: the peer refused the request with a reason this process does not know.
    - ``internal``: the page server failed on an unexpected exception (logged there with its
      traceback); only the server's error counters use it.
    - ``busy``: the page server refused the connection at once because the peer's host, or all
      peers together, already hold as many connections as its caps allow
      (``TransferConfig.max_connections_per_peer`` / ``max_connections``); nothing was read.
    """

    AUTH = "auth"
    PROTOCOL = "protocol"
    LIMIT = "limit"
    INTEGRITY = "integrity"
    TIMEOUT = "timeout"
    CLOSED = "closed"
    CONNECT = "connect"
    UCX = "ucx"
    UNAVAILABLE = "unavailable"
    STATE = "state"
    FAULT = "fault"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    SHM = "shm"
    STALE = "stale"
    REFUSED = "refused"
    INTERNAL = "internal"
    BUSY = "busy"

    @classmethod
    def from_peer(cls, value: object) -> TransferFailure:
        """The member a peer's ``error`` message names; ``refused`` for anything else."""
        if isinstance(value, str) and value in _FAILURE_VALUES:
            return cls(value)
        return cls.REFUSED


_FAILURE_VALUES = frozenset(member.value for member in TransferFailure)


class TransferError(RayKVError):
    """A page transfer failed; nothing was imported and the caller may recompute.

    ``reason`` (required, a :class:`TransferFailure`) says why; anything else raises TypeError
    (a programming error). Further keyword arguments become attributes (``bad_keys``, ...).
    """

    reason: TransferFailure

    def __init__(self, message: str, *, reason: TransferFailure, **attrs: Any) -> None:
        if not isinstance(reason, TransferFailure):
            raise TypeError(f"TransferError reason must be a TransferFailure, got {reason!r}")
        super().__init__(message, reason=reason, **attrs)


class CudaError(RayKVError):
    """A CUDA call failed; ``cuda_error`` holds the CUDA error name."""

    cuda_error: str


class PageCorruptError(RayKVError):
    """Pages read back from a tier failed their checksum or came back short (a disk tier file
    changed under the cache); their bytes were not returned. ``positions`` lists which of the
    pages asked for, as indices into the request. The blocks they back are no longer served."""

    positions: tuple[int, ...]


class UnavailableError(RayKVError):
    """A raykv actor (a cache worker, an index shard, the registry) is dead or did not answer
    within the call timeout; nothing was waited on past that timeout.

    ``reason`` says which: ``"dead"`` (Ray reports the actor dead, or it no longer exists),
    ``"unreachable"`` (Ray cannot reach it now, e.g. while it restarts) or ``"timeout"`` (no answer
    in time, e.g. a stopped process). ``actors`` names the actors concerned; further keyword
    arguments become attributes (``workers``, ``shards``, ...).
    """

    reason: str
    actors: tuple[str, ...]

    def __init__(self, message: str, *, reason: str, actors: tuple[str, ...] = (), **attrs: Any) -> None:
        super().__init__(message, reason=reason, actors=tuple(actors), **attrs)

"""The whole raykv error hierarchy.

Every error pickles with its message and attributes intact, because errors cross actor boundaries.
Argument and configuration errors subclass ValueError, lookups that find nothing subclass KeyError,
capacity problems subclass CapacityError.
"""

from __future__ import annotations

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


class TransferError(RayKVError):
    """A page transfer failed; nothing was imported and the caller may recompute."""


class CudaError(RayKVError):
    """A CUDA call failed; ``cuda_error`` holds the CUDA error name."""

    cuda_error: str

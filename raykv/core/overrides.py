"""Dataclass fields replaced from ``name=value`` text: the command line's overrides of a
configuration (``raykv replay --routing ...``, ``--shape ...``)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from raykv.core.errors import InvalidArgumentError

T = TypeVar("T")


def replace_fields(base: T, text: str, argument: str) -> T:
    """``base`` (a dataclass instance) with the fields ``text`` names replaced: comma-separated
    ``name=value`` pairs, a flag as true/false, a number as the field's int or float, a pair as
    ``low:high`` (one number: both ends). "" gives ``base`` itself. InvalidArgumentError
    (``argument``) for an unknown field or a value of the wrong kind; whatever ``base``'s own
    validation raises for a value it rejects."""
    known = [f.name for f in dataclasses.fields(base)]  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or name not in known:
            raise InvalidArgumentError(argument, f"expected name=value, a field of {known}; got {item!r}")
        default = getattr(base, name)
        try:
            values[name] = _value(default, raw)
        except ValueError:
            kind = type(default).__name__
            raise InvalidArgumentError(
                argument, f"{name} takes a {kind} like {default!r}, got {raw!r}"
            ) from None
    return dataclasses.replace(base, **values) if values else base  # type: ignore[type-var]


def _value(default: Any, raw: str) -> Any:
    """``raw`` read as the kind of ``default`` (ValueError when it is not one)."""
    if isinstance(default, bool):
        if raw.lower() not in ("true", "false"):
            raise ValueError(raw)
        return raw.lower() == "true"
    if isinstance(default, tuple):
        kind = type(default[0])
        lo, sep, hi = raw.partition(":")
        return (kind(lo), kind(hi)) if sep else (kind(raw), kind(raw))
    return type(default)(raw)

"""What the Serve router reads from a request: token ids, reuse scope, a chosen worker, a session.

:func:`parse_request` finds token ids in a request's arguments (or an OpenAI completion's
``prompt`` given as ids); :func:`routed_request` reads the rest from the request they belong to.
Neither raises: a request without usable token ids gets None and is routed by load
(:class:`actors.serve.router.CacheAwareRouter`), never rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from actors.serve.prompts import prompt_ids
from raykv.core.keys import ReuseScope, lora_id_from_name
from raykv.core.types import WorkerId

TOKEN_FIELDS = ("tokens", "prompt_token_ids", "token_ids")
PROMPT_FIELD = "prompt"  # an OpenAI completion request's prompt, when given as token ids


@dataclass(frozen=True)
class RoutedRequest:
    """What routing reads from a request: token ids, reuse scope, an optional worker the
    caller already chose (a PD proxy sets ``target_worker``) and an optional ``session_id`` (the
    router then hashes only the blocks the session's previous prompt did not have)."""

    tokens: tuple[int, ...]
    scope: ReuseScope
    target: WorkerId | None = None
    session: str | None = None


def scope_of(lora_id: Any = None, cache_salt: Any = None) -> ReuseScope:
    """The ReuseScope of a request: a str ``cache_salt`` is hashed (ReuseScope.from_cache_salt),
    an int one is the salt itself; a str ``lora_id`` (an adapter name) maps through
    :func:`raykv.core.keys.lora_id_from_name`, an int one is the id itself. Raises ValueError for bad
    values."""
    if isinstance(lora_id, str):
        lora_id = lora_id_from_name(lora_id)
    if isinstance(cache_salt, str):
        return ReuseScope.from_cache_salt(cache_salt, lora_id)
    return ReuseScope(lora_id, cache_salt)


def _lora_of(source: Any) -> Any:
    """``lora_id``, else a ``lora_request``'s ``lora_int_id`` (or its ``lora_name``), else None."""
    lora = _get(source, "lora_id")
    if lora is not None:
        return lora
    request = _get(source, "lora_request")
    if request is None:
        return None
    number = _get(request, "lora_int_id")
    return number if number is not None else _get(request, "lora_name")


def _get(source: Any, name: str) -> Any:
    if isinstance(source, Mapping):
        return source.get(name)
    return getattr(source, name, None)


def parse_request(args: Sequence[Any], kwargs: Mapping[str, Any]) -> RoutedRequest | None:
    """Find token ids (``tokens``, ``prompt_token_ids``, ``token_ids``, or an OpenAI completion's
    ``prompt`` given as ids) in the keyword arguments
    or in a positional argument (a mapping or an object with attributes), with ``lora_id`` (or a
    ``lora_request`` with ``lora_int_id`` / ``lora_name``), ``cache_salt``, ``target_worker`` and
    ``session_id`` from the same place. None when there are none or they
    are malformed (the request is then routed without the cache, never rejected)."""
    for source in (kwargs, *args):
        for name in (*TOKEN_FIELDS, PROMPT_FIELD):
            tokens = _get(source, name)
            if name == PROMPT_FIELD:
                tokens = prompt_ids(tokens)
            if tokens is None:
                continue
            return routed_request(source, tokens)
    return None


def routed_request(source: Any, tokens: Sequence[Any]) -> RoutedRequest | None:
    """The RoutedRequest of ``tokens`` with the scope, ``target_worker`` and ``session_id`` read
    from ``source`` (the request they belong to); None when any is malformed."""
    try:
        ids = tuple(int(t) for t in tokens)
        scope = scope_of(_lora_of(source), _get(source, "cache_salt"))
    except (TypeError, ValueError):
        return None
    target = _get(source, "target_worker") or _extra(source, "target_worker")
    session = _get(source, "session_id") or _extra(source, "session_id")
    worker = WorkerId(str(target)) if target else None
    return RoutedRequest(ids, scope, worker, str(session) if session else None)


def _extra(source: Any, name: str) -> Any:
    """A field an OpenAI request (a pydantic model) took as an extra (``extra_body``)."""
    extra = getattr(source, "model_extra", None)
    return extra.get(name) if isinstance(extra, Mapping) else None

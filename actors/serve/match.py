"""The Serve router's match travels with the request to the engine it routes to.

:class:`actors.serve.router.CacheAwareRouter` asks the index where a request's prefix is cached to rank
the replicas (:meth:`actors.serve.ranking.CacheRanker.rank`). The replica's engine would then ask the
index the same question (the vLLM connector's lookup: which other worker holds more than the
paired one). Instead, :func:`engine_route` turns the router's answer into the field
:class:`raykv.integrations.vllm.route.Route` describes (the leading blocks each of the best few
workers holds, of the blocks the engine will look up, and a check of the keys), the ranker keeps
it per request (``CacheRanker.routes``), and :func:`forward_route` puts it in the forwarded
request's ``kv_transfer_params["raykv"]["route"]``: the engine asks only its paired worker
(``actors.vllm.link.RayDeploymentLink._answer``). One routing decision, one index call.

Which requests carry it: those the ranker routed by the index to a deployment whose every
candidate replica announces ``raykv_pulls`` (its engine loads KV through RaykvConnector, fetching
what other workers hold) and the engines' keys (``raykv_keys``, so that the router's keys are
theirs), and whose request is an object with a ``kv_transfer_params`` attribute (vLLM's OpenAI
requests) or a mapping with a ``"kv_transfer_params"`` key, as an argument or keyword of the
call. Ray's prefill/decode decode server (it orchestrates prefill and refuses requests that
already carry ``kv_transfer_params``) announces neither, so its requests are never changed.
The request is never changed in place: the call's argument is replaced by a copy (a pydantic
``model_copy``) whose ``kv_transfer_params`` is a new dict keeping every other key, and
``"raykv"`` fields such as a producer's ``worker``/``blocks``, which the engine still honours
first. A decision without a match (a target, a fallback) leaves the request as it is. The router
kwarg ``forward_route=False`` turns forwarding off (the engines then ask the index themselves).
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from raykv.core.types import WorkerId
from raykv.index.prefix_index import RouteMatch
from raykv.integrations.vllm.route import FIELD, Route

log = logging.getLogger(__name__)

PARAMS = "kv_transfer_params"
RAYKV = "raykv"  # the connector's key in kv_transfer_params (raykv.integrations.vllm.scheduler)
ROUTE_WORKERS = 4
"""Most workers a forwarded match names, those holding the most blocks."""


def engine_route(
    keys: Sequence[bytes],
    matches: Mapping[WorkerId, RouteMatch],
    num_tokens: int,
    tokens_per_block: int,
    most: int = ROUTE_WORKERS,
) -> dict[str, Any] | None:
    """The field for the engine of a prompt of ``num_tokens`` tokens whose full blocks' keys
    (in the engines' block size ``tokens_per_block`` and scope) are ``keys``, given the index's
    answer ``matches`` for them: it covers the blocks the engine looks up (every full block
    before the prompt's last token, which vLLM always computes) and names the ``most`` workers
    holding the most of them (ties by name). None when the engine looks up no block."""
    usable = min(len(keys), (num_tokens - 1) // tokens_per_block)
    if usable <= 0:
        return None
    held = {str(w): min(m.blocks, usable) for w, m in matches.items() if m.blocks > 0}
    best = sorted(held.items(), key=lambda item: (-item[1], item[0]))[:most]
    return Route.of(keys[:usable], dict(best)).field()


def forward_route(
    pending: Any, route: Mapping[str, Any] | None, counters: collections.Counter[str] | None = None
) -> bool:
    """Put ``route`` (an :func:`engine_route` field) in the ``kv_transfer_params`` of the request
    in ``pending`` (a Serve ``PendingRequest``: ``args``, a list, and ``kwargs``), replacing that
    argument by a copy; whether it did (counted in ``counters["routes_forwarded"]``). Nothing
    happens without a route or a request that can carry it (module docstring). Never raises:
    a request it cannot copy is sent as it is (logged)."""
    if route is None:
        return False
    try:
        done = _forward(pending, dict(route))
    except Exception as exc:
        log.debug("raykv: the router's match was not forwarded: %s", exc)
        return False
    if done and counters is not None:
        counters["routes_forwarded"] += 1
    return done


def _forward(pending: Any, route: dict[str, Any]) -> bool:
    """:func:`forward_route` for the first keyword or argument of ``pending`` that can carry it."""
    kwargs: MutableMapping[str, Any] = pending.kwargs
    if PARAMS in kwargs:
        params = _with_route(kwargs[PARAMS], route)
        if params is not None:
            kwargs[PARAMS] = params
        return params is not None
    args: list[Any] = pending.args
    for i, arg in enumerate(args):
        mapping = isinstance(arg, Mapping)
        if not (PARAMS in arg if mapping else hasattr(arg, PARAMS)):
            continue
        params = _with_route(arg[PARAMS] if mapping else getattr(arg, PARAMS), route)
        if params is not None:
            args[i] = {**arg, PARAMS: params} if mapping else _copy_with(arg, params)
        return params is not None
    return False


def _with_route(params: Any, route: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of ``params`` (None or a mapping) with ``route`` in its ``"raykv"`` mapping; None
    when ``params`` or its ``"raykv"`` entry is something else (left alone)."""
    if params is not None and not isinstance(params, Mapping):
        return None
    out = dict(params or {})
    ours = out.get(RAYKV)
    if ours is not None and not isinstance(ours, Mapping):
        return None
    out[RAYKV] = {**(ours or {}), FIELD: route}
    return out


def _copy_with(request: Any, params: dict[str, Any]) -> Any:
    """A shallow copy of ``request`` whose ``kv_transfer_params`` is ``params``."""
    model_copy = getattr(request, "model_copy", None)
    if callable(model_copy):  # a pydantic model (vLLM's OpenAI requests)
        return model_copy(update={PARAMS: params})
    out = copy.copy(request)
    setattr(out, PARAMS, params)
    return out

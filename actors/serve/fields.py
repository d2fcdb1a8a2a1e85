"""What a Serve replica announces to raykv's routers, and how a router reads it.

A replica paired with a raykv CacheWorker puts these fields in its ``record_replica_metadata``
(static) and ``record_routing_stats`` (every ``stats_period_s``, beside its load); the readers
take a replica as Serve's router sees it (``replica_metadata`` and ``routing_stats`` mappings)
and return None or False for a field that is missing or malformed, never raise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from raykv.core.types import WorkerId

WORKER_FIELD = "raykv_worker"
CAPACITY_FIELD = "raykv_cache_blocks"  # the paired worker's capacity in blocks (routing stats)
PULLS_FIELD = "raykv_pulls"  # True: the replica's engine pulls blocks other workers hold
KEYS_FIELD = "raykv_keys"
"""Replica metadata and routing stats: ``[tokens per block, model fingerprint hex]`` of the
replica's engine (once it bound to its worker): how a router keys requests for it
(:func:`keys_of`)."""
TIMING_FIELD = "raykv_timing"
"""Routing stats: the replica's totals since it started, ``[pulled tokens, pull us, prefilled
tokens, prefill us]`` (its engine's per-request ``pulled_tokens``/``fetch_us`` and
``prefilled_tokens``/``prefill_us`` added up); routers price a pull against a prefill from them."""


def worker_of(replica: Any) -> WorkerId | None:
    """The raykv worker a replica announced (replica metadata first, then routing stats)."""
    for source in (getattr(replica, "replica_metadata", None), getattr(replica, "routing_stats", None)):
        name = source.get(WORKER_FIELD) if isinstance(source, Mapping) else None
        if name:
            return WorkerId(str(name))
    return None


def capacity_of(replica: Any) -> int | None:
    """The capacity in blocks of a replica's raykv worker, as it reported it (None: not told)."""
    for source in (getattr(replica, "replica_metadata", None), getattr(replica, "routing_stats", None)):
        blocks = source.get(CAPACITY_FIELD) if isinstance(source, Mapping) else None
        if isinstance(blocks, int) and blocks >= 0:
            return blocks
    return None


def pulls_of(replica: Any) -> bool:
    """Whether a replica announced that its engine pulls the blocks another worker holds (the
    raykv vLLM connector loading KV: a remote hit is fetched, not recomputed)."""
    for source in (getattr(replica, "replica_metadata", None), getattr(replica, "routing_stats", None)):
        if isinstance(source, Mapping) and PULLS_FIELD in source:
            return source[PULLS_FIELD] is True
    return False


def timing_of(replica: Any) -> tuple[int, int, int, int] | None:
    """A replica's reported :data:`TIMING_FIELD` totals (None: not reported or malformed)."""
    stats = getattr(replica, "routing_stats", None)
    got = stats.get(TIMING_FIELD) if isinstance(stats, Mapping) else None
    if isinstance(got, (list, tuple)) and len(got) == 4 and all(type(x) is int and x >= 0 for x in got):
        return (got[0], got[1], got[2], got[3])
    return None


def keys_of(replica: Any) -> tuple[int, bytes] | None:
    """(tokens per block, model fingerprint) a replica's engine keys its blocks with, as it
    announced them in :data:`KEYS_FIELD` (replica metadata first, then routing stats; None: not
    announced or malformed)."""
    got = None
    for source in (getattr(replica, "replica_metadata", None), getattr(replica, "routing_stats", None)):
        got = source.get(KEYS_FIELD) if isinstance(source, Mapping) else None
        if got is not None:
            break
    if not (isinstance(got, (list, tuple)) and len(got) == 2 and type(got[0]) is int and got[0] > 0):
        return None
    try:
        model = bytes.fromhex(str(got[1]))
    except ValueError:
        return None
    return (got[0], model) if len(model) == 32 else None


def key_scheme(replicas: Sequence[Any]) -> tuple[int, bytes] | Literal[False] | None:
    """How the replicas' engines key blocks (:func:`keys_of`): the one (tokens per block, model
    fingerprint) those that announced one share; None when none did (the deployment's block size
    then, no model); False when they announced different ones."""
    found = {k for k in (keys_of(r) for r in replicas) if k is not None}
    if len(found) > 1:
        return False
    return found.pop() if found else None

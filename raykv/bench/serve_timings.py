"""The store of router timings of ``raykv bench serve`` (a plain class; the bench runs one as a
named Ray actor, :mod:`actors.bench.serve`, and the timed routers of
:mod:`actors.bench.serve_routers` report to it with fire-and-forget calls). Kept apart from the
routers so the actor's process imports nothing heavy."""

from __future__ import annotations

import collections
from typing import Any


class RouterTimings:
    """Per bench config: every ``choose_replicas`` call's seconds and request id, every
    ``on_request_routed`` callback's seconds and replica (``get``: requests per replica, most
    first), and the last decision counters a router reported (raykv's: ``cache_routed``,
    ``fallback``, ``rendered`` ...)."""

    def __init__(self) -> None:
        self.choose: dict[str, list[float]] = collections.defaultdict(list)
        self.requests: dict[str, set[str]] = collections.defaultdict(set)
        self.routed: dict[str, list[float]] = collections.defaultdict(list)
        self.replicas: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.counters: dict[str, dict[str, int]] = {}

    def add(self, name: str, seconds: float, request_id: str | None) -> None:
        self.choose[name].append(float(seconds))
        if request_id is not None:
            self.requests[name].add(request_id)

    def add_routed(self, name: str, seconds: float, replica: str = "") -> None:
        self.routed[name].append(float(seconds))
        self.replicas[name][replica] += 1

    def set_counters(self, name: str, counters: dict[str, int]) -> None:
        self.counters[name] = dict(counters)

    def get(self, name: str) -> dict[str, Any]:
        return {
            "choose_s": list(self.choose.get(name, ())),
            "requests": len(self.requests.get(name, ())),
            "routed_s": list(self.routed.get(name, ())),
            "replicas": sorted(self.replicas.get(name, {}).values(), reverse=True),
            "counters": dict(self.counters.get(name, {})),
        }

    def ping(self) -> bool:
        return True


TIMINGS_ACTOR = "raykv-bench-serve-timings"
"""The name of the bench's :class:`RouterTimings` actor (in the run's own namespace)."""
SALT_PREFIX = "raykv-bench-serve:"


def phase_salt(phase: str, run_id: str) -> str:
    """The ``cache_salt`` of a request of ``phase`` (a config's name, or ``warmup-<config>``) in
    run ``run_id`` (vLLM takes no ``/`` in a salt)."""
    return f"{SALT_PREFIX}{phase}:{run_id}"


def salt_phase(salt: object) -> str | None:
    """The phase a ``cache_salt`` names; None for another salt."""
    if isinstance(salt, str) and salt.startswith(SALT_PREFIX):
        return salt[len(SALT_PREFIX) :].split(":", 1)[0]
    return None


def policy_of(phase: str | None) -> str | None:
    """The config whose routing a phase's requests get: the config itself, or the one a warmup
    phase warms."""
    if phase is not None and phase.startswith("warmup-"):
        return phase[len("warmup-") :]
    return phase

"""Bounded waits and liveness for the Ray layer.

- :data:`ROUTE_BUDGET_MS` is the deadline of every index call a request waits on
  (``actors.cache.index.IndexClient`` routes, blocking or async): past it the shards that answered are
  merged and the others count as holding none of their keys.
- :data:`CALL_TIMEOUT_S` bounds every other call raykv waits on in actors/ (flushes, worker
  calls, ``connect``, peer lookups before a pull); :data:`START_TIMEOUT_S` bounds waiting
  for actors that were just created (process start and imports) and their shutdown.
  :func:`wait` is ``ray.get`` under such a bound that raises
  :class:`raykv.core.errors.UnavailableError` instead of Ray's own exceptions.
- :class:`Pinger` keeps a :class:`raykv.routing.liveness.Liveness` per kind of target (workers,
  index shards) current with cheap pings (``identity`` / ``ping``) from a daemon thread, so
  routing decisions read the state and never wait on a ping. A worker is skipped once a ping has
  been unanswered for :data:`PING_LATE_S` (or failed); an index shard once a route to it missed
  its deadline (``ROUTE_BUDGET_MS``) or failed. Each is taken back after its next good answer
  (for a late shard: to a ping sent after the miss).

Threads that use Ray must stop before ``ray.shutdown()`` (see :mod:`actors.cache.ray_util`): every
Pinger is stopped by :func:`stop_all`, which ``actors.cache.ray_util.shutdown_ray`` and interpreter
exit call; ``RayKVCluster.close()`` stops its own.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import ray

from raykv.core.errors import UnavailableError
from raykv.routing.liveness import Liveness

log = logging.getLogger(__name__)

ROUTE_BUDGET_MS = 250.0
"""Default deadline, in milliseconds, of an index route on a request's path (``IndexClient``'s
``route_budget_ms``; each call may pass its own ``budget_ms``)."""
CALL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0
PING_INTERVAL_S = 0.25
PING_LATE_S = 1.0
_RESEND_AFTER_S = 30.0  # an answer this late is given up on and the ping sent again
_RESOLVE_EVERY_S = 1.0  # how often a name without an actor is looked up again


def unavailable(exc: BaseException, what: str, timeout_s: float) -> UnavailableError:
    """The UnavailableError for a Ray exception raised while waiting on ``what`` (actor names)."""
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return UnavailableError(f"{what}: no answer within {timeout_s:g}s", reason="timeout", actors=(what,))
    if isinstance(exc, ray.exceptions.ActorDiedError):
        return UnavailableError(f"{what}: the actor died", reason="dead", actors=(what,))
    return UnavailableError(
        f"{what}: unreachable ({type(exc).__name__})", reason="unreachable", actors=(what,)
    )


def wait(refs: Any, what: str, timeout_s: float | None = None) -> Any:
    """``ray.get(refs)`` bounded by ``timeout_s`` (default :data:`CALL_TIMEOUT_S`).

    Raises UnavailableError (``reason`` timeout, dead or unreachable) for Ray's timeout and actor
    errors; an error raised by the called method itself propagates as raised there.
    """
    timeout = CALL_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return ray.get(refs, timeout=timeout)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise unavailable(exc, what, timeout) from exc


def died(exc: BaseException) -> bool:
    """True when ``exc`` says the actor is dead (rather than slow or restarting)."""
    return isinstance(exc, ray.exceptions.ActorDiedError)


_PINGERS: weakref.WeakSet[Pinger] = weakref.WeakSet()


def stop_all() -> None:
    """Stop every running Pinger (before ``ray.shutdown()``; also run at interpreter exit)."""
    for pinger in list(_PINGERS):
        pinger.close()


atexit.register(stop_all)  # registered after ray's own atexit shutdown, so it runs first


class Pinger:
    """Pings named actors from a daemon thread and keeps ``workers``/``shards`` Liveness current.

    ``workers`` and ``shards`` map actor names (in ``namespace``) to handles, or None for a name
    the thread looks up itself (at once, then every second until found; a name not found is
    dead). At most one ping per actor is outstanding.
    ``handle(name)`` is the current handle (None until found).
    """

    def __init__(
        self,
        namespace: str,
        workers: Mapping[str, Any],
        shards: Mapping[str, Any] | None = None,
        interval_s: float = PING_INTERVAL_S,
        late_s: float = PING_LATE_S,
    ) -> None:
        shards = shards or {}
        self.namespace = namespace
        self.workers = Liveness(workers, late_s)
        self.shards = Liveness(shards, CALL_TIMEOUT_S)
        self.interval_s = interval_s
        self._handles: dict[str, Any] = {**workers, **shards}
        self._method = {**dict.fromkeys(workers, "identity"), **dict.fromkeys(shards, "ping")}
        self._outstanding: dict[str, tuple[Any, float]] = {}
        self._due: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def handle(self, name: str) -> Any:
        return self._handles.get(name)

    def _kind(self, name: str) -> Liveness:
        return self.workers if self._method[name] == "identity" else self.shards

    def start(self) -> Pinger:
        """Start the thread (idempotent); returns self."""
        if self._thread is None and self._handles:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="raykv-liveness")
            _PINGERS.add(self)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and wait for it (it sleeps at most ``interval_s`` at a time)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=CALL_TIMEOUT_S)
        _PINGERS.discard(self)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception:  # never let the thread die: routing would read stale state
                log.exception("raykv liveness round failed")
                self._stop.wait(self.interval_s)

    def _round(self) -> None:
        now = time.monotonic()
        for name in list(self._handles):
            if self._handles[name] is None:
                self._resolve(name, now)
            elif self._ping_due(name, now):
                self._send(name, now)
        refs = {ref: name for name, (ref, _) in self._outstanding.items()}
        if not refs:
            self._stop.wait(self.interval_s)
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.interval_s)
        for ref in ready:
            self._observe(refs[ref], ref)

    def _ping_due(self, name: str, now: float) -> bool:
        """No ping outstanding and the interval passed, or the outstanding one is given up on."""
        if name in self._outstanding:
            return now - self._outstanding[name][1] > _RESEND_AFTER_S
        return now >= self._due.get(name, 0.0)

    def _send(self, name: str, now: float) -> None:
        ref = getattr(self._handles[name], self._method[name]).remote()
        self._outstanding[name] = (ref, now)
        self._kind(name).sent(name, now)

    def _observe(self, name: str, ref: Any) -> None:
        self._outstanding.pop(name, None)
        now = time.monotonic()
        self._due[name] = now + self.interval_s
        try:
            answer = ray.get(ref, timeout=CALL_TIMEOUT_S)
        except Exception as exc:
            self._kind(name).failed(name, now, dead=died(exc))
            return
        incarnation = answer[2] if isinstance(answer, tuple) and len(answer) == 3 else None
        self._kind(name).answered(name, now, incarnation)

    def _resolve(self, name: str, now: float) -> None:
        if now < self._due.get(name, 0.0):
            return
        self._due[name] = now + _RESOLVE_EVERY_S
        try:
            self._handles[name] = ray.get_actor(name, namespace=self.namespace)
        except ValueError:  # no such actor alive: dead (or never started)
            self._kind(name).failed(name, now, dead=True)
            return
        self._send(name, now)

"""Liveness (pure): which named targets (cache workers, index shards) routing may use right now.

A :class:`Liveness` turns ping observations into a :class:`Health` per target; whoever pings
(``actors.cache.liveness.Pinger``, a thread of cheap actor calls) feeds it, and routing decisions only
read it, so a decision never waits on a ping. The rules:

- a good answer makes a target ``up`` (and records its incarnation: a new one counts a restart);
- a ping (or any call) outstanding for more than ``late_after_s`` makes it ``late``, as does a
  caller's :meth:`Liveness.late` after one of its own calls missed its deadline, until the next
  good answer to a ping sent after that miss (an answer to a ping sent earlier may have been
  given before the target stalled, so it does not take the target back);
- an error makes it ``unreachable``, or ``dead`` when the runtime says the target died (a dead
  target is still pinged, so one restarted under the same name comes back ``up``).

Targets never heard from are ``up`` (optimistic: a fresh handle routes at once). Every method is
thread-safe and O(targets).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Health(enum.StrEnum):
    """What routing knows about a target: only ``up`` targets are preferred."""

    UP = "up"
    LATE = "late"
    UNREACHABLE = "unreachable"
    DEAD = "dead"


@dataclass
class _State:
    health: Health = Health.UP
    sent_at: float | None = None  # the outstanding ping's send time
    late_at: float | None = None  # when a caller last reported a missed deadline (Liveness.late)
    incarnation: int | None = None
    restarts: int = 0
    changed_at: float = 0.0


class Liveness:
    """Health per named target from ping observations (times are the caller's monotonic clock).

    ``late_after_s``: how long a ping may stay unanswered before the target counts as ``late``.
    """

    def __init__(self, targets: Iterable[str], late_after_s: float) -> None:
        if late_after_s <= 0:
            raise ValueError(f"late_after_s must be > 0, got {late_after_s}")
        self.late_after_s = late_after_s
        self._lock = threading.Lock()
        self._states = {str(t): _State() for t in targets}

    @property
    def targets(self) -> list[str]:
        return list(self._states)

    def sent(self, target: str, now: float) -> None:
        """A ping to ``target`` left at ``now`` (its answer is outstanding until observed)."""
        with self._lock:
            self._states[target].sent_at = now

    def answered(self, target: str, now: float, incarnation: int | None = None) -> None:
        """The outstanding ping to ``target`` (or, with no ping recorded by :meth:`sent`, some call)
        was answered: up again, unless ``target`` is ``late`` and that ping was sent before the
        caller's miss (:meth:`late`): then it stays late and only the ping is no longer outstanding.
        A different ``incarnation`` than last time is a restart."""
        with self._lock:
            st = self._states[target]
            if incarnation is not None:
                if st.incarnation is not None and incarnation != st.incarnation:
                    st.restarts += 1
                st.incarnation = incarnation
            stale = (
                st.health is Health.LATE
                and st.late_at is not None
                and st.sent_at is not None
                and st.sent_at < st.late_at
            )
            st.sent_at = None
            if not stale:
                self._set(st, Health.UP, now)

    def failed(self, target: str, now: float, dead: bool) -> None:
        """A call to ``target`` failed: ``dead`` when the runtime says it died, else unreachable."""
        with self._lock:
            st = self._states[target]
            st.sent_at = None
            self._set(st, Health.DEAD if dead else Health.UNREACHABLE, now)

    def late(self, target: str, now: float) -> None:
        """A caller's own call to ``target`` missed its deadline at ``now``: ``late`` until it
        answers a ping sent after ``now`` (see :meth:`answered`). A worse state (unreachable,
        dead) is kept."""
        with self._lock:
            st = self._states[target]
            if st.health in (Health.UP, Health.LATE):
                st.late_at = now
                self._set(st, Health.LATE, now)

    def answering(self, target: str) -> bool:
        """Whether ``target`` is worth asking: nothing of its own failed or missed its deadline
        since its last good answer. A ping merely outstanding (``late`` by the clock, e.g. a loaded
        machine) does not count against it; a caller's timed-out call (:meth:`late`), an error or
        a death does."""
        with self._lock:
            return self._states[target].health is Health.UP

    def health(self, target: str, now: float) -> Health:
        with self._lock:
            return self._health(self._states[target], now)

    def usable(self, targets: Sequence[str], now: float) -> list[str]:
        """``targets`` that are up, in order; if none is, those not dead (a late ping may only
        mean a loaded machine); if every one is dead, []."""
        with self._lock:
            states = [(t, self._health(self._states[t], now)) for t in targets]
        up = [t for t, h in states if h is Health.UP]
        return up or [t for t, h in states if h is not Health.DEAD]

    def down(self, now: float) -> dict[str, Health]:
        """Every target that is not up, with its health."""
        with self._lock:
            states = {t: self._health(st, now) for t, st in self._states.items()}
        return {t: h for t, h in states.items() if h is not Health.UP}

    def restarts(self, target: str) -> int:
        """How many times ``target`` answered with a new incarnation."""
        with self._lock:
            return self._states[target].restarts

    def _health(self, st: _State, now: float) -> Health:
        if st.health is Health.UP and st.sent_at is not None and now - st.sent_at > self.late_after_s:
            return Health.LATE
        return st.health

    @staticmethod
    def _set(st: _State, health: Health, now: float) -> None:
        if st.health is not health:
            st.health = health
            st.changed_at = now

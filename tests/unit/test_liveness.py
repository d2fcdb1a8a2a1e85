"""The liveness policy (raykv.routing.liveness.Liveness) on hand-fed ping observations."""

from __future__ import annotations

import pytest

from raykv.routing.liveness import Health, Liveness


def test_fresh_targets_are_up_and_a_late_ping_takes_one_down_until_it_answers() -> None:
    live = Liveness(["a", "b"], late_after_s=1.5)
    assert live.usable(["a", "b"], 0.0) == ["a", "b"]
    live.sent("a", 10.0)
    assert live.health("a", 11.0) is Health.UP  # outstanding, not late yet
    assert live.health("a", 11.6) is Health.LATE
    assert live.usable(["a", "b"], 11.6) == ["b"]
    assert live.down(11.6) == {"a": Health.LATE}
    live.answered("a", 12.0, incarnation=7)
    assert live.usable(["a", "b"], 12.0) == ["a", "b"] and live.down(12.0) == {}


def test_dead_targets_are_never_usable_and_come_back_with_a_new_incarnation() -> None:
    live = Liveness(["a", "b"], late_after_s=1.0)
    live.answered("a", 0.0, incarnation=1)
    live.failed("a", 1.0, dead=True)
    live.failed("b", 1.0, dead=False)
    assert live.health("a", 1.0) is Health.DEAD and live.health("b", 1.0) is Health.UNREACHABLE
    assert live.usable(["a", "b"], 1.0) == ["b"]  # none up: the ones not dead
    live.failed("b", 2.0, dead=True)
    assert live.usable(["a", "b"], 2.0) == []
    live.sent("a", 3.0)
    live.answered("a", 3.1, incarnation=2)  # restarted by the runtime
    assert live.health("a", 3.1) is Health.UP and live.restarts("a") == 1
    live.answered("a", 4.0, incarnation=2)
    assert live.restarts("a") == 1


def test_a_callers_timeout_marks_late_until_the_next_good_answer() -> None:
    live = Liveness(["s"], late_after_s=5.0)
    live.late("s", 1.0)
    assert live.health("s", 1.0) is Health.LATE
    live.failed("s", 2.0, dead=False)
    live.late("s", 2.5)  # does not hide a worse state
    assert live.health("s", 2.5) is Health.UNREACHABLE
    live.answered("s", 3.0)
    assert live.health("s", 3.0) is Health.UP
    with pytest.raises(ValueError):
        Liveness(["s"], late_after_s=0)


def test_a_slow_ping_does_not_stop_a_target_from_being_asked() -> None:
    live = Liveness(["s0", "s1"], late_after_s=1.0)
    live.sent("s0", 0.0)
    assert live.health("s0", 5.0) is Health.LATE  # its ping is outstanding: a loaded machine?
    assert live.answering("s0")  # ... still worth asking (the caller's own timeout bounds it)
    live.late("s1", 5.0)  # a caller's call timed out: skipped until the next good answer
    assert not live.answering("s1")
    live.answered("s1", 6.0)
    assert live.answering("s1")
    live.failed("s0", 7.0, dead=True)
    assert not live.answering("s0")

"""Liveness after a caller's missed deadline (raykv.routing.liveness.Liveness.late): a target is
taken back only by an answer to a ping sent after the miss, never by one sent before it (that
answer may have been given before the target stalled)."""

from __future__ import annotations

from raykv.routing.liveness import Health, Liveness


def test_an_answer_to_a_ping_sent_before_the_miss_does_not_take_a_late_target_back() -> None:
    live = Liveness(["s0", "s1"], late_after_s=5.0)
    live.sent("s0", 1.0)  # in flight when the target stalls
    live.late("s0", 1.3)  # a caller's route missed its deadline
    live.answered("s0", 1.4)  # the old ping's answer, observed after the miss
    assert live.health("s0", 1.4) is Health.LATE and not live.answering("s0")
    assert live.usable(["s0", "s1"], 1.4) == ["s1"]
    live.sent("s0", 1.6)  # the next ping, sent after the miss
    live.answered("s0", 1.7)
    assert live.health("s0", 1.7) is Health.UP and live.answering("s0")


def test_a_stale_answer_still_ends_the_outstanding_ping() -> None:
    live = Liveness(["s"], late_after_s=1.0)
    live.sent("s", 0.0)
    live.late("s", 0.5)
    live.answered("s", 0.6)  # stale: stays late, but no ping is outstanding any more
    live.answered("s", 10.0)  # an answer with no ping recorded (a caller's own call) counts
    assert live.health("s", 10.0) is Health.UP


def test_a_second_miss_moves_the_mark_and_a_worse_state_is_kept() -> None:
    live = Liveness(["s"], late_after_s=5.0)
    live.late("s", 1.0)
    live.sent("s", 2.0)
    live.late("s", 3.0)  # missed again (asked while late): pings sent before 3.0 are stale
    live.answered("s", 3.5)
    assert live.health("s", 3.5) is Health.LATE
    live.failed("s", 4.0, dead=True)
    live.late("s", 4.5)
    assert live.health("s", 4.5) is Health.DEAD
    live.sent("s", 5.0)
    live.answered("s", 5.1, incarnation=2)  # restarted: a dead target comes back on any answer
    assert live.health("s", 5.1) is Health.UP

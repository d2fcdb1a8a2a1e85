"""Cases the CacheManager state machine (test_stateful.py) found, replayed step by step.

Each runs the machine's own rules in the order hypothesis shrank them to, checking the machine's
invariants (content, events, stats, room) after every step, so a regression fails the same way
whatever hypothesis draws on a given run."""

from __future__ import annotations

from typing import Any

from test_stateful import CacheMachine

from raykv.core.keys import ReuseScope


def _scope(lora: int | None = None, salt: int | None = None) -> ReuseScope:
    return ReuseScope(lora_id=lora, salt=salt, model=None)


def test_room_for_a_request_when_the_tier_below_has_one_slot() -> None:
    """A case the state machine found: the host tier's coldest page is a droppable block and the
    disk tier has one free slot, every other disk page held by a suspended request. Demoting that
    block took the last disk slot and left a suspended request's private page nowhere to go, so
    an extend that room could be made for raised OutOfPagesError. The store now plans again with
    drops first when its first plan falls short."""
    state = CacheMachine()
    state.setup(host=11, disk=10, util=1.0, host2=3, disk2=None)
    steps: list[tuple[str, dict[str, Any]]] = [
        ("twin", dict(priority=0, scope=_scope(), tokens=())),
        ("clear_reusable", dict(which=0)),
        ("twin", dict(priority=0, scope=_scope(), tokens=())),
        ("twin", dict(priority=0, scope=_scope(salt=1), tokens=(30, 31, 32, 33, 34, 35, 36, 37, 0))),
        ("close_all", {}),
        ("twin", dict(priority=0, scope=_scope(), tokens=(0, 0, 0, 0, 0))),
        (
            "turn",
            dict(
                end="suspend",
                priority=0,
                request_id=None,
                scope=_scope(),
                tokens=(30, 31, 32, 33, 34, 35, 36, 37, 0, 0, 0, 0, 0),
            ),
        ),
        (
            "create",
            dict(
                priority=0,
                request_id=None,
                scope=_scope(salt=1),
                tokens=(30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40),
            ),
        ),
        (
            "turn",
            dict(
                end="suspend",
                priority=60,
                request_id=None,
                scope=_scope(lora=7),
                tokens=(1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0),
            ),
        ),
        ("cool", dict(scope=_scope(), tokens=(), which=False)),
        ("twin", dict(priority=0, scope=_scope(), tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0))),
        ("turn", dict(end="close", priority=0, request_id=None, scope=_scope(), tokens=(0, 0, 0, 0))),
        (
            "twin",
            dict(
                priority=0, scope=_scope(salt=1), tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0)
            ),
        ),
    ]
    try:
        state.consistent()
        for name, kwargs in steps:
            getattr(state, name)(**kwargs)
            state.consistent()
    finally:
        state.teardown()

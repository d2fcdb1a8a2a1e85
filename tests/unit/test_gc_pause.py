"""raykv.core.gc_pause: the collector paused over a section, and its due young passes run only where
the section says it would wait; pipelined imports use both (no collection amid their inserts)."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator

import pytest
from import_support import chain, toks
from test_import_pipelined import Copier, starts

from raykv import TransferError
from raykv.core.gc_pause import collect_if_due, paused
from raykv.core.pipelined_import import import_pipelined


@pytest.fixture
def collections() -> Iterator[list[tuple[int, bool]]]:
    """(generation, whether it ran inside collect_if_due) of every collection meanwhile, with a
    low gen-0 threshold so that collections come due often; the collector restored after."""
    seen: list[tuple[int, bool]] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            frame, inside = sys._getframe(1), False
            while frame is not None and not inside:
                inside = frame.f_code is collect_if_due.__code__
                frame = frame.f_back
            seen.append((info["generation"], inside))

    before, was_enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    gc.set_threshold(50, *before[1:])
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*before)
        if not was_enabled:
            gc.disable()


def test_paused_restores_the_collector_after_nesting_threads_and_errors() -> None:
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer section is still in progress
        inside = threading.Event()
        leave = threading.Event()

        def other() -> None:
            with paused():
                inside.set()
                leave.wait(5)

        thread = threading.Thread(target=other)
        thread.start()
        inside.wait(5)
    assert not gc.isenabled()  # the other thread's section goes on
    leave.set()
    thread.join(5)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()  # the program's own choice is kept
    try:
        with paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collect_if_due_runs_only_a_due_pass_of_a_paused_section(collections) -> None:
    junk = [[] for _ in range(200)]  # past the threshold of 50
    collect_if_due()  # not in a section: nothing
    assert collections == [] or all(not inside for _, inside in collections)
    collections.clear()
    with paused():
        junk += [[] for _ in range(200)]
        assert gc.get_count()[0] > 50
        collect_if_due()
        assert [inside for _, inside in collections] == [True]
        assert gc.get_count()[0] < 50
        collect_if_due()  # nothing due now
        assert len(collections) == 1
        junk += [[] for _ in range(30)]
        # Other threads' allocations and frees move the count too: leave 20 either way.
        count = gc.get_count()[0]
        collect_if_due()  # about 30 of 50: not due yet
        collect_if_due(headroom=max(0, 50 - count - 20))  # due 20 allocations later at most
        assert len(collections) == 1
        collect_if_due(headroom=50 - count + 20)  # due within the headroom: run it now
        assert len(collections) == 2 and gc.get_count()[0] < 30
    gc.disable()
    try:
        with paused():
            junk += [[] for _ in range(200)]
            collect_if_due()  # the program paused the collector: not ours to run
        assert len(collections) == 2
    finally:
        gc.enable()
    del junk


@pytest.mark.parametrize("fail_at", [None, 2])
def test_imports_collect_only_before_confirms(make_manager, oracle, run_request, collections, fail_at):
    """With collections due every 50 allocations, an import of 40 blocks in chunks of 4 sees them
    only where it would wait for a copy (collect_if_due before each confirm but the last, whose
    copy is short), never amid its inserts nor after the last confirm; the collector runs again
    after (also when a confirm raised), and every block is right."""
    src, dst = make_manager(64), make_manager(64)
    records, data, _ = chain(src, run_request, toks(3, 160))
    enabled: list[bool] = []
    confirms: list[int] = []  # how many collections had run at each confirm

    def during(k: int) -> None:
        enabled.append(gc.isenabled())
        confirms.append(len(collections))

    cp = Copier(dst, data, fail_at, during=during)
    collections.clear()
    done = import_pipelined(dst, records, starts(len(records), 4), cp.write, cp.confirm, 50)
    seen = list(collections)
    dst.check_invariants()
    assert enabled and not any(enabled) and gc.isenabled()
    assert seen and all(inside for _, inside in seen)
    if fail_at is None:  # none before the last confirm (after the one before it) or after it
        assert confirms[-1] == confirms[-2] == len(seen)
    assert done.settled == (len(records) if fail_at is None else 4 * fail_at)
    assert isinstance(done.stopped, TransferError) == (fail_at is not None)
    assert oracle.verify_manager(dst) == done.settled

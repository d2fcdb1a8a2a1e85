"""Pausing Python's cyclic garbage collector over short allocation-heavy critical sections.

A pull's import builds a few hundred pages and blocks (and their lists and tuples) in a couple of
milliseconds while a copy runs. Those allocations trigger the collector's young-generation passes
in the middle of it (about a fifth of the import's Python time), and
now and then a full pass (milliseconds). :func:`paused` holds collection off for the section, and
:func:`collect_if_due` runs the young pass that has come due at a moment the section would wait
anyway (a copy still running), so it neither interrupts the work nor lands right after it.
Nothing is freed later than otherwise except garbage in reference cycles, which always waits for
a collection anyway.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # sections in progress, over all threads
_resume = False  # whether the collector was enabled when the first of them began


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the collector for the ``with`` block and enable it again once the last block in
    progress (any thread, nested or not) has ended, unless it was disabled before the first began.
    Leaves the collector as it found it also when the block raises."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


def collect_if_due(headroom: int = 0) -> None:
    """Inside :func:`paused` (with the collector paused by it, not by the program): run the
    collection the collector would have run by now, or within the next ``headroom`` allocations,
    if any: generation 1 when its count is past its threshold too, else generation 0 (a full
    collection is left to the collector itself). Call it where the section would otherwise wait
    (e.g. before waiting for a copy); a ``headroom`` keeps the pass from coming due at the end."""
    if not (_depth and _resume):
        return
    threshold, count = gc.get_threshold(), gc.get_count()
    if threshold[0] > 0 and count[0] > threshold[0] - headroom:
        gc.collect(1 if count[1] >= threshold[1] else 0)

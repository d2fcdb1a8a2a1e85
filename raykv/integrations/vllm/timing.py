"""The connector's timing totals: what an engine's finished requests pulled and prefilled, and how
long that took, handed to the paired CacheWorker for the engine's Serve replica and its routers.

:class:`TimingTotals` adds up, per finished request, its pull (``pulled_tokens`` in ``fetch_us``)
and its prefill (``prefilled_tokens`` in ``prefill_us``) and hands the totals to ``send`` at most
every :data:`TIMING_EVERY_S` seconds; what is due meanwhile goes from a timer thread (an idle
engine plans no more steps). No Ray here: ``send`` is the deployment link's ``report_timing``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping

TIMING_EVERY_S = 0.5  # at most this often the timing totals go to the paired worker


class TimingTotals:
    """``totals``: ``[pulled tokens, pull us, prefilled tokens, prefill us]`` of the finished
    requests, added up since the engine started. ``send`` (None: the totals are only kept) gets a
    copy of them. Thread-safe: the timer thread reads the totals."""

    def __init__(self, send: Callable[[list[int]], None] | None) -> None:
        self.totals = [0, 0, 0, 0]
        self._send = send
        self._sent_at = -math.inf  # when the totals last went out
        self._due = False  # totals changed since
        self._timer: threading.Timer | None = None  # reports what is due once allowed
        self._lock = threading.Lock()

    def add(self, result: Mapping[str, int]) -> None:
        """Add a finished request's pull and prefill (each only when both of its figures are
        positive); then send the totals if they are due."""
        pulled, pull_us = result.get("pulled_tokens", 0), result.get("fetch_us", 0)
        prefilled, prefill_us = result.get("prefilled_tokens", 0), result.get("prefill_us", 0)
        with self._lock:
            if pulled > 0 and pull_us > 0:
                self.totals[0] += pulled
                self.totals[1] += pull_us
                self._due = True
            if prefilled > 0 and prefill_us > 0:
                self.totals[2] += prefilled
                self.totals[3] += prefill_us
                self._due = True
        self.report()

    def report(self) -> None:
        """Send the totals when they changed, now, or, when they went out less than
        :data:`TIMING_EVERY_S` ago, once that much time has passed (from a timer thread)."""
        with self._lock:
            if self._send is None or not self._due:
                return
            wait = self._sent_at + TIMING_EVERY_S - time.monotonic()
            if wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._fired)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._sent_at, self._due = time.monotonic(), False
            totals = list(self.totals)
        self._send(totals)

    def _fired(self) -> None:
        with self._lock:
            self._timer = None
        self.report()

    def close(self) -> None:
        """Send what is due now (no waiting) and stop the timer."""
        with self._lock:
            timer, self._timer = self._timer, None
            self._sent_at = -math.inf
        if timer is not None:
            timer.cancel()
        self.report()

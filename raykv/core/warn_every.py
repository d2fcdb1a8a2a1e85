"""Rate-limited warnings for failures that can repeat on every call."""

from __future__ import annotations

import math
import time


class WarnEvery:
    """At most one warning per ``seconds``: ask :meth:`due` before logging one. Not
    thread-safe; callers that warn from several threads hold their own lock."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = -math.inf  # when the last warning went out (time.monotonic)

    def due(self) -> bool:
        """Whether to warn now (and if so, the next one waits ``seconds``)."""
        now = time.monotonic()
        if now - self.at < self.seconds:
            return False
        self.at = now
        return True

"""Which engines a CacheWorker serves, and when it may take an engine's page layout.

A deployment started without a layout (``raykv.start()`` without ``config``, ``raykv up`` without
``[layout]``) lets each worker take the layout of the engines paired with it
(:meth:`actors.cache.worker.CacheWorker.bind_engine`): the first engine's layout, and any engine's once
no other engine is bound. A worker of a deployment started with a layout keeps it. A mismatch
otherwise is one short ConfigError that names the differing fields and the fix.
"""

from __future__ import annotations

import threading
from typing import Any

from raykv.core.config import KVLayout, layout_difference
from raykv.core.errors import ConfigError

MAX_MESSAGE = 300


class EngineBindings:
    """The engines bound to one worker ({engine: (model, fingerprint hex)}) and whether it takes
    their layouts. Thread-safe."""

    def __init__(self, engine_layouts: bool) -> None:
        self.engine_layouts = bool(engine_layouts)
        self._engines: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def needs_relayout(self, engine: str, layout: KVLayout, current: KVLayout, model: str) -> bool:
        """Whether binding ``engine`` (pages ``layout``, running ``model``) means laying the worker
        out anew: False when ``layout`` is ``current``; True when the worker takes its engines'
        layouts and no other engine is bound. ConfigError (under 300 characters) otherwise."""
        if not isinstance(engine, str) or not engine:
            raise ConfigError("engine", f"must be a non-empty str, got {engine!r}")
        if not isinstance(layout, KVLayout):
            raise ConfigError("layout", f"must be a KVLayout, got {type(layout).__name__}")
        if layout == current:
            return False
        with self._lock:
            others = sorted({m for e, (m, _) in self._engines.items() if e != engine})
        if self.engine_layouts and not others:
            return True
        diff = layout_difference(current, layout)
        if others and self.engine_layouts:
            fix = f"pair {model} with another worker (pool=...); this one serves {', '.join(others)}"
        else:
            fix = "start the deployment without a layout, or with the engine's"
        message = f"{model}'s pages differ from the worker's ({diff}): {fix}"
        if len(message) > MAX_MESSAGE - 20:
            message = message[: MAX_MESSAGE - 23] + "..."
        raise ConfigError("layout", message)

    def claim(self, engine: str, model: str) -> bool:
        """Bind ``engine`` (no fingerprint yet) unless the worker takes its engines' layouts and an
        engine of another model is bound; whether it did (a worker of a fixed layout serves every
        engine that fits it). The check and the claim are one step, so concurrent replicas of two models do
        not both take a free worker."""
        with self._lock:
            others = (m for e, (m, _) in self._engines.items() if e != engine)
            if self.engine_layouts and any(m != model for m in others):
                return False
            self._engines[engine] = (str(model), "")
            return True

    def bind(self, engine: str, model: str, fingerprint: str) -> None:
        with self._lock:
            self._engines[engine] = (str(model), str(fingerprint))

    def unbind(self, engine: str) -> None:
        with self._lock:
            self._engines.pop(engine, None)

    def state(self) -> dict[str, Any]:
        """``engine_layouts`` and a copy of ``engines`` ({engine: (model, fingerprint hex)})."""
        with self._lock:
            return {"engine_layouts": self.engine_layouts, "engines": dict(self._engines)}

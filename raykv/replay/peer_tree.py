"""Where the ``ray_prefix`` router and the routing benchmark get Ray Serve LLM's PrefixTree.

raykv never imports ray, so the tree comes from a factory that the Ray layer registers
(``actors/replay/ray_tree.py`` does so when imported; the CLI, the replay backends and the tests import
it). Measuring the peer's real code is the point, so there is no stand-in implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raykv.core.errors import StateError

_factory: Callable[[], Any] | None = None


def set_prefix_tree_factory(factory: Callable[[], Any]) -> None:
    """Register the callable that builds a fresh PrefixTree (called by the Ray layer)."""
    global _factory
    _factory = factory


def new_prefix_tree() -> Any:
    """A fresh PrefixTree. Raises StateError when no factory is registered."""
    if _factory is None:
        raise StateError(
            "the ray_prefix router needs Ray's PrefixTree: import actors.replay.ray_tree first "
            "(raykv itself never imports ray)"
        )
    return _factory()

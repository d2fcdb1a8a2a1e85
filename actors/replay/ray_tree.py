"""Registers Ray Serve LLM's real PrefixTree as the factory raykv's replay and benchmarks use.

Importing this module is enough (it registers itself); ``raykv.replay.peer_tree`` explains why.
"""

from __future__ import annotations

import warnings
from typing import Any

from raykv.replay.peer_tree import set_prefix_tree_factory


def ray_prefix_tree() -> Any:
    """A fresh ``PrefixTree`` from ray.llm (its imports emit pydantic deprecation warnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    return PrefixTree()


set_prefix_tree_factory(ray_prefix_tree)

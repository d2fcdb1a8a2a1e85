"""Which ``raykv bench`` suites can run on this machine, and what was skipped and why.

Importing this module never imports ray (nor vllm, nor torch): ``raykv bench`` must run every suite
that does not need Ray on a machine without it. The Ray-needing parts of the default run are
registered here only after their import succeeded:

- ``routing``: the whole suite (its baseline is Ray Serve LLM's PrefixTree, from ``ray.llm``);
- ``index through Ray``: the through-Ray rows :mod:`actors.bench.index` adds to the ``index`` suite;
- ``transfer vs Ray object store``: the row :mod:`actors.cache.transfer` adds to the ``transfer`` suite;
- ``gpu`` (not a Ray part): skipped from the default run when there is no CUDA device.

The suites that run only when named (``soak``, ``vllm``, ``scheduler``, ``serve``) need Ray and/or
vLLM throughout: :func:`named_only_missing` says what is missing before the CLI imports them.

A requirement is met when ``importlib.import_module`` succeeds; an ImportError (a missing package
or a broken install) makes it a skip whose reason carries the error message. Any other exception
propagates: it is a bug, not a missing dependency.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PREFIX_TREE_MODULE = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree"

NAMED_ONLY: dict[str, tuple[str, ...]] = {
    "soak": ("ray",),
    "vllm": ("vllm", "ray"),
    "scheduler": ("vllm", "ray"),
    "serve": ("vllm", "ray.serve.llm"),
}
"""Suite run only when named -> the modules it needs, checked in order."""


@dataclass(frozen=True)
class Skip:
    """One suite, or one part of a suite, that this run leaves out, and why."""

    what: str
    reason: str

    def line(self) -> str:
        """``skipped: <what> (<reason>)``, the line the CLI prints."""
        return f"skipped: {self.what} ({self.reason})"


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_suites` registered and left out.

    ``skipped``: one entry per suite or part left out, in a fixed order. ``excluded``: the names of
    the suites left out entirely (the CLI passes them to ``run_all_benchmarks``).
    """

    skipped: tuple[Skip, ...]
    excluded: frozenset[str]


ImportCheck = Callable[[str], "str | None"]
"""Module name -> None when it imports, else the ImportError's message."""


def import_error(module: str) -> str | None:
    """None when ``module`` imports, else the ImportError's message (warnings raised by the
    import, e.g. pydantic deprecations inside ray.llm, are silenced)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except ImportError as exc:
        return str(exc) or type(exc).__name__
    return None


def _register_routing() -> None:
    import actors.replay.ray_tree  # noqa: F401 - registers Ray's PrefixTree, the routing baseline


def _register_index() -> None:
    from actors.bench.index import register

    register()


def _register_transfer() -> None:
    from actors.cache.transfer import register_bench

    register_bench()


@dataclass(frozen=True)
class _RayPart:
    suite: str
    what: str
    label: str
    module: str
    whole_suite: bool
    register: Callable[[], None]


_RAY_PARTS = (
    _RayPart("index", "index through Ray", "ray", "ray", False, _register_index),
    _RayPart("routing", "routing", "ray.llm", PREFIX_TREE_MODULE, True, _register_routing),
    _RayPart("transfer", "transfer vs Ray object store", "ray", "ray", False, _register_transfer),
)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def plan_suites(
    suite: str | None,
    check: ImportCheck = import_error,
    cuda: Callable[[], bool] = _cuda_available,
) -> Plan:
    """Register the Ray-needing parts of ``suite`` (None: the default run of every suite) whose
    requirement imports, and return what was left out.

    ``check`` and ``cuda`` are injectable for tests. A part whose requirement fails is not
    registered (its module is never imported); the suite's other rows still run. ``gpu`` is left
    out of the default run only (a named ``gpu`` suite reports its own error row without CUDA).
    """
    skipped: list[Skip] = []
    excluded: set[str] = set()
    for part in _RAY_PARTS:
        if suite not in (None, part.suite):
            continue
        error = check(part.module)
        if error is None:
            part.register()
            continue
        logger.info("raykv bench: %s needs %s: %s", part.what, part.label, error)
        skipped.append(Skip(part.what, f"needs {part.label}: {error}"))
        if part.whole_suite:
            excluded.add(part.suite)
    if suite is None and not cuda():
        skipped.append(Skip("gpu", "no CUDA device"))
        excluded.add("gpu")
    return Plan(tuple(skipped), frozenset(excluded))


def named_only_missing(suite: str, check: ImportCheck = import_error) -> Skip | None:
    """For a suite that runs only when named: None when its requirements import, else a Skip
    naming the first requirement that does not. Raises KeyError for any other suite name."""
    for module in NAMED_ONLY[suite]:
        error = check(module)
        if error is not None:
            return Skip(suite, f"needs {module}: {error}")
    return None

"""Importing the test suite's dependencies: skip where they are missing, fail under RAYKV_REQUIRE_DEPS.

The README's install provides torch, ray (with Serve and Serve LLM), ucxx, transformers and vllm.
A test that needs one of them imports it with :func:`require` (at module level or inside the test)
instead of ``pytest.importorskip``:

- by default, ``require(name)`` acts as ``pytest.importorskip(name)``: a missing module (a
  ModuleNotFoundError, also one raised for a dependency of ``name``) skips the test or module,
  any other ImportError propagates (pytest's own rule);
- with ``RAYKV_REQUIRE_DEPS=1`` (set by ``.ci/run``), a module that cannot be imported, for any
  ImportError, fails the test (or the module's collection) with a message naming the module and
  the error: a broken install must not turn CI green by skipping every engine test.

:func:`require_cuda` is the GPU tests' module-level guard: torch is required as above; the only
skip is the hardware's (``no CUDA device``, or too few devices). Optional packages that the README
does not install (cupy, a newer CUDA driver's entry points) keep skipping with
``pytest.importorskip`` or ``pytest.skip``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_ENV = "RAYKV_REQUIRE_DEPS"


def deps_required() -> bool:
    """True when ``RAYKV_REQUIRE_DEPS`` is set to anything but empty or ``0``."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def require(name: str, reason: str | None = None) -> ModuleType:
    """Import and return module ``name`` (dotted names allowed).

    Without ``RAYKV_REQUIRE_DEPS``: like ``pytest.importorskip(name)``, a ModuleNotFoundError
    skips (the caller, or its whole module at module level) with ``<reason> (could not import
    '<name>': <error>)``, any other ImportError propagates. With it: any ImportError fails the
    caller (``pytest.fail``, no traceback) with ``RAYKV_REQUIRE_DEPS=1: cannot import '<name>':
    <ErrorType>: <message>``; at module level that is a collection error, so pytest exits
    non-zero. ``reason`` is used only for the skip.
    """
    __tracebackhide__ = True
    if not deps_required():
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            why = f"could not import {name!r}: {exc}"
            pytest.skip(f"{reason} ({why})" if reason else why, allow_module_level=True)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(
            f"{REQUIRE_ENV}=1: cannot import {name!r}: {type(exc).__name__}: {exc} "
            "(the README's install provides it; fix the install instead of skipping)",
            pytrace=False,
        )


def require_cuda(devices: int = 1) -> ModuleType:
    """Module-level guard of the GPU tests: returns torch (imported with :func:`require`), or
    skips the module with ``no CUDA device`` (none visible) or ``needs N CUDA devices, found K``."""
    __tracebackhide__ = True
    torch = require("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    found = int(torch.cuda.device_count())
    if found < devices:
        pytest.skip(f"needs {devices} CUDA devices, found {found}", allow_module_level=True)
    return torch

"""The optional compiled pieces of raykv and the one place that loads them.

``pip install`` builds six C extensions through ``setup.py`` when a C compiler and the Python
headers are present. They are optional: without them the install goes on and Python does the same
work, slower. Each can also be switched off at run time with an environment variable:

=============  ==================================================================  =========================
extension      speeds up                                                           switched off by
=============  ==================================================================  =========================
``_holders``   the prefix index's table (:mod:`raykv.index.holders`)               ``RAYKV_PURE_INDEX=1``
``_shmread``   one-sided reads (:mod:`raykv.transfer.paths.shm_read`)               ``RAYKV_PURE_SHM_READ=1``
``_chain``     building imported pages and chains of blocks (:mod:`raykv.core`)    ``RAYKV_PURE_CHAIN=1``
               and keying prompts (:mod:`raykv.routing.session_keys`)
``_cost``      the routing decision's cost loop (:mod:`raykv.routing.policy`)      ``RAYKV_PURE_COST=1``
``_slots``     planning GPU page copy batches (:mod:`raykv.core.tiers.copy_plan`)  ``RAYKV_PURE_SLOTS=1``
``_gather``    an owner's copy of engine blocks (:mod:`raykv.transfer.kv_share`)    ``RAYKV_PURE_GATHER=1``
=============  ==================================================================  =========================

:func:`load` is what the modules above call; :func:`status` is what ``raykv info`` and CI print.
This module imports nothing of raykv's (layer 0).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

SWITCHES: dict[str, str] = {
    "_holders": "RAYKV_PURE_INDEX",
    "_shmread": "RAYKV_PURE_SHM_READ",
    "_chain": "RAYKV_PURE_CHAIN",
    "_cost": "RAYKV_PURE_COST",
    "_slots": "RAYKV_PURE_SLOTS",
    "_gather": "RAYKV_PURE_GATHER",
}

_built: dict[str, ModuleType | None] = {}


def built(name: str) -> ModuleType | None:
    """The compiled module ``raykv.native.<name>``, or None when it was not built.

    Raises KeyError for a name that is not one of :data:`SWITCHES`. The import is attempted once.
    """
    if name not in SWITCHES:
        raise KeyError(f"no compiled extension named {name!r}; known: {sorted(SWITCHES)}")
    if name not in _built:
        try:
            _built[name] = importlib.import_module(f"raykv.native.{name}")
        except ImportError:
            _built[name] = None
    return _built[name]


def switched_off(name: str) -> bool:
    """Whether the extension's environment switch (``RAYKV_PURE_*=1``) is set now."""
    return os.environ.get(SWITCHES[name], "") == "1"


def load(name: str) -> ModuleType | None:
    """The compiled module when it was built and is not switched off now, else None.

    The switch is read at every call, so a caller that loads once (at import) fixes its choice
    then, and one that loads per use follows the environment.
    """
    module = built(name)
    return None if module is None or switched_off(name) else module


def status() -> dict[str, str]:
    """Each extension's state in words: ``compiled``, ``python (not built)`` or ``python (VAR=1)``."""
    out = {}
    for name, var in SWITCHES.items():
        if built(name) is None:
            out[name] = "python (not built)"
        else:
            out[name] = f"python ({var}=1)" if switched_off(name) else "compiled"
    return out

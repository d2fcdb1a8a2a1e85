"""Page transfers between CacheManagers: a page server and a client (UCX via ucxx; no ray here).

A :class:`PageServer` serves one manager's *committed* pages to peers that hold the deployment's
shared token; a :class:`PageClient` pulls a list of blocks by key from one or several servers and
returns them intact (:class:`PulledPages`), ready for ``CacheManager.import_pages``.
:func:`pull_into` does both steps, landing the pages in the manager's top tier with one copy, and
imports only a complete, intact, parent-consistent prefix.
Integrity: over UCX every page is checked against the sender's CRC-32; over same-node shared
memory (and GPU peer copies) the pages are copied straight out of the owner's memory under its
lease (no checksums unless asked; the owner confirms the lease instead), see
:mod:`raykv.transfer.net.wire`.

Paths: each way pages move is a :class:`raykv.transfer.paths.base.TransferPath` (``shm_read``,
``gpu_read``, ``shm``, ``ucx``, ``direct``, ``gpu_peer``; :mod:`raykv.transfer.paths.registry`
lists them); the server and the client dispatch to them by name. Which paths a move takes, in
what order, is decided in one place: :func:`raykv.transfer.planner.plan_paths`, and
:func:`pull_pages` pulls into a CacheManager along that plan.

Sub-packages, bottom to top (a layer imports only lower ones; import-linter checks it):
``net`` (settings, auth, control messages and their limits, the loop thread that owns UCX, a
client's connection, the page server's guards); ``pages`` (same-node mappings, the sender's
chunks, the receiving side, pull results, landing); ``paths`` (the base class, what a path uses of
a client and of a server connection, the path modules, their registry, the import of pulled
pages); ``server``, ``client``, ``planner`` and ``inbox`` on top. Every failure is a
:class:`raykv.core.errors.TransferError` whose ``reason`` is a
:class:`raykv.core.errors.TransferFailure`. ucxx is imported lazily, the first time a server or
client starts.
"""

from __future__ import annotations

from raykv.core.errors import TransferFailure
from raykv.transfer.client import ClientStats, PageClient, PulledPages
from raykv.transfer.net.auth import AuthToken
from raykv.transfer.net.config import PeerAddress, TransferConfig, default_node_id
from raykv.transfer.net.runtime import TransferRuntime, get_runtime
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.gpu_peer import pull_gpu_peer_into
from raykv.transfer.paths.gpu_read import pull_gpu_local
from raykv.transfer.paths.importer import (
    PullOutcome,
    import_pulled,
    merge_outcomes,
    pull_into,
    pull_into_local,
)
from raykv.transfer.paths.registry import PATH_CLASSES
from raykv.transfer.paths.serving import ServerConn, ServerFaults
from raykv.transfer.planner import plan_paths, pull_pages
from raykv.transfer.server import PageServer, ServerStats

__all__ = [
    "AuthToken",
    "ClientStats",
    "PageClient",
    "PATH_CLASSES",
    "PageServer",
    "PeerAddress",
    "PullOutcome",
    "PulledPages",
    "ServerConn",
    "ServerFaults",
    "ServerStats",
    "TransferConfig",
    "TransferFailure",
    "TransferPath",
    "TransferRuntime",
    "default_node_id",
    "get_runtime",
    "import_pulled",
    "merge_outcomes",
    "pull_gpu_local",
    "plan_paths",
    "pull_gpu_peer_into",
    "pull_pages",
    "pull_into",
    "pull_into_local",
]

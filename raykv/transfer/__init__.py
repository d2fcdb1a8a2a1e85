"""Page transfers between CacheManagers: a page server and a client (UCX via ucxx; no ray here).

A :class:`PageServer` serves one manager's *committed* pages to peers that hold the deployment's
shared token; a :class:`PageClient` pulls a list of blocks by key from one or several servers and
returns them verified (:class:`PulledPages`), ready for ``CacheManager.import_blocks``.
:func:`pull_into` does both steps and imports only a complete, verified, parent-consistent prefix.

Layers: ``config`` (settings, addresses) and ``auth`` (token, challenge-response) and ``wire``
(control messages and their limits) at the bottom; ``runtime`` (the loop thread that owns UCX,
transport checks, byte budgets) and ``shm`` (same-node mappings) and ``payload`` (the sender's
chunks) above; ``server`` and ``client`` on top. Every failure is a
:class:`raykv.errors.TransferError` with a ``reason`` ("auth", "protocol", "limit", "integrity",
"timeout", "closed", "ucx", "connect", "unavailable", "state", "fault"). ucxx is imported lazily,
the first time a server or client starts.
"""

from __future__ import annotations

from raykv.transfer.auth import AuthToken
from raykv.transfer.client import ClientStats, PageClient, PulledPages
from raykv.transfer.config import PeerAddress, TransferConfig, default_node_id
from raykv.transfer.importer import PullOutcome, import_pulled, pull_into
from raykv.transfer.runtime import TransferRuntime, get_runtime
from raykv.transfer.server import PageServer, ServerFaults, ServerStats

__all__ = [
    "AuthToken",
    "ClientStats",
    "PageClient",
    "PageServer",
    "PeerAddress",
    "PullOutcome",
    "PulledPages",
    "ServerFaults",
    "ServerStats",
    "TransferConfig",
    "TransferRuntime",
    "default_node_id",
    "get_runtime",
    "import_pulled",
    "pull_into",
]

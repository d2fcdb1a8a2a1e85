"""Page transfers between CacheManagers: a page server and a client (UCX via ucxx; no ray here).

A :class:`PageServer` serves one manager's *committed* pages to peers that hold the deployment's
shared token; a :class:`PageClient` pulls a list of blocks by key from one or several servers and
returns them intact (:class:`PulledPages`), ready for ``CacheManager.import_pages``.
:func:`pull_into` does both steps, landing the pages in the manager's top tier with one copy, and
imports only a complete, intact, parent-consistent prefix; :func:`pull_best` first tries the
same-node GPU-to-GPU path (:mod:`raykv.transfer.gpu_peer`) when the manager's top tier is a GPU.
Integrity: over UCX every page is checked against the sender's CRC-32; over same-node shared
memory (and GPU peer copies) the pages are copied straight out of the owner's memory under its
lease (no checksums unless asked; the owner confirms the lease instead), see
:mod:`raykv.transfer.wire`.

Layers: ``config`` (settings, addresses) and ``auth`` (token, challenge-response) and ``wire``
(control messages and their limits) at the bottom; ``runtime`` (the loop thread that owns UCX,
transport checks, byte budgets) and ``shm`` (same-node mappings) and ``payload`` (the sender's
chunks) above; ``server`` and ``client`` (with ``receive`` and ``landing``) on top, ``importer``
last. Every failure is a :class:`raykv.core.errors.TransferError` with a ``reason`` ("auth",
"protocol", "limit", "integrity", "timeout", "closed", "ucx", "connect", "unavailable", "state",
"fault", "rejected", "cancelled"). ucxx is imported lazily, the first time a server or client
starts.
"""

from __future__ import annotations

from raykv.transfer.auth import AuthToken
from raykv.transfer.client import ClientStats, PageClient, PulledPages
from raykv.transfer.config import PeerAddress, TransferConfig, default_node_id
from raykv.transfer.gpu_peer import merge_outcomes, pull_best, pull_gpu_local, pull_gpu_peer_into
from raykv.transfer.importer import PullOutcome, import_pulled, pull_into, pull_into_local
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
    "pull_best",
    "merge_outcomes",
    "pull_gpu_local",
    "pull_gpu_peer_into",
    "pull_into",
    "pull_into_local",
]

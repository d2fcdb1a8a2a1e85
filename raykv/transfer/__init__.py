"""Page transfers between CacheManagers: a page server and a client (UCX via ucxx; no ray here).

A :class:`PageServer` serves one manager's *committed* pages to peers that hold the deployment's
shared token; a :class:`PageClient` pulls a list of blocks by key from one or several servers and
returns them intact (:class:`PulledPages`), ready for ``CacheManager.import_pages``.
:func:`pull_into` does both steps, landing the pages in the manager's top tier with one copy, and
imports only a complete, intact, parent-consistent prefix; :func:`pull_best` first tries the
same-node GPU-to-GPU path (:mod:`raykv.transfer.paths.gpu_peer`) when the manager's top tier is a GPU.
Integrity: over UCX every page is checked against the sender's CRC-32; over same-node shared
memory (and GPU peer copies) the pages are copied straight out of the owner's memory under its
lease (no checksums unless asked; the owner confirms the lease instead), see
:mod:`raykv.transfer.net.wire`.

Paths: each way pages move is a :class:`raykv.transfer.paths.base.TransferPath` (``shm_read``,
``gpu_read``, ``shm``, ``ucx``, ``direct``, ``gpu_peer``; :mod:`raykv.transfer.paths.registry` lists them);
the server and the client dispatch to them by name.

Layers, bottom to top (a module imports only lower ones; none imports this package): ``config``,
``auth``, ``wire`` (control messages and their limits), ``guard`` (the page server's connection
caps, idle waits, paced logs and closes); ``runtime`` (the loop thread that owns
UCX, transport checks, byte budgets), ``shm`` (same-node mappings), ``payload`` (the sender's
chunks), ``results``, ``landing``, ``receive``; ``serving`` and ``connection`` (the server's and
the client's side of a connection, as the paths use them), ``path`` (the base class),
``peer_pools``, ``pull_client`` (what paths use of a client), ``importer``; the path modules
``shm_read``, ``host_paths``, ``device``, ``gpu_read``, ``gpu_peer``; ``paths`` (the registry);
``server`` and ``client`` on top. Every failure is a :class:`raykv.core.errors.TransferError`
whose ``reason`` is a :class:`raykv.core.errors.TransferFailure`. ucxx is imported lazily, the
first time a server or client starts.
"""

from __future__ import annotations

from raykv.core.errors import TransferFailure
from raykv.transfer.client import ClientStats, PageClient, PulledPages
from raykv.transfer.net.auth import AuthToken
from raykv.transfer.net.config import PeerAddress, TransferConfig, default_node_id
from raykv.transfer.net.runtime import TransferRuntime, get_runtime
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.gpu_peer import pull_best, pull_gpu_peer_into
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
    "pull_best",
    "merge_outcomes",
    "pull_gpu_local",
    "pull_gpu_peer_into",
    "pull_into",
    "pull_into_local",
]

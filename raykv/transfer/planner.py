"""The one path planner: which transfer paths move a set of pages to a receiver, in what order.

Every caller that moves committed pages from an owner (a CacheWorker's page server) asks
:func:`plan_paths`: a CacheWorker's pulls (peer fetches, prefill/decode handoffs, replays, Serve
replicas' pulls; all through :func:`pull_pages`) and the vLLM connector's loads into an engine's
blocks (:class:`raykv.integrations.vllm.worker.WorkerSide`). The plan is an ordered tuple of path
names (:mod:`raykv.transfer.paths.base`); each step is handed the keys the steps before it did not
bring, so a plan degrades from the cheapest path to the one that always works:

============  ==========================================================  ===========================
step          moves                                                       planned when
============  ==========================================================  ===========================
``gpu_read``  one-sided device copy from a same-node owner's GPU tier      on GPU, one-sided allowed
``shm_read``  one-sided read of a same-node owner's shared host tier       one-sided allowed
``gpu_peer``  the owner leases, the receiver copies device to device      on GPU, ``use_gpu_peer``
``shm``       the owner leases, the receiver copies from its host tier     ``prefer_shm``, ``use_shm``
``ucx``       the owner sends the payload over UCX, CRC-32 checked         otherwise
============  ==========================================================  ===========================

The last step (``shm`` or ``ucx``) is a request a page server always answers (``ucx`` when the
receiver is on another node). One-sided steps send no request: they serve their keys only once the
client has connected to that owner and mapped its tiers (same node id, ``use_shm`` and
``use_shm_read``; ``use_gpu_peer`` too for ``gpu_read``), and only when the owner's slot directory
lists them; otherwise they are skipped at no cost. They are allowed unless ``prefer_shm=False``
or ``verify=True`` (they checksum nothing; ``verify`` checks every byte the request paths copy).
The ``direct`` path (UCX into the receiver's device, digests checked there) is not planned: it is
reached explicitly (``raykv bench gpu``), as cross-node GPU receivers are not yet measured
against ``ucx``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raykv.core.errors import TransferError, TransferFailure
from raykv.core.manager import CacheManager
from raykv.core.types import TierKind
from raykv.transfer.net.config import Peer, TransferConfig
from raykv.transfer.net.runtime import get_runtime
from raykv.transfer.paths.gpu_peer import pull_gpu_peer_into
from raykv.transfer.paths.gpu_read import pull_gpu_local
from raykv.transfer.paths.importer import PullOutcome, merge_outcomes, pull_into, pull_into_local
from raykv.transfer.paths.pull_client import PullClient

GPU_READ, SHM_READ, GPU_PEER, SHM, UCX = "gpu_read", "shm_read", "gpu_peer", "shm", "ucx"


@dataclass(frozen=True)
class Endpoints:
    """One move as the planner sees it: whether the receiver's memory is a GPU's (a CacheManager's
    GPU top tier, a CUDA engine's KV tensors) and what the caller asked for (``prefer_shm``,
    ``verify``: as in :meth:`raykv.transfer.client.PageClient.pull`)."""

    on_gpu: bool
    prefer_shm: bool = True
    verify: bool | None = None


def plan_paths(ends: Endpoints, config: TransferConfig) -> tuple[str, ...]:
    """The paths to try for ``ends``, in order (see the module docstring); never empty, its last
    step ``shm`` or ``ucx``. Pure: the same arguments always give the same plan."""
    shm = ends.prefer_shm and config.use_shm
    one_sided = shm and config.use_shm_read and ends.verify is not True
    gpu = ends.on_gpu and config.use_gpu_peer
    steps: list[str] = []
    if gpu and one_sided:
        steps.append(GPU_READ)
    if one_sided:
        steps.append(SHM_READ)
    if gpu:
        steps.append(GPU_PEER)
    steps.append(SHM if shm else UCX)
    return tuple(steps)


def manager_endpoints(
    manager: CacheManager, prefer_shm: bool = True, verify: bool | None = None
) -> Endpoints:
    """The endpoints of a pull into ``manager`` (on GPU when its top tier is)."""
    return Endpoints(manager.top_pool.kind is TierKind.GPU, prefer_shm, verify)


Step = Callable[[PullClient, Peer, CacheManager, list[bytes], Endpoints], "PullOutcome | None"]
"""The one client interface of the paths: ``step(client, peer, manager, keys, ends)`` brings what
the path can of ``keys`` into ``manager`` in the calling thread and returns its outcome (keys it
did not bring in ``missing``/``dropped``), or None, with nothing imported, when the path cannot
serve them (a one-sided path not mapped or not listing every key, ``gpu_peer`` unavailable).
TransferError for a failed request. Request steps wait for the transfer runtime's loop."""


def pull_pages(
    client: PullClient,
    peer: Peer,
    manager: CacheManager,
    keys: Sequence[bytes],
    prefer_shm: bool = True,
    verify: bool | None = None,
) -> PullOutcome:
    """Pull ``keys`` from ``peer`` into ``manager`` along :func:`plan_paths`, in the calling
    thread (request steps run on the transfer runtime's loop and are waited for).

    Each step gets the keys the steps before it left (a one-sided step that cannot serve them
    all brings none; a request step leaves those its owner did not have on that path). Returns
    one outcome for the whole plan: ``path`` names the steps that brought pages (``a+b``),
    ``missing``/``dropped`` are those of the last step taken. TransferError when a request step
    fails: the blocks earlier steps imported stay imported, the caller recomputes the rest. A
    ``gpu_peer`` step the owner cannot serve ("unavailable") is skipped.
    """
    ends = manager_endpoints(manager, prefer_shm, verify)
    outcomes: list[PullOutcome] = []
    rest = [bytes(k) for k in keys]
    for step in plan_paths(ends, client.config):
        got = _STEPS[step](client, peer, manager, rest, ends)
        if got is None:
            continue
        outcomes.append(got)
        order = {k: i for i, k in enumerate(rest)}
        rest = sorted({bytes(k) for k in (*got.missing, *got.dropped)}, key=lambda k: order.get(k, 0))
        if not rest or step in (SHM, UCX):
            break
    return _merged(outcomes)


def _merged(outcomes: list[PullOutcome]) -> PullOutcome:
    if len(outcomes) == 1:
        return outcomes[0]
    merged = merge_outcomes(outcomes, "+".join(o.path for o in outcomes))
    return dataclasses.replace(merged, missing=outcomes[-1].missing, dropped=outcomes[-1].dropped)


def _run(client: PullClient, coro: object) -> PullOutcome:
    return get_runtime().run(coro, client.config.timeout_s + 10)  # type: ignore[arg-type, no-any-return]


def _gpu_read(
    client: PullClient, peer: Peer, mgr: CacheManager, keys: list[bytes], ends: Endpoints
) -> PullOutcome | None:
    landed = pull_gpu_local(client, peer, mgr, keys)
    if landed is None:
        return None
    outcome, left = landed
    return dataclasses.replace(outcome, dropped=(*outcome.dropped, *left))


def _shm_read(
    client: PullClient, peer: Peer, mgr: CacheManager, keys: list[bytes], ends: Endpoints
) -> PullOutcome | None:
    return pull_into_local(client, peer, mgr, keys)


def _gpu_peer(
    client: PullClient, peer: Peer, mgr: CacheManager, keys: list[bytes], ends: Endpoints
) -> PullOutcome | None:
    try:
        return _run(client, pull_gpu_peer_into(client, peer, mgr, keys))
    except TransferError as exc:
        if exc.reason is not TransferFailure.UNAVAILABLE:
            raise
    return None


def _request(
    client: PullClient, peer: Peer, mgr: CacheManager, keys: list[bytes], ends: Endpoints
) -> PullOutcome | None:
    # the plan's one-sided steps came first: the request does not search the directory again
    return _run(client, pull_into(client, peer, mgr, keys, ends.prefer_shm, ends.verify, one_sided=False))


_STEPS: dict[str, Step] = {
    GPU_READ: _gpu_read,
    SHM_READ: _shm_read,
    GPU_PEER: _gpu_peer,
    SHM: _request,
    UCX: _request,
}

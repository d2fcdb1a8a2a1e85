"""Page transfers for CacheWorker actors and the Ray benchmark rows.

Imports ray lazily (like actors/cache/worker.py), so an in-process CacheWorker works without it.

:class:`WorkerTransfer` is the transfer side of one CacheWorker: a page server on its manager
(started with the deployment's token), a client, and peer resolution (a worker id becomes that
worker's page-server address through Ray; addresses are cached and re-resolved once when a
connection fails, e.g. after the peer restarted). In a Ray worker the node id is Ray's node id,
so only workers of the same Ray node use the shared-memory path. ``start()`` binds every page
server to 127.0.0.1 (UCX on ``lo``) when all Ray nodes run on one machine, else to each worker's
node IP, unless a TransferConfig says otherwise (:func:`deployment_transfer_config`).

:func:`register_bench` adds the through-Ray rows to ``raykv bench transfer``: the shared-memory
pull against Ray's object store between the same two processes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from actors.cache.ray_util import shutdown_ray
from actors.cache.settings import NODE_IP
from raykv.core.errors import TransferError, TransferFailure
from raykv.core.manager import CacheManager
from raykv.transfer import (
    AuthToken,
    PageClient,
    PageServer,
    PeerAddress,
    PullOutcome,
    TransferConfig,
)
from raykv.transfer.planner import pull_pages

log = logging.getLogger(__name__)

PeerRef = str | PeerAddress | tuple[str, int]


def actor_transfer_config(config: TransferConfig | None) -> TransferConfig:
    """``config`` with this Ray node's id (and, when ``config`` is None or its host is
    :data:`actors.cache.settings.NODE_IP`, the node's IP as host).

    Outside Ray (an in-process worker) ``config`` is used as given (default: 127.0.0.1).
    """
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency of actors/
        return config or TransferConfig()
    node = None
    host = None
    if ray.is_initialized():
        node = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
    if config is None:
        config = TransferConfig(host=host or "127.0.0.1")
    elif config.host == NODE_IP:
        config = config.replace(host=host or "127.0.0.1")
    if config.node_id is None and node is not None:
        config = config.replace(node_id=node)
    return config


def deployment_transfer_config(config: TransferConfig | None) -> TransferConfig | None:
    """The transfer settings ``start()`` gives its workers.

    An explicit ``config`` wins, except for a host of :data:`actors.cache.settings.NODE_IP` (the
    configuration file's default). When ``config`` is None or has that host and every Ray node
    runs on one machine (a local or ``cluster_utils`` cluster), page servers bind 127.0.0.1 and
    UCX stays on ``lo`` (unless ``ucx_net_devices`` is set): every peer is local. On a real
    multi-machine cluster, ``config`` as given: each worker binds its node's IP.
    """
    import ray

    if config is not None and config.host != NODE_IP:
        return config
    addresses = {n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}
    if len(addresses) > 1:
        return config  # None or NODE_IP: each worker binds its node's IP
    if config is None:
        return TransferConfig.loopback()
    return config.replace(host="127.0.0.1", ucx_net_devices=config.ucx_net_devices or "lo")


class WorkerTransfer:
    """Page server + client of one worker. Methods are thread-safe (they run on the runtime loop)."""

    def __init__(self, worker_id: str, manager: CacheManager, namespace: str | None = None) -> None:
        self.worker_id = worker_id
        self.manager = manager
        self.namespace = namespace
        self.server: PageServer | None = None
        self.client: PageClient | None = None
        self._peers: dict[str, PeerAddress] = {}

    def start(self, token: AuthToken | bytes, config: TransferConfig | None = None) -> PeerAddress:
        """Start the page server (idempotent) and the client; returns the server's address."""
        if self.server is not None and self.server.address is not None:
            return self.server.address
        cfg = actor_transfer_config(config)
        self.server = PageServer(self.manager, token, cfg)
        address = self.server.start()
        self.client = PageClient(token, cfg)
        log.info("%s: page server on %s", self.worker_id, address)
        return address

    @property
    def address(self) -> PeerAddress | None:
        return self.server.address if self.server is not None else None

    def resolve(self, peer: PeerRef, refresh: bool = False) -> PeerAddress:
        """The page-server address of a worker id (through Ray), or ``peer`` itself.

        TransferError when the worker cannot tell within ``CALL_TIMEOUT_S``: reason ``timeout``
        (no answer), ``unavailable`` (dead, unknown or unreachable, or no page server).
        """
        if isinstance(peer, PeerAddress):
            return peer
        if isinstance(peer, tuple):
            return PeerAddress(str(peer[0]), int(peer[1]))
        if refresh or peer not in self._peers:
            address = _page_server_of(peer, self.namespace)
            if address is None:
                raise TransferError(f"worker {peer} runs no page server", reason=TransferFailure.UNAVAILABLE)
            self._peers[peer] = address
        return self._peers[peer]

    def pull(
        self, peer: PeerRef, keys: Sequence[bytes], prefer_shm: bool = True, verify: bool | None = None
    ) -> PullOutcome:
        """Pull ``keys`` from ``peer`` into this worker's manager (committed, matchable blocks).

        ``verify`` as in ``PageClient.pull``. TransferError (nothing imported) when the transfer
        fails; the caller recomputes.
        """
        if self.client is None:
            raise TransferError(
                f"{self.worker_id}: page transfers not started", reason=TransferFailure.UNAVAILABLE
            )
        address = self.resolve(peer)
        try:
            return self._pull(address, keys, prefer_shm, verify)
        except TransferError as exc:
            if exc.reason is not TransferFailure.CONNECT or not isinstance(peer, str):
                raise
        return self._pull(self.resolve(peer, refresh=True), keys, prefer_shm, verify)

    def _pull(
        self, address: PeerAddress, keys: Sequence[bytes], prefer_shm: bool, verify: bool | None
    ) -> PullOutcome:
        assert self.client is not None
        return pull_pages(self.client, address, self.manager, keys, prefer_shm, verify)

    def stats(self) -> dict[str, Any]:
        """Server and client counters (per path), the leases and connections the server holds
        right now, and the shared host tier's file (None without one)."""
        out: dict[str, Any] = {"address": self.address}
        if self.server is not None:
            out["server"] = self.server.stats.as_dict()
            out["open_leases"] = self.server.open_leases
            out["open_connections"] = self.server.open_connections
            out["shm_path"] = self.server.shm_path
        if self.client is not None:
            out["client"] = self.client.stats.as_dict()
        return out

    def close(self) -> None:
        """Stop the page server (ending its leases) and drop the client's connections."""
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()


def _page_server_of(peer: str, namespace: str | None) -> PeerAddress | None:
    """Ask worker ``peer`` for its page server's address, within ``CALL_TIMEOUT_S``."""
    import ray

    from actors.cache.liveness import CALL_TIMEOUT_S

    try:
        handle = ray.get_actor(peer, namespace=namespace)
    except ValueError:
        raise TransferError(f"worker {peer} is dead or unknown", reason=TransferFailure.UNAVAILABLE) from None
    try:
        return ray.get(handle.page_server_address.remote(), timeout=CALL_TIMEOUT_S)  # type: ignore[no-any-return]
    except ray.exceptions.GetTimeoutError:
        raise TransferError(
            f"worker {peer} did not answer within {CALL_TIMEOUT_S:g}s", reason=TransferFailure.TIMEOUT
        ) from None
    except ray.exceptions.RayActorError as exc:
        raise TransferError(
            f"worker {peer} is unavailable ({type(exc).__name__})", reason=TransferFailure.UNAVAILABLE
        ) from None


# ---- benchmark rows through Ray ---------------------------------------------------------------
def _object_store_rows(quick: bool) -> list[Any]:
    """Shared-memory pull vs ``ray.get`` of the same pages returned by the same peer actor."""
    import functools
    import secrets

    import numpy as np
    import ray

    from raykv.bench.harness import Row, paired_seconds, timed
    from raykv.bench.transfer import FULL, QUICK, BenchPeer, bench_config, label

    settings = QUICK if quick else FULL
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace="raykv-bench")
    token, config = secrets.token_bytes(32), bench_config()
    peer = (
        ray.remote(BenchPeer)
        .options(num_cpus=0)
        .remote(settings.page_sizes, max(settings.counts), token, config)
    )
    client = PageClient(token, config)
    rows = []
    try:
        info = ray.get(peer.info.remote(), timeout=300)
        for page in settings.page_sizes:
            address, keys, _ = info[page]
            out = np.zeros((max(settings.counts), page), dtype=np.uint8)
            for count in settings.counts:
                pull = functools.partial(_pull_into_buffer, client, address, keys[:count], out[:count])
                fetch = functools.partial(_object_store_get, peer, page, count)
                ours, base = paired_seconds(timed(pull), timed(fetch), settings.repeats, settings.warmup)
                nbytes = count * page
                rows.append(
                    Row(
                        f"shm pull {label(count, page)} (Ray)",
                        nbytes / ours / 1e6,
                        nbytes / base / 1e6,
                        "MB/s",
                        goal=1.0,
                        info="vs ray.get from the same actor",
                    )
                )
    finally:
        client.close()
        ray.get(peer.close.remote(), timeout=60)
        ray.kill(peer)
        if started:
            shutdown_ray()
    return rows


def _pull_into_buffer(client: PageClient, address: PeerAddress, keys: list[bytes], out: Any) -> None:
    """A same-node pull as a caller makes it: one-sided once connected, else the request path."""
    pulled = client.pull_sync(address, keys, True, out=out)
    assert pulled.path in ("shm_read", "shm") and len(pulled.keys) == len(keys), pulled.path


def _object_store_get(peer: Any, page: int, count: int) -> None:
    import ray

    array = ray.get(peer.array.remote(page, count), timeout=300)
    assert array.shape == (count, page)


def register_bench() -> None:
    """Add the through-Ray object-store rows to the ``transfer`` suite (called by the CLI)."""
    from raykv.bench import SUITES
    from raykv.bench.harness import Benchmark

    base = SUITES["transfer"]

    def combined(quick: bool) -> tuple[list[Benchmark], str]:
        benches, desc = base(quick)
        ray_rows = Benchmark("pull vs Ray object store (peer actor)", lambda: _object_store_rows(quick))
        return [*benches, ray_rows], desc

    SUITES["transfer"] = combined

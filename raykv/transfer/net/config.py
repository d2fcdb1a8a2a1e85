"""Transfer settings (frozen, validated) and the peer address record.

Every limit is explicit: a control message (msgpack) larger than ``max_header_bytes``, a request
naming more than ``max_keys`` keys, or a reply payload above ``max_payload_bytes`` is refused with
a :class:`raykv.core.errors.TransferError` before any memory is allocated for it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.core.errors import ConfigError, InvalidArgumentError
from raykv.core.types import BlockKey, check_block_keys


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"must be a positive int, got {value!r}")
    return value


def _positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number of seconds, got {value!r}")
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ConfigError(name, f"must be finite and > 0, got {value!r}")
    return float(value)


def _optional_str(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(name, f"must be None or a non-empty str, got {value!r}")


def default_node_id() -> str:
    """This machine's identity: hostname plus the kernel boot id (same for every process here).

    Two processes use the shared-memory path only when their node ids are equal; Ray workers pass
    Ray's node id instead (logical nodes of one test machine then count as different nodes).
    """
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = str(os.getppid() if os.name != "posix" else os.getuid())
    return f"{socket.gethostname()}/{boot}"


UCX_PROGRESS_MODES = ("thread", "blocking")


@dataclass(frozen=True)
class TransferConfig:
    """Page-server and client settings.

    ``host``/``port``: where the page server's control listener binds (port 0: any free port).
    ``max_header_bytes``, ``max_keys``, ``max_payload_bytes``: wire limits (see module docstring).
    ``server_inflight_bytes`` / ``client_inflight_bytes``: backpressure, the most payload bytes a
    server sends (or a client receives) at once, over all peers; each is at least
    ``max_payload_bytes`` so one request always fits. ``chunk_bytes``: payload message size (the
    payload of one request goes as ``ceil(bytes / chunk_bytes)`` UCX messages, no per-page round
    trip). ``connect_timeout_s``: a client connecting plus authenticating (the server's limit is
    ``auth_timeout_s``); ``timeout_s``: one whole pull.
    ``ucx_net_devices`` / ``ucx_tls``: UCX_NET_DEVICES / UCX_TLS for this process when UCX starts
    (None: leave UCX's default or the environment). ``ucx_progress``: ucxx's progress mode for this
    process when UCX starts (UCXPY_PROGRESS_MODE; None: the environment, else ucxx's "thread"):
    "thread" (a UCX thread progresses and wakes the event loop per completion: about ten times
    slower small round trips than "blocking", docs/benchmarks.md "Transfers: ucx") or "blocking"
    (the event loop progresses UCX and polls while a request is pending: faster round trips and
    pulls, but a busy core during transfers; not tried with CUDA transports). ``node_id``: see
    :func:`default_node_id`.
    ``use_shm``: allow the same-node shared-memory path. ``verify_shm``: check every page read
    over that path against a CRC-32 computed by the owner (off by default: the client copies the
    bytes straight out of the owner's memory while the owner holds a lease on them, so nothing
    travels that a checksum could guard; the owner acknowledges instead that the lease lasted
    until the client stopped reading). The ``ucx`` path always carries checksums.
    ``use_shm_read``: read a same-node peer's tier one-sided, with no request, when its slot
    directory lists every key (:mod:`raykv.transfer.paths.shm_read` for shared host tiers, needs
    ``use_shm``; ``gpu_read`` in :mod:`raykv.transfer.paths.gpu_peer` for GPU tiers, needs
    ``use_gpu_peer``).
    ``use_gpu_peer``: allow the same-node ``gpu_peer`` path (:mod:`raykv.transfer.paths.gpu_peer`): a
    server exports its GPU tier to authenticated same-node peers, who copy leased pages device to
    device (NVLink / PCIe peer access), no checksums, the lease acknowledged as on ``shm``.
    ``post_receives``: over ``ucx``, post the receive of a pull's first chunk with the request,
    without waiting for the header; the server then sends that chunk (a payload of at most
    ``chunk_bytes`` whole) before its header, so the pages are on the wire while the header is
    built, sent and read. ``early_split_bytes``: with ``post_receives``, post two receives for a
    payload of at least this many bytes (up to ``chunk_bytes``), three quarters then a quarter,
    so the first is checksummed while the second arrives; None (default): 512 KiB on a host
    where this process may use 8 cores or more, else never; 0: never
    (:func:`raykv.transfer.pages.payload.early_split`).

    Page-server guards (:mod:`raykv.transfer.net.guard`, docs/security.md):
    ``auth_timeout_s``: a connection must finish the challenge-response within this long after it
    was accepted, else it is closed (and counted in ``preauth_rejected``). ``read_timeout_s``: once
    the first byte of a control message has arrived, the rest of it must arrive within this long.
    ``idle_timeout_s``: an authenticated connection with no pull in flight is closed after this
    long without a new request (clients learn it from ``welcome`` and retire idle connections at
    half of it, so a pull never races the close). ``max_connections_per_peer`` /
    ``max_connections``: the most connections open at once from one peer host (IP address) and in
    all; one over either cap is refused at once with reason ``busy``.
    """

    host: str = "127.0.0.1"
    port: int = 0
    max_header_bytes: int = 1 << 20
    max_keys: int = 4096
    max_payload_bytes: int = 1 << 30
    server_inflight_bytes: int = 2 << 30
    client_inflight_bytes: int = 2 << 30
    chunk_bytes: int = 8 << 20
    connect_timeout_s: float = 10.0
    timeout_s: float = 120.0
    ucx_net_devices: str | None = None
    ucx_tls: str | None = None
    ucx_progress: str | None = None
    node_id: str | None = None
    use_shm: bool = True
    verify_shm: bool = False
    use_shm_read: bool = True
    use_gpu_peer: bool = True
    post_receives: bool = True
    early_split_bytes: int | None = None
    auth_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 300.0
    max_connections_per_peer: int = 64
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("host", f"must be a non-empty str, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be an int in 0..65535, got {self.port!r}")
        _positive_int("max_header_bytes", self.max_header_bytes)
        if self.max_header_bytes < 4096:
            raise ConfigError("max_header_bytes", f"must be >= 4096, got {self.max_header_bytes}")
        for name in ("max_keys", "max_payload_bytes", "chunk_bytes"):
            _positive_int(name, getattr(self, name))
        for name in ("server_inflight_bytes", "client_inflight_bytes"):
            if _positive_int(name, getattr(self, name)) < self.max_payload_bytes:
                raise ConfigError(name, "must be >= max_payload_bytes (one request must fit)")
        # Worst case header: per key 32 + 32 (parent) bytes, a bool, an int and a checksum.
        if self.max_keys * 96 + 1024 > self.max_header_bytes:
            raise ConfigError("max_keys", f"{self.max_keys} keys cannot fit in max_header_bytes")
        object.__setattr__(
            self, "connect_timeout_s", _positive_seconds("connect_timeout_s", self.connect_timeout_s)
        )
        for name in ("timeout_s", "auth_timeout_s", "read_timeout_s", "idle_timeout_s"):
            object.__setattr__(self, name, _positive_seconds(name, getattr(self, name)))
        if _positive_int("max_connections", self.max_connections) < _positive_int(
            "max_connections_per_peer", self.max_connections_per_peer
        ):
            raise ConfigError("max_connections_per_peer", "must be <= max_connections")
        for name in ("ucx_net_devices", "ucx_tls", "node_id"):
            _optional_str(name, getattr(self, name))
        if self.ucx_progress not in (None, *UCX_PROGRESS_MODES):
            modes = ", ".join(UCX_PROGRESS_MODES)
            raise ConfigError("ucx_progress", f"must be None or one of {modes}, got {self.ucx_progress!r}")
        split = self.early_split_bytes
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 0):
            raise ConfigError("early_split_bytes", f"must be None or an int >= 0, got {split!r}")
        for name in ("use_shm", "verify_shm", "use_shm_read", "use_gpu_peer", "post_receives"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def loopback(cls, **changes: object) -> TransferConfig:
        """Bind to 127.0.0.1 and keep UCX's TCP transport on ``lo`` (tests, one machine)."""
        base = cls(host="127.0.0.1", ucx_net_devices="lo")
        return dataclasses.replace(base, **changes)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> TransferConfig:
        """``dataclasses.replace`` with validation."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def node(self) -> str:
        """The node id in effect (``node_id`` or :func:`default_node_id`)."""
        return self.node_id if self.node_id is not None else default_node_id()


@dataclass(frozen=True)
class PeerAddress:
    """Where a page server listens, and the node it runs on (for the shared-memory fast path)."""

    host: str
    port: int
    node_id: str = ""

    def __post_init__(self) -> None:
        check_peer((self.host, self.port))
        if not isinstance(self.node_id, str):
            raise InvalidArgumentError("node_id", f"must be a str, got {type(self.node_id).__name__}")

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.port

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


Peer = PeerAddress | tuple[str, int]
"""A page server's address: a PeerAddress or a (host, port) pair."""


def check_peer(peer: object) -> tuple[str, int]:
    """The (host, port) of ``peer``: a PeerAddress or a (non-empty str, int in 1..65535) pair;
    else InvalidArgumentError ``peer``."""
    if isinstance(peer, PeerAddress):
        return peer.host, peer.port
    if not isinstance(peer, (tuple, list)) or len(peer) != 2:
        raise InvalidArgumentError("peer", f"must be a PeerAddress or a (host, port) pair, got {peer!r}")
    host, port = peer
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError("peer", f"host must be a non-empty str, got {host!r}")
    try:
        port = operator.index(port) if not isinstance(port, bool) else -1
    except TypeError:
        port = -1
    if not 1 <= port <= 65535:
        raise InvalidArgumentError("peer", f"port must be an int in 1..65535, got {peer[1]!r}")
    return host, port


def check_timeout(name: str, value: object) -> float | None:
    """``value`` as seconds: None, or a finite number > 0; else InvalidArgumentError ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidArgumentError(name, f"must be None or finite seconds > 0, got {value!r}")
    return float(value)


def check_config(config: object) -> TransferConfig:
    """``config``, or the default TransferConfig for None; else InvalidArgumentError ``config``."""
    if config is None:
        return TransferConfig()
    if not isinstance(config, TransferConfig):
        raise InvalidArgumentError("config", f"must be a TransferConfig, got {type(config).__name__}")
    return config


def pull_request(peer: Peer, keys: Sequence[bytes]) -> tuple[list[BlockKey], tuple[str, int]]:
    """The checked keys of a pull and the peer's (host, port). InvalidArgumentError (a
    ValueError) ``key``/``keys`` for malformed or duplicate keys, ``peer`` for a bad address."""
    endpoint = check_peer(peer)
    checked = check_block_keys(keys)
    if len(checked) > 1 and len(set(checked)) != len(checked):
        raise InvalidArgumentError("keys", "duplicate keys in one pull")
    return checked, endpoint

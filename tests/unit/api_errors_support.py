"""Rows of tests/unit/test_api_errors.py for configs and transfers, and the row type."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raykv import (
    CacheConfig,
    CacheManager,
    ConfigError,
    ExportedBlock,
    InvalidArgumentError,
    KVLayout,
    LayerSpec,
    TierConfig,
    TransferError,
)
from raykv.transfer import AuthToken, PageClient, PageServer, PeerAddress, TransferConfig

KEY = b"\x07" * 32


@dataclass
class World:
    """What a row's call may use: a manager with a committed prefix and an open, active cache."""

    mgr: CacheManager
    cache: Any
    block: ExportedBlock


@dataclass(frozen=True)
class Row:
    entry: str  # the public entry point
    case: str
    call: Callable[[World], object]
    error: type[Exception]
    attrs: dict[str, Any]


def arg(name: str) -> dict[str, Any]:
    return {"argument": name}


CONFIGS = [
    Row("CacheManager", "config dict", lambda w: CacheManager({}), InvalidArgumentError, arg("config")),
    Row(
        "CacheManager",
        "policy int",
        lambda w: CacheManager(w.mgr.config, policy=3),
        InvalidArgumentError,
        arg("policy"),
    ),
    Row(
        "KVLayout",
        "tpb 0",
        lambda w: KVLayout.uniform(1, 1, 8, 0),
        ConfigError,
        {"field": "tokens_per_block"},
    ),
    Row(
        "TierConfig",
        "capacity < 0",
        lambda w: TierConfig("host", -1),
        ConfigError,
        {"field": "capacity_bytes"},
    ),
    Row("TierConfig", "unknown kind", lambda w: TierConfig("tape", 1 << 20), ConfigError, {"field": "kind"}),
    Row("CacheConfig", "no tiers", lambda w: CacheConfig(w.mgr.layout, ()), ConfigError, {"field": "tiers"}),
    Row("LayerSpec", "no buffers", lambda w: LayerSpec(0, ()), ConfigError, {"field": "buffers"}),
    Row("TransferConfig", "port 70000", lambda w: TransferConfig(port=70000), ConfigError, {"field": "port"}),
    Row(
        "TransferConfig",
        "max_keys 0",
        lambda w: TransferConfig(max_keys=0),
        ConfigError,
        {"field": "max_keys"},
    ),
    Row(
        "TransferConfig",
        "timeout nan",
        lambda w: TransferConfig(timeout_s=float("nan")),
        ConfigError,
        {"field": "timeout_s"},
    ),
    Row(
        "TransferConfig",
        "connect_timeout 0",
        lambda w: TransferConfig(connect_timeout_s=0),
        ConfigError,
        {"field": "connect_timeout_s"},
    ),
    Row(
        "TransferConfig",
        "ucx_progress",
        lambda w: TransferConfig(ucx_progress="spin"),
        ConfigError,
        {"field": "ucx_progress"},
    ),
    Row(
        "TransferConfig",
        "use_shm int",
        lambda w: TransferConfig(use_shm=1),
        ConfigError,
        {"field": "use_shm"},
    ),
    Row(
        "TransferConfig",
        "inflight < payload",
        lambda w: TransferConfig(max_payload_bytes=1 << 20, client_inflight_bytes=1 << 10),
        ConfigError,
        {"field": "client_inflight_bytes"},
    ),
]


def client(**changes: Any) -> PageClient:
    return PageClient(AuthToken.generate(), TransferConfig.loopback(**changes))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


TRANSFER = [
    Row("PeerAddress", "port 0", lambda w: PeerAddress("127.0.0.1", 0), InvalidArgumentError, arg("peer")),
    Row("PeerAddress", "host empty", lambda w: PeerAddress("", 80), InvalidArgumentError, arg("peer")),
    Row("PageClient", "short token", lambda w: PageClient(b"short"), InvalidArgumentError, arg("token")),
    Row(
        "PageClient",
        "config dict",
        lambda w: PageClient(AuthToken.generate(), {}),
        InvalidArgumentError,
        arg("config"),
    ),
    Row(
        "PageServer",
        "manager None",
        lambda w: PageServer(None, AuthToken.generate()),
        InvalidArgumentError,
        arg("manager"),
    ),
    Row(
        "PageServer",
        "config str",
        lambda w: PageServer(w.mgr, AuthToken.generate(), "c"),
        InvalidArgumentError,
        arg("config"),
    ),
    Row(
        "PageClient.pull_sync",
        "key 31 bytes",
        lambda w: client().pull_sync(("127.0.0.1", 1), [b"k" * 31]),
        InvalidArgumentError,
        arg("key"),
    ),
    Row(
        "PageClient.pull_sync",
        "duplicate keys",
        lambda w: client().pull_sync(("127.0.0.1", 1), [KEY, KEY]),
        InvalidArgumentError,
        arg("keys"),
    ),
    Row(
        "PageClient.pull_sync",
        "peer str",
        lambda w: client().pull_sync("127.0.0.1:1", [KEY]),
        InvalidArgumentError,
        arg("peer"),
    ),
    Row(
        "PageClient.pull_sync",
        "port str",
        lambda w: client().pull_sync(("127.0.0.1", "x"), [KEY]),
        InvalidArgumentError,
        arg("peer"),
    ),
    Row(
        "PageClient.pull",
        "timeout_s < 0",
        lambda w: client().runtime.run(client().pull(("127.0.0.1", 1), [KEY], timeout_s=-1), 10),
        InvalidArgumentError,
        arg("timeout_s"),
    ),
    Row(
        "PageClient.pull_sync",
        "nobody listens",
        lambda w: client(connect_timeout_s=3.0, timeout_s=5.0).pull_sync(
            ("127.0.0.1", free_port()), [KEY], prefer_shm=False
        ),
        TransferError,
        {"reason": "connect"},
    ),
]

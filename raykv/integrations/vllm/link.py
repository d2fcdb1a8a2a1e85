"""The scheduler side's line to a raykv deployment (a protocol; the Ray implementation is injected).

raykv/ never imports ray, so the connector reaches the deployment through a
:class:`DeploymentLink` built by a factory named in ``kv_connector_extra_config["link"]``
(``"module:attribute"``, default :data:`DEFAULT_LINK`, :class:`actors.vllm_link.RayDeploymentLink`).
The factory is called with the extra config (a dict) and returns a link, or raises when no
deployment is reachable: :func:`open_link` then logs one warning and returns None, and the
connector does nothing (every lookup misses, nothing is stored).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from raykv import ConfigError, KVLayout, ReuseScope
from raykv.integrations.vllm.plan import EngineLink
from raykv.transfer import PeerAddress

log = logging.getLogger(__name__)

DEFAULT_LINK = "actors.vllm_link:RayDeploymentLink"


class DeploymentLink(Protocol):
    """What the scheduler side needs from a deployment. Every call is bounded in time."""

    worker: str
    layout: KVLayout

    def engine_link(self, staging_bytes: int, listen_host: str) -> EngineLink:
        """The worker side's :class:`EngineLink` (address, node id, token)."""

    def lookup(
        self, tokens: Sequence[int], scope: ReuseScope, keys: Sequence[bytes], hint: Mapping[str, Any]
    ) -> int | None:
        """How many leading blocks of ``keys`` (the full blocks of ``tokens`` in ``scope``) the
        paired CacheWorker holds now, after bringing them from another worker when the index, or
        ``hint`` (a producer's ``kv_transfer_params["raykv"]``: ``worker``, ``blocks``), says one
        holds more. None while the hinted worker holds fewer than ``blocks`` and the wait for them
        has not timed out (the caller asks again). 0 on any failure."""

    def store(self, staging: PeerAddress, keys: Sequence[bytes]) -> None:
        """Have the paired CacheWorker pull ``keys`` from the engine's staging page server
        (asynchronously; failures are counted, never raised)."""

    def poll(self) -> dict[str, int]:
        """Counters of finished stores since the last poll (``stored_blocks``, ``store_errors``)."""

    def close(self) -> None:
        """Wait for stores in flight (bounded) and release the connection."""


def open_link(extra: Mapping[str, Any]) -> DeploymentLink | None:
    """The link named by ``extra["link"]`` connected to the deployment, or None (one warning
    logged) when it cannot connect. ConfigError for a malformed ``link`` name."""
    target = extra.get("link", DEFAULT_LINK)
    if not isinstance(target, str) or target.count(":") != 1:
        raise ConfigError("link", f"must be 'module:attribute', got {target!r}")
    module_name, attr = target.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("link", f"cannot load {target!r}: {exc}") from None
    try:
        link: DeploymentLink = factory(dict(extra))
    except ConfigError:
        raise
    except Exception as exc:
        log.warning(
            "raykv: no deployment reachable (%s: %s); the connector does nothing", type(exc).__name__, exc
        )
        return None
    return link

"""The scheduler side's line to a raykv deployment (a protocol; the Ray implementation is injected).

raykv/ never imports ray, so the connector reaches the deployment through a
:class:`DeploymentLink` built by a factory named in ``kv_connector_extra_config["link"]``
(``"module:attribute"``, default :data:`DEFAULT_LINK`, :class:`actors.vllm.link.RayDeploymentLink`).
The factory is called with the extra config (a dict) and returns a link, or raises when no
deployment is reachable: :func:`open_link` then logs one warning and returns None, and the
connector does nothing (every lookup misses, nothing is stored).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, overload

from raykv import ConfigError, KVLayout, MultimodalItem, ReuseScope
from raykv.integrations.vllm.plan import EngineLink
from raykv.transfer.inbox import InboxCommit

log = logging.getLogger(__name__)

DEFAULT_LINK = "actors.vllm.link:RayDeploymentLink"
DISABLED_KEY = "disabled"
"""Extra config key: True runs the engine without raykv (a Serve replica on a node with no
CacheWorker; the replica warned once)."""


class LazyKeys(Sequence[bytes]):
    """A prompt's leading block keys, computed on first use by whichever thread reads them first
    (the Ray link's lookup thread, so that hashing stays off vLLM's scheduler thread), once;
    ``len`` is known without computing them. Thread-safe."""

    def __init__(self, compute: Callable[[], Sequence[bytes]], count: int) -> None:
        self._compute = compute
        self._count = count
        self._keys: list[bytes] | None = None
        self._lock = threading.Lock()

    def keys(self) -> list[bytes]:
        """The keys (computed now unless they were)."""
        with self._lock:
            if self._keys is None:
                self._keys = [bytes(k) for k in self._compute()][: self._count]
            return self._keys

    def head(self, count: int) -> LazyKeys:
        """The first ``count`` keys, as lazy (computing them computes these)."""
        return LazyKeys(self.keys, min(count, self._count))

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        return self.keys()[index]


@dataclass(frozen=True)
class Match:
    """What a lookup found for a prompt's leading block keys.

    ``held``: leading blocks the paired CacheWorker holds now (loadable at once).
    ``peer``, ``blocks``: another worker that holds (by the index) or is about to hold (by a
    producer's hint) the leading ``blocks`` blocks, more than ``held``; None and 0 when none
    does. ``wait``: the peer may not hold them yet (a hint), so a fetch waits for them first.
    """

    held: int
    peer: str | None = None
    blocks: int = 0
    wait: bool = False

    @property
    def fetchable(self) -> bool:
        """Whether a fetch from ``peer`` could bring blocks beyond ``held``."""
        return self.peer is not None and self.blocks > self.held


class DeploymentLink(Protocol):
    """What the scheduler side needs from a deployment. Every call is bounded in time; only
    :meth:`bind` and :meth:`engine_link` (once, as the engine starts) wait for the deployment;
    lookups (:meth:`lookup` may answer with a Future) and fetches run in the background and are
    polled."""

    worker: str
    layout: KVLayout
    timeout_s: float

    def bind(self, layout: KVLayout, model: str, fingerprint: bytes) -> None:
        """Pair the engine (pages of ``layout``, running ``model``, keys carrying ``fingerprint``)
        with its worker, which may take ``layout`` (a deployment started without one); sets
        :attr:`layout` to the layout in force. ConfigError (short, naming the differing fields
        and the fix) when the worker cannot serve such pages."""

    def engine_link(self, inbox_bytes: int, listen_host: str) -> EngineLink:
        """The worker side's :class:`EngineLink` (address, node id, token) with an inbox of
        ``inbox_bytes`` leased for each rank (none when the engine is on another node than its
        worker)."""

    def lookup(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        hint: Mapping[str, Any],
        mm_items: tuple[MultimodalItem, ...] = (),
    ) -> Match | Future[Match]:
        """Where the leading blocks of ``keys`` (the full blocks of ``tokens`` with multimodal
        items ``mm_items`` in ``scope``; the scheduler side passes :class:`LazyKeys`, which a
        link reads off the scheduler thread when it can) are:
        how many the paired CacheWorker holds, and which other worker holds more when the index
        says so, or when ``hint`` (the request's ``kv_transfer_params["raykv"]``) names one.
        ``hint`` may carry a producer's ``worker`` and ``blocks`` (prefill/decode: then ``wait``,
        its blocks may still be on their way; this comes first), and ``route``: the match of the
        Serve router that picked the engine's replica (:mod:`raykv.integrations.vllm.route`:
        the leading blocks the best few workers hold, checked against ``keys``). A link uses
        that match instead of asking the index again, and asks the index when none came or it
        is malformed or about other keys (never an error). Moves no
        page. A link that must ask another process returns at once with a Future of the Match
        (the scheduler side polls it each step and never waits for it on a busy engine; it may
        cancel it); either way ``Match(0)`` on any failure, never an exception."""

    def start_fetch(
        self,
        match: Match,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        mm_items: tuple[MultimodalItem, ...] = (),
    ) -> Any:
        """Start having the paired CacheWorker pull blocks ``match.held .. match.blocks - 1`` of
        ``keys`` from ``match.peer`` (after waiting, at most ``timeout_s``, for the peer to hold
        them when ``match.wait``), without blocking; the returned handle is for
        :meth:`poll_fetch` and :meth:`cancel_fetch`. Never raises: a fetch that cannot start
        resolves to ``match.held``."""

    def poll_fetch(self, fetch: Any, wait_s: float = 0.0) -> int | None:
        """None while ``fetch`` runs (after waiting at most ``wait_s`` for it); once done, how
        many leading blocks of its keys the paired CacheWorker holds (the blocks held at lookup
        when the fetch failed)."""

    def cancel_fetch(self, fetch: Any) -> None:
        """Its result is not wanted any more (blocks it still brings stay cached, nothing leaks)."""

    def store(self, commits: Sequence[InboxCommit]) -> None:
        """Have the paired CacheWorker commit blocks the worker side wrote into its inboxes, in
        order (asynchronously; the outcome is counted, never raised)."""

    def report_timing(self, totals: Sequence[int]) -> None:
        """Hand the engine's timing totals ``[pulled tokens, pull us, prefilled tokens, prefill
        us]`` (added up since the engine started) to the paired CacheWorker, where the engine's
        Serve replica reads them for its routers. Asynchronous; never raises (a failure is
        counted as ``timing_errors``)."""

    def poll(self) -> dict[str, int]:
        """Counters of finished stores and fetches since the last poll (``stored_blocks``,
        ``store_errors``, ``fetch_errors``...)."""

    def close(self) -> None:
        """Wait for stores in flight (bounded), drop fetches and release the connection."""


def open_link(extra: Mapping[str, Any]) -> DeploymentLink | None:
    """The link named by ``extra["link"]`` connected to the deployment, or None (one warning
    logged) when it cannot connect, or when ``extra["disabled"]``. ConfigError for a malformed
    ``link`` name."""
    if extra.get(DISABLED_KEY):
        log.info("raykv: the connector is disabled for this engine (no raykv worker to pair with)")
        return None
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

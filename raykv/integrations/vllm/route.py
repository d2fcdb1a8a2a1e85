"""The Serve router's match, carried by a request to its engine (``kv_transfer_params["raykv"]["route"]``).

raykv's Serve router (``actors.serve.router.CacheAwareRouter``) asks the index where a request's
prefix is cached before it picks a replica. It writes that answer into the request it forwards
(``actors.serve.match``), so the engine's lookup (the connector's scheduler side, through its
:class:`~raykv.integrations.vllm.link.DeploymentLink`) asks only its paired CacheWorker and
not the index again. The field, as :meth:`Route.field` writes it::

    {"keys": 12, "key": "<16 hex digits>", "workers": {"raykv-worker-1": 12, "raykv-worker-0": 3}}

- ``keys``: how many leading blocks of the prompt the match covers, those an engine looks up
  (the prompt's full blocks before its last token: ``(len(prompt) - 1) // block_size``);
- ``key``: the first :data:`KEY_BYTES` bytes, in hex, of the router's key of block ``keys - 1``.
  Block keys chain (each hashes its parent), so an engine whose own key of that block starts
  the same way keyed the same tokens, block size, model, ``cache_salt`` and LoRA adapter
  (:meth:`Route.covers`); the match of any other keys is not used;
- ``workers``: per worker, the leading blocks of those ``keys`` that the index said it holds
  (0 < blocks <= keys; the router names the best few, :data:`MAX_WORKERS` at most).

:meth:`Route.parse` raises ValueError for anything else; a link then asks the index as if no
match came. The field is a routing hint and trusted as little as the index: a worker it names
is asked for those blocks' keys, which are the engine's own, and a block it does not hold is
recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FIELD = "route"
"""The key of the match in ``kv_transfer_params["raykv"]``."""
KEY_BYTES = 8
"""Bytes of the last covered block's key that the field carries (as 16 hex digits)."""
MAX_WORKERS = 64
"""Most workers a well-formed field names (the router names 4 at most)."""


@dataclass(frozen=True)
class Route:
    """A router's match (module docstring): ``keys`` leading blocks covered, ``key`` the first
    :data:`KEY_BYTES` bytes of the last one's key, ``workers`` the leading blocks each worker
    holds of them."""

    keys: int
    key: bytes
    workers: Mapping[str, int]

    @classmethod
    def of(cls, keys: Sequence[bytes], workers: Mapping[str, int]) -> Route:
        """The match of the block keys ``keys`` (those an engine looks up, at least one) where
        each of ``workers`` holds its leading blocks (capped at ``len(keys)``; 0 dropped)."""
        if not keys:
            raise ValueError("a route covers at least one block")
        held = {str(w): min(int(n), len(keys)) for w, n in workers.items() if n > 0}
        return cls(len(keys), bytes(keys[-1][:KEY_BYTES]), held)

    def field(self) -> dict[str, Any]:
        """The field as the request carries it (JSON types only)."""
        return {"keys": self.keys, "key": self.key.hex(), "workers": dict(self.workers)}

    @classmethod
    def parse(cls, raw: Any) -> Route:
        """The Route a request's field holds; ValueError (naming what is wrong) when it is not
        one :meth:`field` could have written."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"not a mapping: {type(raw).__name__}")
        keys: Any = raw.get("keys")
        key: Any = raw.get("key")
        workers: Any = raw.get("workers")
        if not _count(keys) or keys < 1:
            raise ValueError(f"keys must be an int >= 1, got {keys!r}")
        if not isinstance(key, str) or len(key) != 2 * KEY_BYTES:
            raise ValueError(f"key must be {2 * KEY_BYTES} hex digits")
        digest = bytes.fromhex(key)  # ValueError for a non-hex digit
        if not isinstance(workers, Mapping) or len(workers) > MAX_WORKERS:
            raise ValueError(f"workers must be a mapping of at most {MAX_WORKERS} workers")
        for name, blocks in workers.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"worker names must be non-empty strings, got {name!r}")
            if not _count(blocks) or not 0 <= blocks <= keys:
                raise ValueError(f"{name}: blocks must be an int in 0..{keys}, got {blocks!r}")
        return cls(keys, digest, {name: blocks for name, blocks in workers.items() if blocks > 0})

    def covers(self, keys: Sequence[bytes]) -> bool:
        """Whether this match is about exactly the block keys ``keys`` (as many, and the last
        one's key starts with :attr:`key`)."""
        return len(keys) == self.keys and bytes(keys[-1][:KEY_BYTES]) == self.key

    def best_other(self, worker: str, held: int) -> tuple[str, int] | None:
        """The worker other than ``worker`` holding the most blocks, more than ``held`` (the
        first named of equals), and its blocks; None when none holds more."""
        best: tuple[str, int] | None = None
        for name, blocks in self.workers.items():
            if name != worker and blocks > (held if best is None else best[1]):
                best = (name, blocks)
        return best


def _count(value: Any) -> bool:
    """Whether ``value`` is an int (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)

"""Import pulled pages into a CacheManager: all verified, parents first, all or nothing.

A pull may come back without some keys (the peer never had them or evicted them). A block can
only be imported when its parent is a scope root, already cached here, or imported in the same
batch, so the importable part is the longest prefix of the pulled blocks whose parents are
satisfied; the rest is reported as ``dropped``. The import itself is
``CacheManager.import_blocks``: checksums checked again, the batch rejected whole on any problem.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.errors import ImportRejectedError, IntegrityError, TransferError
from raykv.manager import CacheManager
from raykv.transfer.client import PageClient, Peer, PulledPages
from raykv.types import BlockKey


@dataclass(frozen=True)
class PullOutcome:
    """What one pull did: which keys became committed here, and which path carried them.

    ``imported``: new committed blocks; ``already_present``: pulled but cached here already;
    ``missing``: the peer did not have them; ``dropped``: pulled but not importable (a parent
    missing, e.g. because an earlier key was missing on the peer).
    """

    imported: tuple[BlockKey, ...]
    already_present: tuple[BlockKey, ...]
    missing: tuple[BlockKey, ...]
    dropped: tuple[BlockKey, ...]
    path: str
    nbytes: int
    seconds: float

    @property
    def complete(self) -> bool:
        """True when every requested key is now cached here."""
        return not self.missing and not self.dropped


def importable_prefix(manager: CacheManager, pulled: PulledPages) -> int:
    """How many leading pulled blocks have their parent (root, cached, or earlier in the batch)."""
    seen: set[bytes] = set()
    with manager.locked():
        for i, (key, parent, root) in enumerate(zip(pulled.keys, pulled.parent_keys, pulled.parent_is_root)):
            if not (root or parent in seen or parent in manager.tree):
                return i
            seen.add(key)
    return len(pulled.keys)


def import_pulled(manager: CacheManager, pulled: PulledPages) -> PullOutcome:
    """Import the importable prefix of ``pulled`` (see module docstring).

    Raises TransferError (reason "integrity" or "rejected") when the manager rejects the batch;
    nothing is imported then. OutOfPagesError propagates (nothing imported either).
    """
    n = importable_prefix(manager, pulled)
    blocks = pulled.to_exported()[:n]
    try:
        result = manager.import_blocks(blocks)
    except IntegrityError as exc:
        index = getattr(exc, "index", None)
        bad = (blocks[index].key,) if isinstance(index, int) and 0 <= index < len(blocks) else ()
        raise TransferError(f"import refused: {exc}", reason="integrity", bad_keys=bad) from None
    except ImportRejectedError as exc:
        raise TransferError(f"import refused: {exc}", reason="rejected") from None
    return PullOutcome(
        imported=result.imported,
        already_present=result.already_present,
        missing=pulled.missing,
        dropped=pulled.keys[n:],
        path=pulled.path,
        nbytes=pulled.nbytes,
        seconds=pulled.seconds,
    )


async def pull_into(
    client: PageClient, peer: Peer, manager: CacheManager, keys: Sequence[bytes], prefer_shm: bool = True
) -> PullOutcome:
    """Pull ``keys`` from ``peer`` and import them into ``manager`` (on the runtime loop).

    TransferError for any transfer or import failure: nothing is imported, the caller recomputes.
    The client skips its own checksum pass: ``import_blocks`` compares every page with the
    sender's checksum anyway, before anything is imported.
    """
    pulled = await client.pull(peer, keys, prefer_shm, verify=False)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, import_pulled, manager, pulled)

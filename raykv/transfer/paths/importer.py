"""Import pulled pages into a CacheManager: all intact, parents first, all or nothing.

A pull may come back without some keys (the peer never had them or evicted them). A block can
only be imported when its parent is a scope root, already cached here, or imported in the same
batch, so the importable part is the longest prefix of the pulled blocks whose parents are
satisfied; the rest is reported as ``dropped``. The import itself is
``CacheManager.import_pages``: the rows go to the top tier in one batched copy, pages the client
did not verify are checked against the sender's checksums, the batch is rejected whole on any
problem.

:func:`pull_into` lands the pages as they arrive (``PageClient.pull_land``): over ``shm`` the new
pages are copied once, from the peer's shared tier straight into this manager's top tier, and
become visible only after the peer confirmed its lease lasted; over ``ucx`` they are copied once,
from the buffer they were received (and verified) into: a payload of several chunks chunk by chunk
as they arrive, the blocks inserted once all arrived verified (``Lander.stream``, see
:mod:`raykv.transfer.pages.landing`).
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from raykv.core.errors import ImportRejectedError, IntegrityError, TransferError, TransferFailure
from raykv.core.export_import import import_written, rows_of
from raykv.core.manager import CacheManager
from raykv.core.records import BlockRecords, ImportResult
from raykv.core.types import DEFAULT_PRIORITY, BlockKey, PageId
from raykv.transfer.net.config import Peer
from raykv.transfer.pages.landing import Arrivals
from raykv.transfer.pages.results import PulledPages
from raykv.transfer.paths.pull_client import PullClient


@dataclass(frozen=True)
class PullOutcome:
    """What one pull did: which keys became committed here, and which path carried them.

    ``imported``: new committed blocks; ``already_present``: pulled but cached here already;
    ``missing``: the peer did not have them; ``dropped``: pulled but not importable (a parent
    missing, e.g. because an earlier key was missing on the peer); ``refused``: pulled and
    importable, but not cached: the salt's quota here refused them (``max_blocks_per_salt``).
    """

    imported: tuple[BlockKey, ...]
    already_present: tuple[BlockKey, ...]
    missing: tuple[BlockKey, ...]
    dropped: tuple[BlockKey, ...]
    path: str
    nbytes: int
    seconds: float
    refused: tuple[BlockKey, ...] = ()

    @property
    def complete(self) -> bool:
        """True when every requested key is now cached here."""
        return not self.missing and not self.dropped and not self.refused


def importable_prefix(manager: CacheManager, records: BlockRecords) -> int:
    """How many leading blocks have their parent (root, cached, or earlier in the batch)."""
    seen: set[bytes] = set()
    with manager.locked():
        if records.is_chain():  # only the head's parent matters
            head = records.parent_is_root[0] or records.parent_keys[0] in manager.tree
            return len(records.keys) if head else 0
        for i, (key, parent, root) in enumerate(
            zip(records.keys, records.parent_keys, records.parent_is_root)
        ):
            if not (root or parent in seen or parent in manager.tree):
                return i
            seen.add(key)
    return len(records.keys)


def import_pulled(
    manager: CacheManager, pulled: PulledPages, confirm: Callable[[], object] | None = None
) -> PullOutcome:
    """Import the importable prefix of ``pulled`` (see module docstring).

    Pages not ``pulled.verified`` are checked against ``pulled.checksums``. ``confirm``: passed
    to ``CacheManager.import_pages`` (runs before anything becomes visible; if it raises, nothing
    is imported). Raises TransferError (reason "integrity" or "rejected") when the manager
    rejects the batch; nothing is imported then. OutOfPagesError propagates (nothing imported).
    """
    return _import_pulled(manager, pulled, confirm, None)


def _import_pulled(
    manager: CacheManager,
    pulled: PulledPages,
    confirm: Callable[[], object] | None,
    start: float | None,
) -> PullOutcome:
    """:func:`import_pulled`; the outcome's ``seconds`` run from ``start`` (perf_counter) to the
    end of the import when given, else they are the pull's own ``pulled.seconds``."""
    records = pulled.records
    n = importable_prefix(manager, records)
    verify = not pulled.verified
    sums = pulled.checksums[:n] if verify else None
    with refusals(pulled.keys, n):
        result = (
            manager.import_pages(
                records if n == len(records) else records.head(n),
                pulled.data if n == len(pulled.data) else pulled.data[:n],
                sums,
                verify,
                confirm=confirm,
            )
            if n
            else ImportResult((), ())
        )
    return import_outcome(pulled, result, n, start)


def _import_streamed(
    manager: CacheManager,
    pulled: PulledPages,
    arrivals: Arrivals,
    confirm: Callable[[], object],
    start: float,
) -> PullOutcome:
    """:func:`_import_pulled` of verified pages that are still arriving (rows in order, see
    :class:`raykv.transfer.pages.landing.Arrivals`): the blocks are validated and their top-tier pages
    allocated and held first, each run of rows is copied in as soon as it arrived (the manager's
    lock is taken per copy, not across the waits), and the blocks are inserted once every row
    arrived verified and ``confirm`` passed. If the payload fails, nothing is imported."""
    records = pulled.records
    n = importable_prefix(manager, records)
    placed: list[tuple[list[PageId], list[int]]] = []

    def land() -> None:
        for slots, new in placed:
            _copy_as_arrived(manager, pulled.data, slots, new, arrivals)
        arrivals.wait_done()
        confirm()

    with refusals(pulled.keys, n):
        head = records if n == len(records) else records.head(n)
        write = lambda *at: placed.append(at)  # noqa: E731 - the rows follow in land()
        result = import_written(manager, head, write, DEFAULT_PRIORITY, land) if n else ImportResult((), ())
    if not placed:  # nothing new: the outcome still waits for the payload's verdict
        land()
    return import_outcome(pulled, result, n, start)


def _copy_as_arrived(
    manager: CacheManager,
    data: npt.NDArray[np.uint8],
    slots: list[PageId],
    new: list[int],
    arrivals: Arrivals,
) -> None:
    """Copy rows ``new`` (ascending) of ``data`` into top-tier ``slots`` (same order), each run
    of them as soon as it arrived."""
    done = 0
    while done < len(new):
        arrived = arrivals.wait_rows(new[done])
        end = bisect.bisect_left(new, arrived, lo=done)
        with manager.locked():
            manager.copy.write(0, slots[done:end], rows_of(data, new[done:end]))
        done = end


@contextlib.contextmanager
def refusals(keys: Sequence[BlockKey], n: int) -> Iterator[None]:
    """The manager's refusals of an import of the first ``n`` of ``keys`` as TransferError: an
    IntegrityError as reason "integrity" (``bad_keys``: the record's key), an ImportRejectedError
    as reason "rejected" (nothing was imported in either case)."""
    try:
        yield
    except IntegrityError as exc:
        index = getattr(exc, "index", None)
        bad = (keys[index],) if isinstance(index, int) and 0 <= index < n else ()
        raise TransferError(
            f"import refused: {exc}", reason=TransferFailure.INTEGRITY, bad_keys=bad
        ) from None
    except ImportRejectedError as exc:
        raise TransferError(f"import refused: {exc}", reason=TransferFailure.REJECTED) from None


class Landed(Protocol):
    """What :func:`import_outcome` reads of the pages of one pull (:class:`PulledPages`, or the
    ``direct`` path's pages): their keys in request order, the keys the peer did not have, the
    path, the payload's bytes and the pull's seconds."""

    @property
    def keys(self) -> tuple[BlockKey, ...]: ...
    @property
    def missing(self) -> tuple[BlockKey, ...]: ...
    @property
    def path(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def seconds(self) -> float: ...


def import_outcome(pulled: Landed, result: ImportResult, n: int, start: float | None) -> PullOutcome:
    """What an import of ``pulled``'s first ``n`` pages did: the rest are ``dropped``;
    ``seconds`` since ``start`` (None: the pull's own ``seconds``)."""
    return PullOutcome(
        imported=result.imported,
        already_present=result.already_present,
        missing=pulled.missing,
        dropped=pulled.keys[n:],
        path=pulled.path,
        nbytes=pulled.nbytes,
        seconds=pulled.seconds if start is None else time.perf_counter() - start,
        refused=result.refused,
    )


class Lander:
    """The ``land`` of a pull into ``manager``: :func:`import_pulled`, its ``seconds`` counted
    from its creation (the pull and the import). ``quick``: it never blocks for long, so a small
    landing may run on the loop (:data:`raykv.transfer.pages.landing.INLINE_LAND_BYTES`)."""

    quick = True

    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager
        self.start = time.perf_counter()

    def __call__(self, pulled: PulledPages, confirm: Callable[[], None]) -> PullOutcome:
        return _import_pulled(self.manager, pulled, confirm, self.start)

    def stream(self, pulled: PulledPages, arrivals: Arrivals, confirm: Callable[[], None]) -> PullOutcome:
        """The landing of a payload still arriving (:data:`raykv.transfer.pages.landing.StreamLand`)."""
        return _import_streamed(self.manager, pulled, arrivals, confirm, self.start)


async def pull_into(
    client: PullClient,
    peer: Peer,
    manager: CacheManager,
    keys: Sequence[bytes],
    prefer_shm: bool = True,
    verify: bool | None = None,
    one_sided: bool = True,
) -> PullOutcome:
    """Pull ``keys`` from ``peer`` and import them into ``manager`` (on the runtime loop).
    ``one_sided`` as in ``PageClient.pull``.

    TransferError for any transfer or import failure: nothing is imported, the caller recomputes.
    ``verify`` as in ``PageClient.pull`` (over ``ucx`` the pages are verified as they arrive, the
    import does not check them again). ``seconds`` of the outcome cover the pull and the import.
    A pull cancelled (or timed out) while its import is underway waits for the import to stop;
    only an import already past the peer's confirmation stands.
    """
    return await client.pull_land(peer, keys, Lander(manager), prefer_shm, verify=verify, one_sided=one_sided)


def pull_into_local(
    client: PullClient, peer: Peer, manager: CacheManager, keys: Sequence[bytes]
) -> PullOutcome | None:
    """:func:`pull_into` over a one-sided same-node read, in the calling thread (no event loop,
    no request: :mod:`raykv.transfer.paths.shm_read`). None, with nothing imported, when that path
    cannot serve every key or a page changed meanwhile; the caller then uses :func:`pull_into`.
    Import errors raise as for :func:`pull_into`."""
    return client.land_local(peer, keys, Lander(manager))


def merge_outcomes(outcomes: Sequence[PullOutcome], path: str) -> PullOutcome:
    """One outcome for consecutive pulls of one request (``missing``/``dropped`` of the last)."""
    if len(outcomes) == 1:
        return outcomes[0]
    return PullOutcome(
        imported=tuple(k for o in outcomes for k in o.imported),
        already_present=tuple(k for o in outcomes for k in o.already_present),
        missing=tuple(k for o in outcomes for k in o.missing),
        dropped=tuple(k for o in outcomes for k in o.dropped),
        path=path,
        nbytes=sum(o.nbytes for o in outcomes),
        seconds=sum(o.seconds for o in outcomes),
        refused=tuple(k for o in outcomes for k in o.refused),
    )

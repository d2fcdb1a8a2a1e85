"""Route answers from index entries: each worker's cached prefix of a request's keys (pure).

Shared by :class:`raykv.index.prefix_index.PrefixIndex` (one shard) and the sharded index client
(``actors/cache/index.py``), which gathers the entries from every shard. An entry is the immutable
tuple ``(all, gpu, host, disk)`` of lane-spread bitmasks of one key (see :mod:`raykv.index.prefix_index`):
worker ``w``'s bit is ``1 << (LANE_BITS * lane)``. Routing ANDs the masks of consecutive keys and
adds the per-tier masks into 16-bit lanes, so one pass over the keys yields, for every worker at
once, its cached prefix length and its blocks on each tier.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from raykv.core.types import WorkerId

LANE_BITS = 16
MAX_ROUTE_BLOCKS = 2**LANE_BITS - 1
FIRST_LOOKUPS = 4  # keys a route looks up at once at first (then 2x as many at a time)


class RouteMatch(NamedTuple):
    """One worker's cached prefix for a route query: ``blocks`` leading blocks, of which ``gpu``,
    ``host`` and ``disk`` are on each tier and ``predicted`` are credited by a recent routing
    decision but not yet reported by the worker."""

    worker: WorkerId
    blocks: int
    gpu: int = 0
    host: int = 0
    disk: int = 0
    predicted: int = 0


Entry = tuple[int, int, int, int]  # (all, gpu, host, disk) lane-spread masks
RouteMemo = dict[tuple[int, ...], dict[WorkerId, "RouteMatch"]]  # route answers by lane counters


ROW = struct.Struct("<5H")  # one compact route row: lane, blocks, gpu, host, disk


def pack_rows(matches: Iterable[RouteMatch], lane_of: Mapping[WorkerId, int]) -> bytes:
    """Matches as compact rows (:data:`ROW`, in the given order; predictions are not kept)."""
    return b"".join(ROW.pack(lane_of[m.worker], m.blocks, m.gpu, m.host, m.disk) for m in matches)


def unpack_rows(rows: bytes, lane_names: Mapping[int, WorkerId]) -> dict[WorkerId, RouteMatch]:
    """The route answer of compact rows; rows of lanes without a name are left out."""
    out: dict[WorkerId, RouteMatch] = {}
    for lane, blocks, gpu, host, disk in ROW.iter_unpack(rows):
        name = lane_names.get(lane)
        if name is not None:
            out[name] = RouteMatch(name, blocks, gpu, host, disk)
    return out


def merge_route(
    entries: Sequence[Entry | None], predicted: Sequence[int], lane_names: Mapping[int, WorkerId]
) -> dict[WorkerId, RouteMatch]:
    """Per-worker prefix and tier counts from per-position entries (see module docstring).

    ``entries[i]`` is the entry of key i (None if nobody holds it); ``predicted[i]`` (or an empty
    list) a lane-spread mask of workers credited with key i. Workers with no prefix are omitted.
    Runs of identical entry objects (a chain stored by the same workers on the same tiers: the
    index interns entries, so equal entries are usually one object) are counted in one step.
    The dict lists workers by lane when at most 64 lanes are in use (else in no fixed order).
    """
    n = min(len(entries), MAX_ROUTE_BLOCKS)
    if n == 0:
        return {}
    if not predicted:
        return route_held(entries, n, lane_names)  # type: ignore[arg-type]  # read-only there
    alive = -1
    cg = ch = cd = cp = 0
    ends: list[tuple[int, int]] = []  # (prefix length, lanes whose prefix ends there)
    i = 0
    while i < n:
        e = entries[i]
        p = predicted[i]
        new = alive & ((e[0] if e is not None else 0) | p)
        if new != alive:
            if i:
                ends.append((i, alive & ~new))
            alive = new
            if not alive:
                break
        j = _run_end(entries, predicted, i, n)
        run = j - i
        if e is not None:
            cg += (e[1] & alive) * run
            ch += (e[2] & alive) * run
            cd += (e[3] & alive) * run
            if p:
                cp += (p & ~e[0] & alive) * run
        else:
            cp += (p & alive) * run
        i = j
    if alive:
        ends.append((i, alive))
    return _collect(ends, (cg, ch, cd, cp), lane_names)


def route_held(
    entries: list[Entry | None],
    n: int,
    lane_names: Mapping[int, WorkerId],
    keys: Sequence[bytes] = (),
    get_many: Callable[[Sequence[bytes]], list[Entry | None]] | None = None,
    memo: RouteMemo | None = None,
) -> dict[WorkerId, RouteMatch]:
    """:func:`merge_route` of ``n`` positions without predictions (the common case).

    ``entries`` holds the first positions (at least one). Without ``get_many`` it holds all ``n``;
    with it, the positions beyond are ``get_many(keys[len(entries):n])``, fetched only when the walk
    gets there (all at once), so a prefix that ends within the first lookups costs few of them.
    ``memo`` goes to :func:`_collect`.
    """
    got = len(entries) if get_many is not None else n
    e = entries[0]
    if e is None or not e[0]:
        return {}
    alive = e[0]  # lanes holding every key so far
    cg = ch = cd = 0
    ends: list[tuple[int, int]] = []
    i = 0
    while True:
        j = i + 1 if i + 1 < got and entries[i + 1] is not e else _run_end(entries, (), i, got)
        while j == got < n and get_many is not None:  # the run reaches the last fetched position
            got = n  # the prefix outlived the first lookups: fetch the rest at once
            entries += get_many(keys[j:got])
            j = _run_end(entries, (), j - 1, got)
        run = j - i
        cg += (e[1] & alive) * run
        ch += (e[2] & alive) * run
        cd += (e[3] & alive) * run
        if j == n:
            break
        nxt = entries[j]
        if nxt is None:  # nobody holds key j: every prefix ends there
            ends.append((j, alive))
            return _collect(ends, (cg, ch, cd, 0), lane_names, memo)
        e = nxt
        new = e[0] & alive
        if new != alive:
            ends.append((j, alive & ~new))
            alive = new
            if not alive:
                break
        i = j
    if alive:
        ends.append((n, alive))
    return _collect(ends, (cg, ch, cd, 0), lane_names, memo)


def _run_end(entries: Sequence[Entry | None], predicted: Sequence[int], i: int, n: int) -> int:
    """The end of the run of positions equal to position ``i`` (entry and predicted mask)."""
    e = entries[i]
    if entries[n - 1] is e and not predicted:
        # The common whole-tail run, checked in one C-level pass (identity short-circuits).
        rest = entries[i:n]
        if rest.count(e) == n - i:  # type: ignore[attr-defined]
            return n
    j = i + 1
    if predicted:
        p = predicted[i]
        while j < n and entries[j] is e and predicted[j] == p:
            j += 1
    else:
        while j < n and entries[j] is e:
            j += 1
    return j


def _collect(
    ends: list[tuple[int, int]],
    counters: tuple[int, int, int, int],
    lane_names: Mapping[int, WorkerId],
    memo: RouteMemo | None = None,
) -> dict[WorkerId, RouteMatch]:
    """Each ended lane's RouteMatch from the lane-spread gpu/host/disk/predicted ``counters``;
    ``ends`` lists ``(prefix length, lanes whose prefix ends there)``, each lane once.

    ``memo`` (owned by one ``lane_names``, emptied by its owner when the names change) keeps
    answers by their lane-spread lengths and counters, which fully determine them: a common prefix
    (a shared system prompt) is then a copy of a dict, not a new RouteMatch per worker. The caller
    always gets a fresh dict.
    """
    blocks = 0
    for length, mask in ends:
        blocks |= length * mask  # each lane ends once, so the products never overlap
    if memo is not None:
        memo_key = (blocks, *counters)
        hit = memo.get(memo_key)
        if hit is not None:
            return hit.copy()
        out = _expand(blocks, counters, ends, lane_names)
        if len(memo) >= ROUTE_MEMO:
            memo.clear()
        memo[memo_key] = out.copy()
        return out
    return _expand(blocks, counters, ends, lane_names)


def _expand(
    blocks: int,
    counters: tuple[int, int, int, int],
    ends: list[tuple[int, int]],
    lane_names: Mapping[int, WorkerId],
) -> dict[WorkerId, RouteMatch]:
    """:func:`_collect` without the memo; ``blocks`` holds every lane's prefix length."""
    lanes = (blocks.bit_length() + LANE_BITS - 1) // LANE_BITS
    if sum(m.bit_count() for _, m in ends) <= SPARSE_MATCHES:
        return _collect_sparse(ends, counters, lane_names)  # few matches: visit only their bits
    if lanes > DENSE_LANES:
        return _collect_many(ends, counters, lane_names)
    # Only lanes that ended were counted, so no counter reaches above ``lanes`` lanes: struct
    # reads every lane's counts at once.
    unpack, size, zeros = _UNPACK_LANES[lanes], 2 * lanes, _ZERO_LANES[lanes]
    cg, ch, cd, cp = counters
    rows = zip(
        range(lanes),
        unpack(blocks.to_bytes(size, "little")),
        unpack(cg.to_bytes(size, "little")) if cg else zeros,
        unpack(ch.to_bytes(size, "little")) if ch else zeros,
        unpack(cd.to_bytes(size, "little")) if cd else zeros,
        unpack(cp.to_bytes(size, "little")) if cp else zeros,
    )
    get, new = lane_names.get, tuple.__new__
    out: dict[WorkerId, RouteMatch] = {}
    for lane, n, gpu, host, disk, pred in rows:
        if n:
            name = get(lane)
            if name is not None:
                out[name] = new(RouteMatch, (name, n, gpu, host, disk, pred))
    return out


def _collect_sparse(
    ends: list[tuple[int, int]], counters: tuple[int, int, int, int], lane_names: Mapping[int, WorkerId]
) -> dict[WorkerId, RouteMatch]:
    """:func:`_collect` for at most SPARSE_MATCHES matching lanes: bit by bit."""
    cg, ch, cd, cp = counters
    out: dict[WorkerId, RouteMatch] = {}
    for blocks, mask in ends:
        while mask:
            low = mask & -mask
            mask ^= low
            shift = low.bit_length() - 1
            name = lane_names.get(shift // LANE_BITS)
            if name is None:
                continue
            tiers = (
                (cg >> shift) & 0xFFFF,
                (ch >> shift) & 0xFFFF,
                (cd >> shift) & 0xFFFF,
                (cp >> shift) & 0xFFFF,
            )
            out[name] = _MAKE_MATCH((name, blocks, *tiers))
    return out


def _collect_many(
    ends: list[tuple[int, int]], counters: tuple[int, int, int, int], lane_names: Mapping[int, WorkerId]
) -> dict[WorkerId, RouteMatch]:
    """Vectorized lane extraction for routes that many workers match."""
    width = (max(lane_names) + 1 if lane_names else 1) * LANE_BITS // 8
    gpu, host, disk, pred = (
        np.frombuffer((c & ((1 << (8 * width)) - 1)).to_bytes(width, "little"), dtype="<u2") for c in counters
    )
    blocks = np.zeros(len(gpu), dtype=np.int64)
    for length, mask in ends:
        bits = np.frombuffer((mask & ((1 << (8 * width)) - 1)).to_bytes(width, "little"), dtype="<u2")
        blocks[bits != 0] = length
    lanes = np.flatnonzero(blocks)
    b = blocks[lanes]
    names = list(map(lane_names.get, lanes.tolist()))
    rows = zip(names, b.tolist(), *(a[lanes].tolist() for a in (gpu, host, disk, pred)))
    out: dict[WorkerId | None, RouteMatch] = dict(zip(names, map(_MAKE_MATCH, rows)))
    out.pop(None, None)  # lanes without a registered worker
    return out  # type: ignore[return-value]


_MAKE_MATCH = functools.partial(tuple.__new__, RouteMatch)
SPARSE_MATCHES = 8  # up to this many matching workers a route visits their bits one by one
DENSE_LANES = 64  # up to this many lanes a route reads every lane's counters in one C-level step
_UNPACK_LANES = tuple(struct.Struct(f"<{n}H").unpack for n in range(DENSE_LANES + 1))
_ZERO_LANES = tuple((0,) * n for n in range(DENSE_LANES + 1))
ROUTE_MEMO = 4096  # distinct route answers a PrefixIndex keeps (then it starts over)

"""Planning a batch of page copies: runs of consecutive slots, the kernel's slot table, DMA spans.

A batch is two int64 slot arrays (source and destination pages, page ``i`` at ``base + slot *
page_bytes``). A *run* is a stretch of pages consecutive on both sides: it can go as one DMA copy.
These helpers are plain numpy (no CUDA); the compiled ``raykv.native._slots`` does the same in one
pass when it was built (``RAYKV_PURE_SLOTS=1`` switches it off, read at every call) and gives
equal results.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from raykv import native

SLOT_MAX = (1 << 31) - 1
"""The largest slot a kernel slot table holds (int32)."""


def _check(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> None:
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError("source and destination slots must be 1-D arrays of equal length")


def run_starts(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Indices where a run consecutive on both sides starts (0 first; empty for an empty batch).
    ValueError when the arrays differ in shape."""
    _check(src, dst)
    compiled = native.load("_slots")
    if compiled is not None:
        out = np.empty(len(src), dtype=np.int64)
        return out[: compiled.run_starts(src, dst, out)]
    if len(src) == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    return np.concatenate((np.zeros(1, dtype=np.int64), breaks.astype(np.int64)))


def pack(
    src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64], out: npt.NDArray[np.int32], cap: int = -1
) -> int:
    """Write ``src`` then ``dst`` into the int32 ``out[:2n]`` (the copy kernel's slot table) and
    return the batch's number of runs, or ``cap`` (>= 0) when there are at least that many (the
    compiled pass then stops counting: a scattered batch whose only question is "more than a
    few runs?" is not scanned to the end). ValueError, with ``out`` unchanged, when the arrays
    differ in shape, ``out`` holds fewer than ``2n`` items or a slot is outside ``0..2**31-1``."""
    _check(src, dst)
    n = len(src)
    if len(out) < 2 * n:
        raise ValueError(f"slot table of {len(out)} items is too short for {n} pages")
    compiled = native.load("_slots")
    if compiled is not None:
        return int(compiled.pack(src, dst, out, cap))
    if n and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) > SLOT_MAX):
        raise ValueError("a slot is outside 0..2**31-1")
    out[:n] = src
    out[n : 2 * n] = dst
    runs = len(run_starts(src, dst))
    return min(runs, cap) if cap >= 0 else runs


def pack_ids(
    first: Sequence[int] | npt.NDArray[np.int64] | None,
    second: Sequence[int] | npt.NDArray[np.int64],
    out: npt.NDArray[np.int32],
    first_limit: int,
    second_limit: int,
) -> int:
    """Write ``first`` (None: ``0 .. n-1``) then ``second`` into the int32 ``out[:2n]`` (the block
    copy kernel's table) and return n. Sequences of ints (lists of Python ints are read directly
    by the compiled path) or 1-D int64 arrays. ValueError, with ``out`` unchanged, when the
    lengths differ, ``out`` is too short, an item of ``first`` is outside ``0..first_limit-1`` or
    one of ``second`` outside ``0..second_limit-1`` (limits in ``1..2**31``); TypeError for an
    item that is not an integer."""
    compiled = native.load("_slots")
    if compiled is not None:
        return int(compiled.pack_ids(first, second, out, first_limit, second_limit))
    if not (0 < first_limit <= SLOT_MAX + 1 and 0 < second_limit <= SLOT_MAX + 1):
        raise ValueError("limits must be in 1..2**31")
    b = _int_array(second)
    n = len(b)
    a = np.arange(n, dtype=np.int64) if first is None else _int_array(first)
    if len(a) != n:
        raise ValueError("first and second differ in length")
    if len(out) < 2 * n:
        raise ValueError("out is too short")
    for name, values, limit in (("first", a, first_limit), ("second", b, second_limit)):
        bad = np.flatnonzero((values < 0) | (values >= limit))
        if len(bad):
            raise ValueError(f"{name}[{int(bad[0])}] is outside 0..{limit - 1}")
    out[:n] = a
    out[n : 2 * n] = b
    return n


def _int_array(values: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``values`` as a 1-D int64 array (TypeError for items that are not integers)."""
    if isinstance(values, np.ndarray):
        if values.dtype != np.int64 or values.ndim != 1:
            raise TypeError("arrays must be 1-D int64")
        return values
    low, high = -(1 << 63), 1 << 63
    items = [v if low <= v < high else -1 for v in map(operator.index, values)]  # -1: out of range
    return np.asarray(items, dtype=np.int64).reshape(-1)


def runs(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, length) of each run, in batch order."""
    starts = run_starts(src, dst)
    lengths = np.diff(np.append(starts, len(src)))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist()))


def spans(
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    src_base: int,
    dst_base: int,
    page_bytes: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The runs as DMA copy descriptors: (destination addresses, source addresses, byte counts),
    contiguous uint64 arrays in batch order (what ``cuMemcpyBatchAsync`` reads). ValueError
    when the arrays differ in shape."""
    _check(src, dst)
    compiled = native.load("_slots")
    if compiled is not None:  # one pass (numpy's five took 64 us of a 4,096-page batch)
        out = np.empty((3, len(src)), dtype=np.uint64)
        count = compiled.spans(src, dst, src_base, dst_base, page_bytes, *out)
        return out[0, :count], out[1, :count], out[2, :count]
    starts = run_starts(src, dst)
    lengths = np.diff(np.append(starts, len(src))).astype(np.uint64)
    page = np.uint64(page_bytes)
    dst_addr = np.uint64(dst_base) + dst[starts].astype(np.uint64) * page
    src_addr = np.uint64(src_base) + src[starts].astype(np.uint64) * page
    return dst_addr, src_addr, lengths * page


def int64_array(values: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``values`` as a flat int64 array (no copy for one already). A list or tuple of ints is read
    in compiled code where built: numpy's conversion took 77 us per 4,096 slots. OverflowError
    or TypeError as numpy raises them for items that are not int64 integers."""
    compiled = native.load("_slots")
    if compiled is not None and type(values) in (list, tuple):
        out = np.empty(len(values), dtype=np.int64)
        if compiled.fill_int64(values, out) == len(out):
            return out
    return np.asarray(values, dtype=np.int64).reshape(-1)

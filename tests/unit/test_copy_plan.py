"""Copy batch planning (raykv.core.tiers.copy_plan): compiled and numpy paths against a loop oracle."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raykv import native
from raykv.core.tiers import copy_plan

PATHS = ["numpy"] + (["compiled"] if native.built("_slots") is not None else [])


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RAYKV_PURE_SLOTS", "1" if request.param == "numpy" else "0")
    return str(request.param)


def oracle_starts(src: list[int], dst: list[int]) -> list[int]:
    return [i for i in range(len(src)) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1]


def batch(draw_lengths: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated runs (source start, destination start, length) as int64 arrays."""
    src = [s + k for s, _, n in draw_lengths for k in range(n)]
    dst = [d + k for _, d, n in draw_lengths for k in range(n)]
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


runs_strategy = st.lists(
    st.tuples(st.integers(0, (1 << 31) - 7), st.integers(0, (1 << 31) - 7), st.integers(1, 6)), max_size=40
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # the fixture only sets an environment variable
@given(runs_strategy)
def test_pack_and_run_starts_match_the_oracle(path: str, drawn: list[tuple[int, int, int]]) -> None:
    src, dst = batch(drawn)
    n = len(src)
    out = np.full(2 * n + 3, -7, dtype=np.int32)
    starts = oracle_starts(src.tolist(), dst.tolist())
    assert copy_plan.pack(src, dst, out) == len(starts)
    assert out[:n].tolist() == src.tolist() and out[n : 2 * n].tolist() == dst.tolist()
    for cap in (0, 1, 2, 9, 300, len(starts), len(starts) + 1):  # the count stops at the cap
        assert copy_plan.pack(src, dst, out, cap) == min(len(starts), cap)
    assert out[:n].tolist() == src.tolist() and out[n : 2 * n].tolist() == dst.tolist()
    assert out[2 * n :].tolist() == [-7, -7, -7]
    assert copy_plan.run_starts(src, dst).tolist() == starts
    lengths = np.diff([*starts, n]).tolist()
    assert copy_plan.runs(src, dst) == [(int(src[i]), int(dst[i]), k) for i, k in zip(starts, lengths)]
    d, s, sizes = copy_plan.spans(src, dst, 1 << 40, 1 << 44, 4096)
    assert d.tolist() == [(1 << 44) + int(dst[i]) * 4096 for i in starts]
    assert s.tolist() == [(1 << 40) + int(src[i]) * 4096 for i in starts]
    assert sizes.tolist() == [k * 4096 for k in lengths]
    assert all(a.flags.c_contiguous and a.dtype == np.uint64 for a in (d, s, sizes))


def test_spans_are_byte_addresses_of_the_runs(path: str) -> None:
    src, dst = batch([(4, 10, 3), (0, 2, 1), (9, 20, 2)])
    d, s, sizes = copy_plan.spans(src, dst, 1000, 5000, 64)
    assert d.dtype == s.dtype == sizes.dtype == np.uint64
    assert d.tolist() == [5000 + 10 * 64, 5000 + 2 * 64, 5000 + 20 * 64]
    assert s.tolist() == [1000 + 4 * 64, 1000, 1000 + 9 * 64]
    assert sizes.tolist() == [3 * 64, 64, 2 * 64]


def test_empty_batch(path: str) -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert copy_plan.pack(empty, empty, np.zeros(0, dtype=np.int32)) == 0
    assert copy_plan.run_starts(empty, empty).tolist() == []
    assert copy_plan.runs(empty, empty) == []


def test_bad_input_is_refused_and_writes_nothing(path: str) -> None:
    src = np.arange(4, dtype=np.int64)
    out = np.full(8, -1, dtype=np.int32)
    with pytest.raises(ValueError):
        copy_plan.pack(src, np.arange(3, dtype=np.int64), out)
    with pytest.raises(ValueError):
        copy_plan.pack(src, src, np.full(7, -1, dtype=np.int32))
    for bad in (-1, 1 << 31, 1 << 40):  # a slot the int32 table cannot hold
        with pytest.raises(ValueError):
            copy_plan.pack(src, np.array([0, 1, bad, 3], dtype=np.int64), out)
    assert out.tolist() == [-1] * 8
    with pytest.raises(ValueError):
        copy_plan.run_starts(src, src.reshape(2, 2))


@pytest.mark.skipif(native.built("_slots") is None, reason="raykv.native._slots was not built")
def test_compiled_refuses_wrong_types() -> None:
    compiled = native.built("_slots")
    assert compiled is not None
    ints = np.arange(4, dtype=np.int64)
    with pytest.raises(TypeError):
        compiled.pack(ints.astype(np.int32), ints, np.zeros(8, dtype=np.int32))
    with pytest.raises(TypeError):
        compiled.pack(ints, ints, np.zeros(8, dtype=np.int64))  # the table is int32
    with pytest.raises(TypeError):
        compiled.pack(ints, ints, np.zeros(8, dtype=np.float32))
    with pytest.raises((TypeError, ValueError, BufferError)):
        compiled.pack(ints, ints, np.zeros(16, dtype=np.int32)[::2])
    readonly = np.zeros(8, dtype=np.int32)
    readonly.flags.writeable = False
    with pytest.raises((TypeError, ValueError, BufferError)):
        compiled.pack(ints, ints, readonly)


ids_strategy = st.lists(st.tuples(st.integers(0, 999), st.integers(0, 99)), max_size=50)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids_strategy, st.sampled_from(["list", "tuple", "array"]), st.booleans())
def test_pack_ids_writes_both_sequences(
    path: str, pairs: list[tuple[int, int]], kind: str, rows: bool
) -> None:
    first = [a for a, _ in pairs]
    second = [b for _, b in pairs]
    n = len(pairs)
    convert = {"list": list, "tuple": tuple, "array": lambda v: np.asarray(v, dtype=np.int64)}[kind]
    out = np.full(2 * n + 2, -7, dtype=np.int32)
    got = copy_plan.pack_ids(None if rows else convert(first), convert(second), out, 1000, 100)
    assert got == n
    assert out[:n].tolist() == (list(range(n)) if rows else first)
    assert out[n : 2 * n].tolist() == second and out[2 * n :].tolist() == [-7, -7]


def test_pack_ids_refuses_bad_input_and_writes_nothing(path: str) -> None:
    out = np.full(8, -1, dtype=np.int32)
    good = [0, 1, 2, 3]
    cases = [
        ([0, 1, 2], good, 10, 10, "differ in length"),
        (good, [0, 1, 2, 10], 10, 10, r"second\[3\] is outside 0..9"),
        ([0, -1, 2, 3], good, 10, 10, r"first\[1\] is outside 0..9"),
        ([0, 1, 1 << 70, 3], good, 10, 10, r"first\[2\] is outside"),
        (None, good, 3, 10, r"first\[3\] is outside 0..2"),  # rows 0..3 but only 3 pages
        (good, good, 0, 10, "limits"),
        (good, good, 10, (1 << 31) + 1, "limits"),
    ]
    for first, second, la, lb, message in cases:
        with pytest.raises(ValueError, match=message):
            copy_plan.pack_ids(first, second, out, la, lb)
    with pytest.raises(ValueError, match="too short"):
        copy_plan.pack_ids(good, good, out[:7], 10, 10)
    with pytest.raises(TypeError):
        copy_plan.pack_ids(good, [0, 1, "2", 3], out, 10, 10)
    with pytest.raises(TypeError):
        copy_plan.pack_ids(good, [0, 1, 2.0, 3], out, 10, 10)
    with pytest.raises(TypeError):
        copy_plan.pack_ids(np.arange(4, dtype=np.int32), good, out, 10, 10)
    assert out.tolist() == [-1] * 8
    assert copy_plan.pack_ids([np.int64(5)], [True], out, 10, 10) == 1  # integer-like items
    assert out[:2].tolist() == [5, 1]


def test_pack_ids_reads_lists_with_int_like_items(path: str) -> None:
    out = np.full(8, -1, dtype=np.int32)
    assert copy_plan.pack_ids([0, np.int64(3), 2], [True, 4, np.int32(5)], out, 10, 10) == 3
    assert out.tolist() == [0, 3, 2, 1, 4, 5, -1, -1]
    with pytest.raises(ValueError, match=r"first\[2\] is outside 0..9"):
        copy_plan.pack_ids([0, np.int64(3), 12], [1, 2, 3], out, 10, 10)
    assert out.tolist() == [0, 3, 2, 1, 4, 5, -1, -1]


_VOID_P, _UINTS = ctypes.c_void_p, (ctypes.c_uint,) * 7
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _VOID_P, *_UINTS, _VOID_P, ctypes.POINTER(_VOID_P), _VOID_P)
"""cuLaunchKernel's C signature, for a stand-in launch function."""


@pytest.mark.skipif(native.built("_slots") is None, reason="raykv.native._slots was not built")
def test_pack_launch_packs_the_table_then_calls_the_launch_once() -> None:
    compiled = native.built("_slots")
    assert compiled is not None
    table = (ctypes.c_int32 * 8)(*([-1] * 8))
    params = (ctypes.c_void_p * 1)(ctypes.addressof(table))
    seen: list[tuple[object, ...]] = []
    result = [0]

    def fake(fn, gx, gy, gz, bx, by, bz, shared, stream, argv, extra):  # type: ignore[no-untyped-def]
        packed = ctypes.cast(argv[0], ctypes.POINTER(ctypes.c_int32 * 8)).contents
        seen.append((fn, gx, gy, gz, bx, by, bz, shared, stream, list(packed), extra))
        return result[0]

    launch = _LAUNCH(fake)
    address = ctypes.cast(launch, ctypes.c_void_p).value

    def call(first: object, second: object, limits: tuple[int, int] = (10, 10)) -> int:
        table_at, params_at = ctypes.addressof(table), ctypes.addressof(params)
        return int(
            compiled.pack_launch(address, 11, 3, 2, 64, 99, params_at, table_at, 8, first, second, *limits)
        )

    assert call([1, 2, 3], [4, 5, 6]) == 0
    assert seen == [(11, 3, 2, 1, 64, 1, 1, 0, 99, [1, 2, 3, 4, 5, 6, -1, -1], None)]
    for first, second in (([1, 2, 30], [4, 5, 6]), ([1, 2], [4, 5, 6]), ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])):
        with pytest.raises(ValueError):
            call(first, second)
    with pytest.raises(TypeError):
        call([1, 2, 3], [4, "5", 6])
    assert len(seen) == 1 and list(table) == [1, 2, 3, 4, 5, 6, -1, -1]  # refused: nothing launched
    result[0] = 700  # a driver error comes back as its code
    assert call(None, [7, 8]) == 700
    assert seen[-1][9] == [0, 1, 7, 8, 5, 6, -1, -1]


def test_int64_array_reads_ints_of_any_kind(path: str) -> None:
    for values in ([3, 1, 2], (3, 1, 2), [3, np.int64(1), True + 1], np.array([3, 1, 2])):
        got = copy_plan.int64_array(values)
        assert got.dtype == np.int64 and got.tolist() == [3, 1, 2]
    assert copy_plan.int64_array([]).tolist() == []
    assert copy_plan.int64_array([-(1 << 63), (1 << 63) - 1]).tolist() == [-(1 << 63), (1 << 63) - 1]
    with pytest.raises(OverflowError):
        copy_plan.int64_array([0, 1 << 64])
    with pytest.raises((TypeError, ValueError)):
        copy_plan.int64_array([0, "x"])


@pytest.mark.parametrize("cap", [0, 1, 9, 255, 256, 257, 700, 5000])
def test_a_capped_run_count_over_many_blocks_of_pairs(path: str, cap: int) -> None:
    """Batches longer than the compiled pass's 256-pair blocks: runs of random lengths, so the
    count crosses blocks; the capped count is min(runs, cap), the table the same either way."""
    rng = np.random.default_rng(cap)
    lengths = rng.integers(1, 5, 900)
    starts = np.cumsum(np.concatenate(([0], lengths[:-1] + 3)))  # a gap after every run
    src = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, lengths)]).astype(np.int64)
    dst = src[::-1].copy()  # every pair breaks the destination's order: one run per page
    for a, b, runs in ((src, src + 7, len(lengths)), (src, dst, len(src))):
        out = np.zeros(2 * len(a), dtype=np.int32)
        assert copy_plan.pack(a, b, out) == runs
        assert copy_plan.pack(a, b, out, cap) == min(runs, cap)
        assert out[: len(a)].tolist() == a.tolist() and out[len(a) :].tolist() == b.tolist()

"""CacheManager.import_pages: blocks as columns plus one array of page rows, all or nothing.

Same rules as import_blocks (which delegates to it); these tests cover the array form: views and
gathers of the rows, optional verification, shape checks, the order in which problems are
reported, and the ``confirm`` hook that runs between writing the rows and inserting the blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from import_support import TPB, chain, toks

from raykv import (
    ImportRejectedError,
    IntegrityError,
    OutOfPagesError,
    ResourceBusyError,
    TierKind,
    block_keys,
)


def corrupt(data: np.ndarray, row: int) -> np.ndarray:
    bad = data.copy()
    bad[row, len(bad[row]) // 2] ^= 0x01
    return bad


def test_round_trip_into_the_top_tier(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(4, 4)
    tokens = toks(1, 12)
    records, data, sums = chain(src, run_request, tokens)
    result = dst.import_pages(records, data, sums, priority=60)
    dst.check_invariants()
    assert result.imported == tuple(records.keys) and result.already_present == ()
    assert [e.key for e in dst.drain_events()] == list(records.keys)
    assert dst.stats().imported_blocks == 3
    assert dst.probe(tokens).tiers == (TierKind.HOST,) * 3
    assert [dst.tree.get(k).page.priority for k in records.keys] == [60] * 3
    assert oracle.verify_manager(dst) == 3
    with dst.create(tokens) as cache:
        assert cache.num_reused_tokens == 12 and cache.resume()
        oracle.verify_cache(cache)
    dst.check_invariants()


@pytest.mark.parametrize("present", [[0], [1], [0, 2]], ids=["prefix", "middle", "scattered"])
def test_present_blocks_are_skipped_and_only_new_rows_copied(make_manager, oracle, run_request, present):
    src, dst = make_manager(8), make_manager(8)
    records, data, sums = chain(src, run_request, toks(1, 16))
    for i in present:  # cache some blocks first (each with its parents)
        dst.import_pages(records.head(i + 1), data[: i + 1], sums[: i + 1])
    have = {k for k in records.keys if k in dst.tree}
    dst.drain_events()
    result = dst.import_pages(records, data, sums)
    assert result.imported == tuple(k for k in records.keys if k not in have)
    assert result.already_present == tuple(k for k in records.keys if k in have)
    assert [e.key for e in dst.drain_events()] == list(result.imported)
    assert oracle.verify_manager(dst) == 4
    dst.check_invariants()


def test_verify_false_trusts_the_rows(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(8)
    records, data, _ = chain(src, run_request, toks(1, 8))
    result = dst.import_pages(records, data, None, verify=False)
    assert len(result.imported) == 2 and oracle.verify_manager(dst) == 2
    dst.check_invariants()


# ---- rejected batches change nothing ------------------------------------------------------------
@pytest.mark.parametrize("bad_row", [0, 2])
def test_checksum_mismatch_is_integrity_error(make_manager, run_request, state_of, bad_row):
    src, dst = make_manager(8), make_manager(8)
    run_request(dst, toks(9, 8))
    records, data, sums = chain(src, run_request, toks(1, 12))
    before = state_of(dst)
    with pytest.raises(IntegrityError) as err:
        dst.import_pages(records, corrupt(data, bad_row), sums)
    assert err.value.index == bad_row
    assert state_of(dst) == before


def test_shapes_are_checked(make_manager, run_request, state_of):
    src, dst = make_manager(8), make_manager(8)
    records, data, sums = chain(src, run_request, toks(1, 12))
    before = state_of(dst)
    bad_calls = [
        (records, data[:2], sums),  # a row short
        (records, data[:, :-1], sums),  # pages too small
        (records, data.astype(np.int16), sums),  # not uint8
        (records, data.tolist(), sums),  # not an array
        (records, data, sums[:2]),  # a checksum short
        (records, data, None),  # verify without checksums
        (dataclasses.replace(records, num_tokens=records.num_tokens[:2]), data, sums),
    ]
    for args in bad_calls:
        with pytest.raises(ImportRejectedError) as err:
            dst.import_pages(*args)
        assert err.value.index is None and not isinstance(err.value, IntegrityError)
    assert state_of(dst) == before


@pytest.mark.parametrize(
    "spoil",
    [
        lambda r: dataclasses.replace(r, keys=(*r.keys[:2], r.keys[2][:31])),
        lambda r: dataclasses.replace(r, parent_keys=(*r.parent_keys[:2], b"x")),
        lambda r: dataclasses.replace(r, keys=(*r.keys[:2], r.keys[0])),
        lambda r: dataclasses.replace(r, num_tokens=(TPB, TPB, TPB - 1)),
        lambda r: dataclasses.replace(r, parent_keys=(*r.parent_keys[:2], bytes(32))),
    ],
    ids=["short_key", "bad_parent_key", "duplicate", "partial_block", "missing_parent"],
)
def test_malformed_record_rejects_the_whole_batch(make_manager, run_request, state_of, spoil):
    src, dst = make_manager(8), make_manager(8)
    records, data, sums = chain(src, run_request, toks(1, 12))
    before = state_of(dst)
    with pytest.raises(ImportRejectedError) as err:
        dst.import_pages(spoil(records), data, sums)
    assert err.value.index == 2 and not isinstance(err.value, IntegrityError)
    assert state_of(dst) == before and dst.committed_blocks() == []


def test_the_first_bad_record_decides_the_error(make_manager, run_request, state_of):
    """Per record: key, duplicate and size checks, then the checksum, then the parent."""
    src, dst = make_manager(8), make_manager(8)
    records, data, sums = chain(src, run_request, toks(1, 12))
    orphan = dataclasses.replace(records, parent_keys=(*records.parent_keys[:2], bytes(32)))
    short = dataclasses.replace(records, keys=(*records.keys[:2], b"short"))
    before = state_of(dst)
    cases = [
        (orphan, corrupt(data, 0), IntegrityError, 0),  # checksum of an earlier record
        (orphan, corrupt(data, 2), IntegrityError, 2),  # same record: checksum before parent
        (short, corrupt(data, 2), ImportRejectedError, 2),  # same record: key before checksum
        (records.head(2), data[:2], None, None),  # the first two alone are fine (checked below)
    ]
    for recs, rows, kind, index in cases[:3]:
        with pytest.raises(ImportRejectedError) as err:
            dst.import_pages(recs, rows, sums[: len(recs)])
        assert type(err.value) is kind and err.value.index == index
    assert state_of(dst) == before
    assert dst.import_pages(cases[3][0], cases[3][1], sums[:2]).imported == tuple(records.keys[:2])


def test_out_of_pages_changes_nothing(make_manager, oracle, run_request, state_of):
    src, dst = make_manager(8), make_manager(2, 4)
    records, data, sums = chain(src, run_request, toks(1, 8))
    active = dst.create(toks(2, 8))
    assert active.resume()
    active.extend(toks(2, 8))  # both host pages pinned
    oracle.fill_cache(active)
    before = state_of(dst)
    with pytest.raises(OutOfPagesError):
        dst.import_pages(records, data, sums)
    assert state_of(dst) == before
    active.close()
    assert dst.import_pages(records, data, sums).imported == tuple(records.keys)
    dst.check_invariants()


# ---- confirm: rows written, blocks not inserted yet ---------------------------------------------
def test_confirm_runs_unlocked_before_anything_is_visible(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(8)
    tokens = toks(1, 12)
    records, data, sums = chain(src, run_request, tokens)
    dst.import_pages(records.head(1), data[:1], sums[:1])
    seen = []

    def confirm() -> None:
        dst.check_invariants()  # staged pages are leased, not leaked
        seen.append(dst.probe(tokens).num_blocks)
        with pytest.raises(ResourceBusyError):
            dst.clear_reusable()

    result = dst.import_pages(records, data, sums, confirm=confirm)
    assert seen == [1] and result.imported == tuple(records.keys[1:])
    assert oracle.verify_manager(dst) == 3 and not dst.store.leases
    dst.check_invariants()


def test_failed_confirm_imports_nothing(make_manager, run_request, state_of):
    src, dst = make_manager(8), make_manager(8)
    records, data, sums = chain(src, run_request, toks(1, 12))
    before = state_of(dst)

    def confirm() -> None:
        raise RuntimeError("peer went away")

    with pytest.raises(RuntimeError):
        dst.import_pages(records, data, sums, confirm=confirm)
    assert state_of(dst) == before and not dst.store.leases


def test_blocks_added_during_confirm_are_kept(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(8)
    tokens = toks(1, 12)
    records, data, sums = chain(src, run_request, tokens)

    def confirm() -> None:  # another import lands blocks 0 and 1 meanwhile
        dst.import_pages(records.head(2), data[:2], sums[:2])

    result = dst.import_pages(records, data, sums, confirm=confirm)
    assert result.imported == (records.keys[2],)
    assert result.already_present == tuple(records.keys[:2])
    assert dst.probe(tokens).num_blocks == 3 and oracle.verify_manager(dst) == 3
    assert dst.top_pool.num_used == 3  # the staged copies of blocks 0 and 1 were given back
    dst.check_invariants()


def test_the_cached_parent_cannot_be_evicted_during_confirm(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(4)
    tokens = toks(1, 12)
    records, data, sums = chain(src, run_request, tokens)
    dst.import_pages(records.head(1), data[:1], sums[:1])

    def confirm() -> None:  # 3 of 4 pages used: block 0 (the parent) and 2 staged pages
        with dst.create(toks(2, 8)) as cache:
            assert cache.resume()
            with pytest.raises(OutOfPagesError):
                cache.extend(toks(2, 8))  # would need to evict block 0

    dst.import_pages(records, data, sums, confirm=confirm)
    assert dst.probe(tokens).num_blocks == 3 and oracle.verify_manager(dst) == 3
    dst.check_invariants()


def test_import_blocks_still_reports_in_record_order(make_manager, run_request, state_of):
    """import_blocks delegates: a malformed record after a corrupt one reports the corrupt one."""
    src, dst = make_manager(8), make_manager(8)
    run_request(src, toks(1, 12))
    blocks = src.export_blocks(block_keys(toks(1, 12), TPB))
    corrupt0 = dataclasses.replace(blocks[0], data=b"\x01" + blocks[0].data[1:])
    before = state_of(dst)
    with pytest.raises(IntegrityError) as err:
        dst.import_blocks([corrupt0, blocks[1], dataclasses.replace(blocks[2], data=b"x")])
    assert err.value.index == 0
    with pytest.raises(ImportRejectedError) as err:
        dst.import_blocks([blocks[0], blocks[1], dataclasses.replace(blocks[2], data=b"x")])
    assert err.value.index == 2 and not isinstance(err.value, IntegrityError)
    assert state_of(dst) == before

"""pipelined_import.import_pipelined: an import in chunks whose copies overlap the inserts.

Every chunk is staged (pages allocated, copy started) before the first is confirmed (the first
chunk's copy starts before the records are validated when free slots allow); each chunk is then
confirmed and inserted in order. A confirm that raises stops the import there: earlier
chunks stay imported (whole, verified by the oracle), that chunk and later ones leave nothing
behind (no pages, no leases), and the exception comes back in ``stopped``.
"""

from __future__ import annotations

import dataclasses

import pytest
from import_support import chain, toks

import raykv.core.pipelined_import as tb
from raykv import ImportRejectedError, TransferError
from raykv.core.errors import TransferFailure
from raykv.core.pipelined_import import import_pipelined
from raykv.core.records import BlockRecords


def starts(count: int, per: int) -> list[int]:
    return list(range(0, count, per))


class Copier:
    """Writes rows into the top tier and records what each chunk's confirm sees."""

    def __init__(self, mgr, data, fail_at: int | None = None, during=None) -> None:
        self.mgr, self.data, self.fail_at, self.during = mgr, data, fail_at, during
        self.started: list[list[int]] = []
        self.confirmed: list[tuple[int, int]] = []

    def write(self, batches):
        handles = []
        for slots, new in batches:
            self.mgr.copy.write(0, slots, self.data[new] if new else self.data[:0])
            self.started.append(list(new))
            handles.append(len(self.started) - 1)  # the handle: the chunk's number
        return handles

    def confirm(self, handle, first, end):
        assert len(self.started) > handle  # every chunk was started before any confirm
        self.confirmed.append((first, end))
        if self.during is not None:
            self.during(len(self.confirmed) - 1)
        if self.fail_at is not None and len(self.confirmed) - 1 == self.fail_at:
            raise TransferError("source changed", reason=TransferFailure.STALE)


def test_all_chunks_imported_in_order(make_manager, oracle, run_request):
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 40))
    cp = Copier(dst, data)
    done = import_pipelined(dst, records, starts(len(records), 3), cp.write, cp.confirm, 50)
    dst.check_invariants()
    assert done.stopped is None and done.settled == 10
    assert done.result.imported == tuple(records.keys) and done.result.already_present == ()
    assert len(cp.started) == 4 and cp.confirmed == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [e.key for e in dst.drain_events()] == list(records.keys)
    assert oracle.verify_manager(dst) == 10
    assert not dst.store.leases


def test_present_blocks_are_skipped(make_manager, oracle, run_request):
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 24))
    dst.import_pages(records.head(2), data[:2], None, verify=False)
    cp = Copier(dst, data)
    done = import_pipelined(dst, records, starts(len(records), 2), cp.write, cp.confirm, 50)
    assert done.result.already_present == tuple(records.keys[:2])
    assert done.result.imported == tuple(records.keys[2:])
    assert cp.started[0] == []  # the first chunk had nothing to copy
    assert oracle.verify_manager(dst) == 6
    dst.check_invariants()


@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_a_failed_confirm_keeps_the_earlier_chunks_only(make_manager, oracle, run_request, fail_at):
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 40))
    cp = Copier(dst, data, fail_at=fail_at)
    done = import_pipelined(dst, records, starts(len(records), 3), cp.write, cp.confirm, 50)
    dst.check_invariants()
    assert isinstance(done.stopped, TransferError)
    assert done.settled == 3 * fail_at
    assert done.result.imported == tuple(records.keys[: 3 * fail_at])
    assert sorted(b.key for b in dst.committed_blocks()) == sorted(records.keys[: 3 * fail_at])
    assert dst.top_pool.num_used == 3 * fail_at and not dst.store.leases
    assert oracle.verify_manager(dst) == 3 * fail_at


def test_invalid_records_change_nothing(make_manager, run_request, state_of):
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 16))
    before = state_of(dst)
    cp = Copier(dst, data)
    with pytest.raises(ImportRejectedError):
        import_pipelined(dst, records.slice(1, 4), [0, 2], cp.write, cp.confirm, 50)  # no parent
    # Every chunk's copy starts into free slots before validation; they are given back.
    assert cp.started == [[0, 1], [2]] and state_of(dst) == before
    partial = dataclasses.replace(records, num_tokens=(*records.num_tokens[:3], 1))
    with pytest.raises(ImportRejectedError, match="record 3"):
        import_pipelined(dst, partial, [0, 2], cp.write, cp.confirm, 50)  # a partial block
    assert cp.started == [[0, 1], [2], [0, 1], [2, 3]] and state_of(dst) == before
    for bad in ([], [1], [0, 2, 2], [0, 4]):
        with pytest.raises(ValueError):
            import_pipelined(dst, records, bad, cp.write, cp.confirm, 50)
    assert len(cp.started) == 4 and state_of(dst) == before
    dst.check_invariants()


def _logged(cp: Copier, order: list[str], monkeypatch) -> object:
    """``cp.write`` noting each call in ``order``, with validation noted there too."""
    real = tb.validate

    def validate(*args):
        order.append("validate")
        return real(*args)

    def write(batches):
        order.append(f"write {len(batches)}")
        return cp.write(batches)

    monkeypatch.setattr(tb, "validate", validate)
    return write


def test_copies_start_before_validation_when_slots_are_free(make_manager, oracle, run_request, monkeypatch):
    """Every chunk fits in free slots: all copies start in one write, before validation."""
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 24))  # 6 blocks
    cp, order = Copier(dst, data), []
    done = import_pipelined(dst, records, starts(6, 3), _logged(cp, order, monkeypatch), cp.confirm, 50)
    assert order == ["write 2", "validate"] and done.result.imported == tuple(records.keys)
    assert cp.confirmed == [(0, 3), (3, 6)]
    assert oracle.verify_manager(dst) == 6
    dst.check_invariants()


@pytest.mark.parametrize(
    ("unrelated_tokens", "order"),
    [
        (16, ["write 1", "validate", "write 1"]),  # 4 of 8 slots taken: the first chunk fits
        (24, ["validate", "write 1", "write 1"]),  # 6 of 8 taken: none fits
    ],
    ids=["first-fits", "none-fits"],
)
def test_chunks_that_do_not_fit_wait_for_validation(
    make_manager, oracle, run_request, monkeypatch, unrelated_tokens, order
):
    """Chunks that fit in the free slots start before validation; the others are staged after it,
    evicting unrelated blocks as needed (starting them early would evict before the records are
    known good)."""
    src, dst = make_manager(16), make_manager(8)
    records, data, _ = chain(src, run_request, toks(1, 24))
    run_request(dst, toks(2, unrelated_tokens))  # unrelated cached blocks in 4 or 6 of the 8 slots
    cp, seen = Copier(dst, data), []
    done = import_pipelined(dst, records, starts(6, 3), _logged(cp, seen, monkeypatch), cp.confirm, 50)
    assert seen == order and done.result.imported == tuple(records.keys)
    assert oracle.verify_manager(dst) == 8  # 6 imported, 2 of the unrelated blocks left
    dst.check_invariants()


def test_chunks_started_ahead_but_partly_cached_are_given_back(
    make_manager, oracle, run_request, monkeypatch
):
    """A chunk started ahead whose blocks turn out (at validation) not all new gives its slots back
    and is staged for its new blocks only; nothing leaks."""
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 24))
    cp = Copier(dst, data)
    real = tb.validate

    def validate(mgr, recs, hold):
        new = real(mgr, recs, hold)
        dst.import_pages(records.head(5), data[:5], None, verify=False)  # a racing import
        return [i for i in new if i == 5]

    monkeypatch.setattr(tb, "validate", validate)
    done = import_pipelined(dst, records, starts(6, 3), cp.write, cp.confirm, 50)
    assert cp.started == [[0, 1, 2], [3, 4, 5], [], [5]]
    assert done.result.imported == (records.keys[5],)
    assert done.result.already_present == tuple(records.keys[:5])
    assert dst.top_pool.num_used == 6 and not dst.store.leases
    assert oracle.verify_manager(dst) == 6
    dst.check_invariants()


def test_committed_chunks_stay_while_later_ones_settle(make_manager, oracle, run_request):
    """Between chunks the lock is free: another request that needs every free page must not
    evict the chunks already inserted (their children are still to come), nor the staged ones."""
    src, dst = make_manager(16), make_manager(12)
    records, data, _ = chain(src, run_request, toks(1, 32))  # 8 blocks
    run_request(dst, toks(2, 16))  # 4 unrelated cached blocks: the only evictable ones
    evicted: list[int] = []

    def pressure(k: int) -> None:
        if k == 1:  # chunk 0 inserted, chunks 1.. staged
            before = len(dst.committed_blocks())
            run_request(dst, toks(3, 16))  # needs 4 pages: only the unrelated blocks may go
            evicted.append(before + 4 - len(dst.committed_blocks()))
            dst.check_invariants()

    cp = Copier(dst, data, during=pressure)
    done = import_pipelined(
        dst, records, starts(len(records), 3), cp.write, cp.confirm, 0
    )  # priority 0: first victims
    assert done.stopped is None and done.result.imported == tuple(records.keys)
    assert evicted == [4]
    assert all(k in dst.tree for k in records.keys)
    oracle.verify_manager(dst)
    dst.check_invariants()


@pytest.mark.parametrize(
    "defect",
    ["none", "present", "dup", "tokens", "root_mid", "orphan", "short_key", "bad_type", "unhashable"],
)
def test_chain_scan_agrees_with_the_full_scan(make_manager, run_request, monkeypatch, defect):
    """The C-level scan of chain-shaped batches returns what the per-record scan returns, and
    leaves every batch with a problem to it (same error, same record)."""
    import raykv.core.export_import as tb

    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 24))
    dst.import_pages(records.head(2), data[:2], None, verify=False)
    keys, parents = list(records.keys), list(records.parent_keys)
    roots, tokens = list(records.parent_is_root), list(records.num_tokens)
    if defect == "present":
        records = records.slice(1, 6)
    elif defect == "dup":
        keys[4] = keys[2]
    elif defect == "tokens":
        tokens[3] = 1
    elif defect == "root_mid":
        roots[2] = True
    elif defect == "orphan":
        parents[0], roots[0] = b"\x07" * 32, False
    elif defect == "short_key":
        keys[5] = b"abc"
    elif defect == "bad_type":
        keys[1] = bytearray(keys[1])
    elif defect == "unhashable":
        keys[3] = [1, 2]
    if defect not in ("none", "present"):
        records = BlockRecords(keys, parents, roots, tokens)

    def outcome():
        try:
            return tb.scan(dst.store, records)[0], tb.scan(dst.store, records)[1]
        except Exception as exc:  # a malformed record may raise from either scan the same way
            return type(exc)

    fast = outcome()
    if defect in ("none", "present"):
        assert tb.scan_chain(dst.store, records) is not None  # the fast path took these
    monkeypatch.setattr(tb, "scan_chain", lambda mgr, recs: None)
    slow = outcome()
    if isinstance(fast, tuple):
        assert fast[0] == slow[0]
        assert (fast[1] is None) == (slow[1] is None)
        if fast[1] is not None:
            assert (fast[1].index, str(fast[1].error)) == (slow[1].index, str(slow[1].error))
    else:
        assert fast == slow
    clean = defect in ("none", "present", "root_mid")  # a record may name a scope root as parent
    assert clean == (isinstance(fast, tuple) and fast[1] is None)


@pytest.mark.parametrize("count", [1, 16, 31, 32, 64, 100, 256, 1000])
def test_gpu_read_chunks_cover_the_records_with_a_short_last_chunk(count: int) -> None:
    """gpu_read's chunks: ascending from 0, none shorter than the minimum, one chunk when the
    records are few, and for 256 a last chunk of 8 (its insert is the one nothing overlaps)."""
    from raykv.transfer.paths.gpu_read import PIPELINE_MIN_CHUNK, chunk_starts

    starts = chunk_starts(count)
    sizes = [b - a for a, b in zip(starts, [*starts[1:], count])]
    assert starts[0] == 0 and all(s >= PIPELINE_MIN_CHUNK for s in sizes[:-1])
    assert sizes[-1] >= min(count, PIPELINE_MIN_CHUNK) and sum(sizes) == count
    assert (len(starts) == 1) == (count < 4 * PIPELINE_MIN_CHUNK)
    if count == 256:
        assert sizes == [64, 64, 64, 56, 8]


def test_each_chunk_is_held_until_the_next_one_is_inserted(make_manager, oracle, run_request):
    """While chunk k is confirmed, chunks k.. (staged) and k - 1 (its last block has no child yet)
    are leased, the earlier inserted ones are not (their blocks all have children); no lease is
    left at the end."""
    src, dst = make_manager(16), make_manager(16)
    records, data, _ = chain(src, run_request, toks(1, 40))  # 10 blocks, chunks of 3
    seen: list[list[int]] = []

    def leases(k: int) -> None:
        blocks = [dst.tree.blocks.get(key) for key in records.keys]
        seen.append([b.page.leases if b is not None else -1 for b in blocks])

    cp = Copier(dst, data, during=leases)
    done = import_pipelined(dst, records, starts(len(records), 3), cp.write, cp.confirm, 50)
    assert done.result.imported == tuple(records.keys)
    assert seen[0] == [-1] * 10  # nothing inserted yet
    assert seen[1] == [1, 1, 1] + [-1] * 7  # chunk 0 inserted, held until chunk 1 is
    assert seen[2] == [0, 0, 0, 1, 1, 1] + [-1] * 4
    assert seen[3] == [0] * 6 + [1, 1, 1, -1]
    assert all(dst.tree.blocks[k].page.leases == 0 for k in records.keys) and not dst.store.leases
    oracle.verify_manager(dst)
    dst.check_invariants()

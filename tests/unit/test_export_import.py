"""Block exchange between managers: export committed blocks (bytes + keys + checksum) from one,
import them into another, all or nothing."""

from __future__ import annotations

import dataclasses

import pytest
from import_support import toks

from raykv import (
    BlockStored,
    ExportedBlock,
    ImportRejectedError,
    IntegrityError,
    OutOfPagesError,
    ReuseScope,
    TierKind,
    block_keys,
    page_checksum,
)

TPB = 4


def exported_chain(mgr, run_request, tokens, **kw) -> list[ExportedBlock]:
    """Commit ``tokens`` in ``mgr`` and export the resulting chain of full blocks."""
    run_request(mgr, tokens, **kw)
    keys = block_keys(tokens, TPB, kw.get("scope"))
    out = mgr.export_blocks(keys)
    assert [b.key for b in out] == keys
    mgr.check_invariants()
    return out


def with_data(block: ExportedBlock, data: bytes) -> ExportedBlock:
    """The block with other bytes and a matching checksum (a well-formed record)."""
    return dataclasses.replace(block, data=data, checksum=page_checksum(data))


# ---- round trip ----------------------------------------------------------------------------------


def test_export_import_round_trip(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(4, 5)
    tokens = toks(1, 14)
    blocks = exported_chain(src, run_request, tokens)
    assert len(blocks) == 3 and blocks[0].parent_is_root and not blocks[1].parent_is_root
    assert blocks[0].parent_key == ReuseScope().root_key() and blocks[1].parent_key == blocks[0].key
    assert all(oracle.check(b.data, b.key) for b in blocks)
    assert all(b.checksum == page_checksum(b.data) and b.num_tokens == TPB for b in blocks)
    result = dst.import_blocks(blocks, priority=60)
    dst.check_invariants()
    assert result.imported == tuple(b.key for b in blocks) and result.already_present == ()
    events = dst.drain_events()
    assert [(e.key, e.parent_key, e.tier, e.request_id) for e in events] == [
        (b.key, b.parent_key, TierKind.HOST, None) for b in blocks
    ]
    assert all(isinstance(e, BlockStored) for e in events)
    assert dst.stats().imported_blocks == 3 and src.stats().exported_blocks == 3
    assert [dst.tree.get(b.key).page.priority for b in blocks] == [60] * 3
    assert dst.probe(tokens).tiers == (TierKind.HOST,) * 3
    cache = dst.create(tokens)
    assert cache.num_reused_tokens == 12
    assert cache.resume()
    oracle.verify_cache(cache)
    cache.extend(tokens[12:])
    oracle.fill_cache(cache, 3)
    cache.commit()
    cache.close()
    assert oracle.verify_manager(dst) == 3
    dst.check_invariants()


def test_import_in_a_scope_matches_only_that_scope(make_manager, oracle, run_request):
    src, dst = make_manager(4), make_manager(4)
    scope = ReuseScope(lora_id=3, salt=2**64 - 1)
    tokens = toks(1, 8)
    blocks = exported_chain(src, run_request, tokens, scope=scope)
    assert blocks[0].parent_key == scope.root_key()
    dst.import_blocks(blocks)
    with dst.create(tokens) as unscoped:
        assert unscoped.num_reused_tokens == 0
    with dst.create(tokens, scope=scope) as cache:
        assert cache.num_reused_tokens == 8 and cache.resume()
        oracle.verify_cache(cache)
    dst.check_invariants()


def test_already_present_blocks_are_reported_and_skipped(make_manager, oracle, run_request, state_of):
    src, dst = make_manager(8), make_manager(8)
    blocks = exported_chain(src, run_request, toks(1, 12))
    assert dst.import_blocks(blocks[:2]).imported == (blocks[0].key, blocks[1].key)
    dst.drain_events()
    result = dst.import_blocks(blocks)
    assert result.imported == (blocks[2].key,)
    assert result.already_present == (blocks[0].key, blocks[1].key)
    assert [e.key for e in dst.drain_events()] == [blocks[2].key]
    before = state_of(dst)
    again = dst.import_blocks(blocks)
    assert again.imported == () and again.already_present == tuple(b.key for b in blocks)
    assert state_of(dst) == before
    assert oracle.verify_manager(dst) == 3


def test_import_chain_out_of_order_is_rejected(make_manager, run_request, state_of):
    src, dst = make_manager(8), make_manager(8)
    blocks = exported_chain(src, run_request, toks(1, 12))
    before = state_of(dst)
    with pytest.raises(ImportRejectedError, match="parent"):
        dst.import_blocks([blocks[1], blocks[0], blocks[2]])
    assert state_of(dst) == before
    dst.import_blocks(blocks)  # in order, each parent earlier in the same batch: fine
    assert dst.probe(toks(1, 12)).num_blocks == 3
    dst.check_invariants()


def test_import_onto_a_parent_already_cached(make_manager, oracle, run_request):
    src, dst = make_manager(8), make_manager(2)
    tokens = toks(1, 8)
    blocks = exported_chain(src, run_request, tokens)
    dst.import_blocks(blocks[:1])
    run_request(dst, toks(2, 4))  # dst is full now; blocks[0] is its least recently used page
    dst.import_blocks(blocks[1:])  # the needed parent is never the one evicted to make room
    assert dst.probe(tokens).num_blocks == 2 and dst.probe(toks(2, 4)).num_blocks == 0
    assert oracle.verify_manager(dst) == 2
    dst.check_invariants()


# ---- rejected batches change nothing -------------------------------------------------------------


def corrupt(block: ExportedBlock) -> ExportedBlock:
    data = bytearray(block.data)
    data[len(data) // 2] ^= 0x01
    return dataclasses.replace(block, data=bytes(data))


def test_missing_parent_rejected(make_manager, run_request, state_of):
    src, dst = make_manager(8), make_manager(8)
    blocks = exported_chain(src, run_request, toks(1, 12))
    before = state_of(dst)
    with pytest.raises(ImportRejectedError, match="parent") as err:
        dst.import_blocks(blocks[1:])
    assert err.value.index == 0 and not isinstance(err.value, IntegrityError)
    assert state_of(dst) == before and dst.committed_blocks() == []


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_corrupted_byte_rejected_with_nothing_imported(make_manager, run_request, state_of, bad_index):
    src, dst = make_manager(8), make_manager(8)
    run_request(dst, toks(9, 8))  # dst is not empty: nothing of it may change either
    blocks = exported_chain(src, run_request, toks(1, 12))
    blocks[bad_index] = corrupt(blocks[bad_index])
    before = state_of(dst)
    with pytest.raises(IntegrityError) as err:
        dst.import_blocks(blocks)
    assert err.value.index == bad_index and isinstance(err.value, ImportRejectedError)
    assert state_of(dst) == before
    assert dst.probe(toks(1, 12)).num_blocks == 0


def _wrong_size(b):
    return with_data(b, b.data[:-1])


def _too_big(b):
    return with_data(b, b.data + b"\x00")


def _partial_block(b):
    return dataclasses.replace(b, num_tokens=TPB - 1)


def _too_many_tokens(b):
    return dataclasses.replace(b, num_tokens=TPB + 1)


def _short_key(b):
    return dataclasses.replace(b, key=b.key[:31])


def _long_parent_key(b):
    return dataclasses.replace(b, parent_key=b.parent_key + b"\x00")


def _str_key(b):
    return dataclasses.replace(b, key=b.key.hex())


def _not_a_record(b):
    return dataclasses.asdict(b)


def _data_not_bytes(b):
    return dataclasses.replace(b, data=list(b.data))


SPOILERS = [
    _wrong_size,
    _too_big,
    _partial_block,
    _too_many_tokens,
    _short_key,
    _long_parent_key,
    _str_key,
    _not_a_record,
    _data_not_bytes,
]


@pytest.mark.parametrize("spoil", SPOILERS, ids=lambda f: f.__name__.strip("_"))
def test_malformed_record_rejects_whole_batch(make_manager, run_request, state_of, spoil):
    src, dst = make_manager(8), make_manager(8)
    blocks = exported_chain(src, run_request, toks(1, 12))
    batch = [*blocks[:2], spoil(blocks[2])]  # the first two alone would import fine
    before = state_of(dst)
    with pytest.raises(ImportRejectedError) as err:
        dst.import_blocks(batch)
    assert err.value.index == 2
    assert state_of(dst) == before and dst.committed_blocks() == []


def test_duplicate_key_in_batch_rejected(make_manager, run_request, state_of):
    src, dst = make_manager(8), make_manager(8)
    blocks = exported_chain(src, run_request, toks(1, 12))
    before = state_of(dst)
    with pytest.raises(ImportRejectedError, match="duplicate"):
        dst.import_blocks([blocks[0], blocks[1], blocks[0]])
    assert state_of(dst) == before


def test_import_into_pinned_full_top_tier_is_out_of_pages(make_manager, oracle, run_request, state_of):
    src, dst = make_manager(8), make_manager(2, 4)
    blocks = exported_chain(src, run_request, toks(1, 8))
    active = dst.create(toks(2, 8))
    assert active.resume()
    active.extend(toks(2, 8))  # both host pages pinned
    oracle.fill_cache(active)
    before = state_of(dst)
    with pytest.raises(OutOfPagesError):
        dst.import_blocks(blocks)
    assert state_of(dst) == before
    oracle.verify_cache(active)
    active.suspend()
    assert dst.import_blocks(blocks).imported == tuple(b.key for b in blocks)
    assert [p.level for p in active.pages()] == [1, 1]
    assert active.resume()
    oracle.verify_cache(active)
    active.close()
    assert oracle.verify_manager(dst) == 2


def test_import_never_evicts_the_parent_it_needs(make_manager, run_request, state_of):
    src, dst = make_manager(8), make_manager(1)
    blocks = exported_chain(src, run_request, toks(1, 8))
    dst.import_blocks(blocks[:1])
    before = state_of(dst)
    with pytest.raises(OutOfPagesError):
        dst.import_blocks(blocks[1:])  # the only evictable page is the parent itself
    assert state_of(dst) == before


# ---- export --------------------------------------------------------------------------------------


def test_export_skips_unknown_keys_and_keeps_order(make_manager, oracle, run_request, state_of):
    mgr = make_manager(8)
    keys = block_keys(toks(1, 12), TPB)
    run_request(mgr, toks(1, 12))
    base = mgr.stats()
    before = state_of(mgr)
    out = mgr.export_blocks([bytes(32), keys[2], b"\xff" * 32, keys[0]])
    assert [b.key for b in out] == [keys[2], keys[0]]
    assert all(oracle.check(b.data, b.key) for b in out)
    assert mgr.export_blocks([]) == []
    assert (mgr.stats() - base).exported_blocks == 2
    after = state_of(mgr)
    assert {k: v for k, v in after.items() if k != "stats"} == {
        k: v for k, v in before.items() if k != "stats"
    }  # pages stay where they are, no LRU touch, no events


def test_export_from_disk_tier(make_manager, oracle, run_request):
    src, dst = make_manager(2, 4), make_manager(4)
    tokens = toks(1, 8)
    run_request(src, tokens)
    run_request(src, toks(2, 8))  # pushes the first chain to disk
    assert src.probe(tokens).tiers == (TierKind.DISK, TierKind.DISK)
    blocks = src.export_blocks(block_keys(tokens, TPB))
    assert src.probe(tokens).tiers == (TierKind.DISK, TierKind.DISK)  # export does not promote
    assert all(oracle.check(b.data, b.key) for b in blocks)
    dst.import_blocks(blocks)
    with dst.create(tokens) as cache:
        assert cache.num_reused_tokens == 8 and cache.resume()
        oracle.verify_cache(cache)
    src.check_invariants()
    dst.check_invariants()


@pytest.mark.parametrize("key", [b"", b"\x00" * 31, b"\x00" * 33, "0" * 32, 123, None])
def test_export_malformed_key_raises_value_error(make_manager, run_request, key):
    mgr = make_manager(4)
    run_request(mgr, toks(1, 4))
    with pytest.raises(ValueError):
        mgr.export_blocks([block_keys(toks(1, 4), TPB)[0], key])
    assert mgr.stats().exported_blocks == 0
    mgr.check_invariants()

"""Engine inboxes (raykv.transfer.inbox) and the connector's worker-side stores through them.

Content, not calls: engine blocks hold the content oracle's bytes for their keys; after a store
(worker side writes inbox slots, the owner commits) the owner's pages hold exactly those bytes
under keys the owner derived itself. Bad commits leave the owner unchanged and free their slots.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from raykv import CacheConfig, CacheManager, KVLayout, ReuseScope, TierConfig, block_keys
from raykv.core.errors import InvalidArgumentError
from raykv.integrations.vllm.plan import EngineLink, RaykvMetadata, StoreOp
from raykv.integrations.vllm.worker import WorkerSide
from raykv.testing import ContentOracle
from raykv.transfer import PeerAddress
from raykv.transfer.inbox import FREE, HELD, InboxCommit, Inboxes, InboxWriter
from tests.deps import require

TPB = 4
LAYOUT = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB, dtype="float32")
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(100, 100 + 8 * TPB))
SCOPE = ReuseScope(None, 7, b"m" * 32)
Owner = tuple[CacheManager, Inboxes]


@pytest.fixture
def owner() -> Iterator[Owner]:
    manager = CacheManager(CacheConfig(LAYOUT, (TierConfig.host(64 * LAYOUT.page_bytes),)))
    inboxes = Inboxes(manager)
    yield manager, inboxes
    inboxes.close()
    manager.shutdown()


def _writer(inboxes: Inboxes, slots: int = 8) -> InboxWriter:
    (lease,) = inboxes.open("engine-a", 1, slots * LAYOUT.page_bytes)
    return InboxWriter(lease)


def _write(writer: InboxWriter, keys: list[bytes]) -> list[int]:
    slots = writer.reserve(len(keys))
    assert slots is not None
    oracle = ContentOracle(LAYOUT)
    for slot, key in zip(slots, keys):
        writer.rows[slot][:] = oracle.expected(key)
    return slots


def _held_content(manager: CacheManager, keys: list[bytes]) -> int:
    """How many leading ``keys`` the manager holds with the oracle's bytes."""
    manager.check_invariants()
    oracle = ContentOracle(LAYOUT)
    blocks = manager.export_blocks(keys)
    good = 0
    for key, block in zip(keys, blocks):
        if block.key != key or not oracle.check(np.frombuffer(block.data, np.uint8), key):
            break
        good += 1
    return good


def test_commits_are_keyed_by_the_owner_and_hold_the_written_bytes(owner: Owner) -> None:
    manager, inboxes = owner
    writer = _writer(inboxes)
    keys = [bytes(k) for k in block_keys(PROMPT, TPB, SCOPE)]
    slots = _write(writer, keys[:3])
    commit = InboxCommit(writer.lease.lease_id, tuple(slots), tuple(PROMPT[: 3 * TPB]), SCOPE, 0)
    result = inboxes.commit([commit])
    assert (result.stored, result.present, result.refused) == (3, 0, 0)
    assert _held_content(manager, keys) == 3
    assert writer.free_slots() == 8  # freed by the owner
    more = _write(writer, keys[3:5])  # the next blocks, chained from block 2's key
    commit = InboxCommit(writer.lease.lease_id, tuple(more), tuple(PROMPT[: 5 * TPB]), SCOPE, 3, keys[2])
    assert inboxes.commit([commit]).stored == 2
    assert _held_content(manager, keys) == 5
    again = _write(writer, keys[3:5])  # offered twice: held already
    commit = InboxCommit(writer.lease.lease_id, tuple(again), tuple(PROMPT[: 5 * TPB]), SCOPE, 3, keys[2])
    assert inboxes.commit([commit]).present == 2 and writer.free_slots() == 8


def test_bad_commits_change_nothing_and_free_their_slots(owner: Owner) -> None:
    manager, inboxes = owner
    writer = _writer(inboxes)
    keys = [bytes(k) for k in block_keys(PROMPT, TPB, SCOPE)]
    lease = writer.lease.lease_id
    slots = tuple(_write(writer, keys[2:4]))
    bad = [
        InboxCommit(lease, slots, tuple(PROMPT[: 4 * TPB]), SCOPE, 2, keys[1]),  # parent not held
        InboxCommit(lease, slots, tuple(PROMPT[: 4 * TPB]), SCOPE, 2),  # no parent key
        InboxCommit(lease, slots, tuple(PROMPT[:TPB]), SCOPE, 0),  # too few tokens
        InboxCommit(lease, (slots[0], slots[0]), tuple(PROMPT[: 2 * TPB]), SCOPE, 0),  # a slot twice
        InboxCommit(lease, (99,), tuple(PROMPT[:TPB]), SCOPE, 0),  # not a slot of the inbox
        InboxCommit(lease + 1, slots, tuple(PROMPT[: 2 * TPB]), SCOPE, 0),  # unknown lease
    ]
    for commit in bad:
        named = set(commit.slots) & set(slots) if commit.lease_id == lease else set()
        for slot in named:  # each bad commit of this inbox finds its slots written and held
            writer.states[slot] = HELD
        result = inboxes.commit([commit])
        assert result.stored == 0 and result.refused == len(commit.slots) and len(result.reasons) == 1
        assert len(manager.tree) == 0
        manager.check_invariants()
    assert writer.free_slots() == 8  # the owner freed every slot of its inbox a commit named
    unreserved = InboxCommit(lease, (0,), tuple(PROMPT[:TPB]), SCOPE, 0)  # FREE, never written
    assert inboxes.commit([unreserved]).refused == 1 and len(manager.tree) == 0


def test_a_full_inbox_refuses_a_reservation_and_runs_are_preferred(owner: Owner) -> None:
    _, inboxes = owner
    writer = _writer(inboxes, slots=4)
    assert writer.reserve(3) == [0, 1, 2]
    assert writer.reserve(2) is None  # one free slot: backpressure, nothing changes
    assert writer.free_slots() == 1
    writer.cancel([1])
    assert writer.reserve(2) == [3, 1]  # no run of two is free: any two
    assert list(writer.states) == [HELD] * 4 and FREE not in writer.states


def test_opening_validates_and_replaces_an_engines_inboxes(owner: Owner) -> None:
    _, inboxes = owner
    for engine, ranks, nbytes in (("", 1, 1 << 20), ("e", 0, 1 << 20), ("e", 1, 10), ("e", 1, 1 << 40)):
        with pytest.raises(InvalidArgumentError):
            inboxes.open(engine, ranks, nbytes)
    first = inboxes.open("e", 2, 4 * LAYOUT.page_bytes)
    assert [lease.rank for lease in first] == [0, 1] and all(lease.slots == 4 for lease in first)
    second = inboxes.open("e", 1, 2 * LAYOUT.page_bytes)
    assert inboxes.engines() == {"e": {"inboxes": 1, "slots": 2, "held": 0}}
    old = InboxCommit(first[0].lease_id, (0,), tuple(PROMPT[:TPB]), SCOPE, 0)
    assert "unknown inbox lease" in inboxes.commit([old]).reasons[0]
    inboxes.close_engine("e")
    assert inboxes.engines() == {} and second[0].lease_id != first[0].lease_id


def _engine(inboxes: Inboxes, slots: int) -> tuple[WorkerSide, EngineLink, list[bytes]]:
    """A worker side on CPU KV tensors whose blocks 0..7 hold the oracle's bytes of the prompt's
    blocks 0..7, with an inbox of ``slots`` slots."""
    require("torch")
    from raykv.integrations.vllm.testing import vllm_kv_caches

    side = WorkerSide(LAYOUT, NAMES)
    side.register(vllm_kv_caches(NAMES, 16, 2, TPB, 8, "float32", "cpu"), "flash_attn")
    keys = [bytes(k) for k in block_keys(PROMPT, TPB, SCOPE)]
    assert side.copier is not None
    oracle = ContentOracle(LAYOUT)
    side.copier.load(np.stack([oracle.expected(k) for k in keys]), list(range(8)))
    leases = inboxes.open("engine-a", 1, slots * LAYOUT.page_bytes)
    link = EngineLink("w0", PeerAddress("127.0.0.1", 1), "node", b"t" * 32, leases)
    return side, link, keys


def _store(side: WorkerSide, link: EngineLink, first: int, end: int, req: str = "r1") -> RaykvMetadata:
    op = StoreOp(req, tuple(PROMPT[: end * TPB]), SCOPE, tuple(range(end)), first)
    return RaykvMetadata(link=link, stores=[op])


def test_worker_side_stores_engine_blocks_through_the_inbox(owner: Owner) -> None:
    manager, inboxes = owner
    side, link, keys = _engine(inboxes, 8)
    try:
        for first, end in ((0, 3), (3, 6)):  # the second store chains from the first's last key
            side.save(_store(side, link, first, end))
            report = side.take_report()
            assert report is not None and report.per_request["r1"]["staged_blocks"] == end - first
            assert inboxes.commit(report.commits).stored == end - first
            assert _held_content(manager, keys) == end
        side.save(_store(side, link, 6, 8, req="r2"))  # a request the worker side never saw: hashed
        report = side.take_report()
        assert report is not None and inboxes.commit(report.commits).stored == 2
        assert _held_content(manager, keys) == 8
    finally:
        side.close()


def test_worker_side_backpressure_is_counted_and_reported_unstored(owner: Owner) -> None:
    """A store of more blocks than the inbox has free writes the leading ones that fit and
    reports the rest unstored; once the owner committed those (slots free again), the rest,
    offered again, goes through: nothing is lost, every block ends up with the right bytes."""
    manager, inboxes = owner
    side, link, keys = _engine(inboxes, 2)
    try:
        side.save(_store(side, link, 0, 5))
        report = side.take_report()
        assert report is not None and report.unstored == {"r1": 2}
        assert report.per_request["r1"]["store_backpressure_blocks"] == 3
        assert report.per_request["r1"]["staged_blocks"] == 2
        side.save(_store(side, link, 2, 5))  # no slot free until the owner commits
        blocked = side.take_report()
        assert blocked is not None and blocked.unstored == {"r1": 2} and not blocked.commits
        assert inboxes.commit(report.commits).stored == 2
        first = 2
        while first < 5:  # what the scheduler side does: offer again from the first unstored
            side.save(_store(side, link, first, 5))
            report = side.take_report()
            assert report is not None and inboxes.commit(report.commits).stored > 0
            first = report.unstored.get("r1", 5)
        assert _held_content(manager, keys) == 5
    finally:
        side.close()

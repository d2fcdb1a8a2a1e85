"""The gpu_peer path's negotiation on machines without a GPU tier (the copy itself: tests/gpu).

A server without an exportable GPU tier does not offer the path; a client asks for it only when
offered; ``pull_pages`` then takes shm/ucx. A peer that asks anyway is refused with "unavailable"
and holds no lease. Content is checked with the oracle; invariants hold on both managers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deps import require
from transfer_support import Pair, commit, host_pair, run, seq

from raykv import ContentOracle, KVLayout, TransferError
from raykv.transfer import TransferConfig, pull_gpu_peer_into
from raykv.transfer.net import wire
from raykv.transfer.pages.shm import ShmMapping
from raykv.transfer.paths.gpu_land import leading_run
from raykv.transfer.paths.importer import PullOutcome, merge_outcomes
from raykv.transfer.paths.peer_pools import PoolInfo
from raykv.transfer.planner import pull_pages

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)


@pytest.fixture
def pair(layout: KVLayout) -> Iterator[Pair]:
    made = host_pair(layout, CFG, dst_pages=32)
    yield made
    made.close()


def test_host_only_server_does_not_offer_the_path(pair: Pair) -> None:
    assert not pair.server.gpu_peer.available

    async def welcome() -> bool:
        conn = await pair.client.checkout(pair.server.address.endpoint)  # type: ignore[union-attr]
        pair.client.checkin(conn.peer, conn)
        return conn.gpu

    assert run(welcome()) is False


def test_gpu_peer_pull_without_a_gpu_is_unavailable_and_changes_nothing(
    pair: Pair, oracle: ContentOracle
) -> None:
    keys = commit(pair.src, oracle, seq(1, 4))
    with pytest.raises(TransferError) as info:
        run(pull_gpu_peer_into(pair.client, pair.server.address, pair.dst, keys))  # type: ignore[arg-type]
    assert info.value.reason == "unavailable"
    assert not pair.dst.committed_blocks() and pair.server.stats.pulls == {}
    assert pair.client.stats.failures["unavailable"] == 1
    pair.settled()


def test_pull_pages_falls_back_to_shared_memory(pair: Pair, oracle: ContentOracle) -> None:
    keys = commit(pair.src, oracle, seq(2, 6))
    outcome = pull_pages(pair.client, pair.address, pair.dst, keys)
    assert isinstance(outcome, PullOutcome)
    assert outcome.path == "shm" and outcome.complete and list(outcome.imported) == keys
    for key in keys:
        block = pair.dst.tree.get(key)  # type: ignore[arg-type]
        assert block is not None
        assert oracle.check(pair.dst.pools[0].array[block.page.slot], key)  # type: ignore[attr-defined]
    pair.settled()


def test_server_refuses_a_gpu_peer_request_it_cannot_serve(pair: Pair, oracle: ContentOracle) -> None:
    keys = commit(pair.src, oracle, seq(3, 3))

    async def ask() -> None:
        conn = await pair.client.checkout(pair.server.address.endpoint)  # type: ignore[union-attr]
        try:
            await conn.send({"t": "pull", "id": 1, "keys": keys, "path": "gpu_peer", "tag": 0})
            wire.expect_type(await wire.read_message(conn.reader, 1 << 20), "gpu_pool")
        finally:
            conn.close()

    with pytest.raises(TransferError) as info:
        run(ask())
    assert info.value.reason == "unavailable"
    assert pair.server.stats.errors["unavailable"] == 1
    pair.settled()


@pytest.mark.parametrize(
    "msg",
    [
        {"t": "gpu_pool", "id": 2, "path": "/x", "uuid": "u", "slots": 4},  # another request
        {"t": "gpu_pool", "id": 1, "path": "", "uuid": "u", "slots": 4},
        {"t": "gpu_pool", "id": 1, "path": "/x", "uuid": "u", "slots": 0},
        {"t": "gpu_pool", "id": 1, "path": "/x", "uuid": 7, "slots": 4},
        {"t": "header", "id": 1},
    ],
)
def test_malformed_pool_messages_are_protocol_errors(msg: dict[str, object]) -> None:
    with pytest.raises(TransferError) as info:
        PoolInfo.from_msg(msg, 1)
    assert info.value.reason == "protocol"
    assert PoolInfo.from_msg({"t": "gpu_pool", "id": 1, "path": "/x", "uuid": "u", "slots": 4}, 1).slots == 4


def test_merged_outcomes_concatenate_in_pull_order() -> None:
    k = [bytes([i]) * 32 for i in range(5)]
    a = PullOutcome((k[0],), (k[1],), (k[2],), (), "gpu_peer", 10, 0.5)
    b = PullOutcome((k[2],), (), (k[3],), (k[4],), "ucx", 5, 0.25)
    m = merge_outcomes([a, b], "gpu_peer+ucx")
    assert m.imported == (k[0], k[2]) and m.already_present == (k[1],)
    assert m.missing == (k[2], k[3]) and m.dropped == (k[4],) and m.nbytes == 15 and m.seconds == 0.75
    assert merge_outcomes([a], "x") is a


def test_land_gpu_from_a_host_only_owner_lands_nothing_and_asks_nothing(
    pair: Pair, oracle: ContentOracle
) -> None:
    """An engine's GPU landing (``PageClient.land_gpu``) needs the owner's GPU tier: a host-only
    owner is not asked (no request, no lease) and ``land`` is never called."""
    keys = commit(pair.src, oracle, seq(4, 3))
    calls: list[object] = []
    landed = pair.client.land_gpu(pair.server.address, keys, 0, lambda *args: calls.append(args))
    assert landed.landed == 0 and landed.path is None and not calls
    assert pair.server.stats.pulls == {} and not pair.client.gpu_pools.known
    assert pair.server.address.endpoint in pair.client.gpu_pools.refused  # not asked again
    again = pair.client.land_gpu(pair.server.address, keys, 0, lambda *args: calls.append(args))
    assert again.landed == 0 and not calls
    assert pair.client.land_gpu(pair.server.address, [], 0, lambda *args: calls.append(args)).landed == 0
    with pytest.raises(ValueError):
        pair.client.land_gpu(pair.server.address, [b"short"], 0, lambda *args: calls.append(args))
    pair.settled()


def test_leading_run_counts_the_answered_prefix() -> None:
    k = [bytes([i]) * 32 for i in range(4)]
    assert leading_run(k, k) == 4
    assert leading_run(k, k[:2]) == 2
    assert leading_run(k, [k[0], k[2], k[3]]) == 1  # k[1] not on the GPU tier: the run ends
    assert leading_run(k, []) == 0 and leading_run([], k) == 0


def test_pinning_a_mapping_without_cuda_changes_nothing(pair: Pair, oracle: ContentOracle) -> None:
    """Without a CUDA driver ``pin_for_cuda`` leaves the one-sided reads as they were."""
    keys = commit(pair.src, oracle, seq(5, 2))
    pair.client.pin_for_cuda()
    pulled = pair.client.pull_sync(pair.server.address, keys)  # maps the owner's tier
    again = pair.client.pull_sync(pair.server.address, keys)
    assert again.path == "shm_read" and all(oracle.check(row, k) for row, k in zip(again.data, keys))
    assert pulled.keys == again.keys
    pool = pair.src.pools[0]
    mapping = ShmMapping(pool.shm_path, pool.num_slots, pool.page_bytes)  # type: ignore[attr-defined]
    try:
        assert mapping.pin_for_cuda() is cuda_usable() and mapping.pinned is cuda_usable()
        assert oracle.check(mapping.array[pair.src.tree.get(keys[0]).page.slot], keys[0])  # type: ignore[union-attr]
    finally:
        mapping.close()
    assert not mapping.pinned
    pair.settled()


def cuda_usable() -> bool:
    torch = require("torch")
    return bool(torch.cuda.is_available())

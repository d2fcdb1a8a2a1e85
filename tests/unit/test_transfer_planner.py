"""The one path planner: which paths a move takes (``plan_paths``) and the pull that follows it
(``pull_pages``), checked against the content oracle on a real page server and client."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
from transfer_support import Pair, commit, host_pair, seq

from raykv import ContentOracle, KVLayout
from raykv.core.tiers import shm_directory
from raykv.transfer import TransferConfig
from raykv.transfer.planner import Endpoints, plan_paths, pull_pages

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)


@pytest.mark.parametrize(
    ("ends", "config", "plan"),
    [
        (Endpoints(on_gpu=False), CFG, ("shm_read", "shm")),
        (Endpoints(on_gpu=True), CFG, ("gpu_read", "shm_read", "gpu_peer", "shm")),
        (Endpoints(on_gpu=True, verify=True), CFG, ("gpu_peer", "shm")),
        (Endpoints(on_gpu=True, prefer_shm=False), CFG, ("gpu_peer", "ucx")),
        (Endpoints(on_gpu=False, prefer_shm=False), CFG, ("ucx",)),
        (Endpoints(on_gpu=True), dataclasses.replace(CFG, use_gpu_peer=False), ("shm_read", "shm")),
        (Endpoints(on_gpu=True), dataclasses.replace(CFG, use_shm_read=False), ("gpu_peer", "shm")),
        (Endpoints(on_gpu=False), dataclasses.replace(CFG, use_shm=False), ("ucx",)),
    ],
)
def test_plan_for_each_receiver_and_switch(
    ends: Endpoints, config: TransferConfig, plan: tuple[str, ...]
) -> None:
    assert plan_paths(ends, config) == plan


def test_every_plan_ends_on_a_request_path_and_honours_every_switch() -> None:
    flags = (False, True)
    for on_gpu, prefer, verify, shm, shm_read, gpu_peer in itertools.product(
        flags, flags, (None, False, True), *[flags] * 3
    ):
        config = dataclasses.replace(CFG, use_shm=shm, use_shm_read=shm_read, use_gpu_peer=gpu_peer)
        plan = plan_paths(Endpoints(on_gpu, prefer, verify), config)
        assert plan[-1] in ("shm", "ucx") and len(set(plan)) == len(plan)
        assert all(step not in ("shm", "ucx") for step in plan[:-1])
        if verify is True or not prefer or not shm or not shm_read:
            assert not {"gpu_read", "shm_read"} & set(plan)
        if not (on_gpu and gpu_peer):
            assert not {"gpu_read", "gpu_peer"} & set(plan)
        if not (prefer and shm):
            assert "shm" not in plan


def _requests(pair: Pair) -> int:
    """How many requests the client has sent (its one-sided reads are none)."""
    return sum(n for path, n in pair.client.stats.pulls.items() if path not in ("shm_read", "gpu_read"))


@pytest.fixture
def pair(layout: KVLayout) -> Iterator[Pair]:
    made = host_pair(layout, CFG, src_pages=16, dst_pages=32)
    yield made
    made.close()


@pytest.mark.skipif(not shm_directory.supported(), reason="one-sided reads need x86-64")
def test_pull_pages_asks_first_then_reads_one_sided(pair: Pair, oracle: ContentOracle) -> None:
    first, second = commit(pair.src, oracle, seq(1, 4)), commit(pair.src, oracle, seq(2, 3))
    outcome = pull_pages(pair.client, pair.address, pair.dst, first)
    assert outcome.path == "shm" and outcome.imported == tuple(first)  # not mapped yet: one request
    pair.settled()
    asked = _requests(pair)
    outcome = pull_pages(pair.client, pair.address, pair.dst, second)
    assert outcome.path == "shm_read" and outcome.imported == tuple(second)
    assert _requests(pair) == asked  # the owner was not asked
    assert oracle.verify_manager(pair.dst) == 7
    pair.settled()


def test_pull_pages_without_shared_memory_or_with_checks(pair: Pair, oracle: ContentOracle) -> None:
    keys = commit(pair.src, oracle, seq(3, 5))
    outcome = pull_pages(pair.client, pair.address, pair.dst, keys[:2], prefer_shm=False)
    assert outcome.path == "ucx" and outcome.imported == tuple(keys[:2])
    outcome = pull_pages(pair.client, pair.address, pair.dst, keys, verify=True)  # no one-sided read
    assert outcome.path == "shm" and outcome.imported == tuple(keys[2:])
    assert outcome.already_present == tuple(keys[:2])
    assert oracle.verify_manager(pair.dst) == 5
    pair.settled()


@pytest.mark.skipif(not shm_directory.supported(), reason="one-sided reads need x86-64")
def test_pull_pages_reports_what_the_owner_lacks_and_imports_the_prefix(
    pair: Pair, oracle: ContentOracle
) -> None:
    keys = commit(pair.src, oracle, seq(4, 4))
    unknown = bytes(32)
    pull_pages(pair.client, pair.address, pair.dst, keys[:1])  # connected and mapped
    asked = _requests(pair)
    outcome = pull_pages(pair.client, pair.address, pair.dst, [*keys[1:], unknown])
    # read one-sided up to the key the directory lacks, then the owner is asked for that key
    # (it could be on the owner's disk tier) and reports it missing
    assert outcome.path == "shm_read+shm" and outcome.imported == tuple(keys[1:])
    assert outcome.missing == (unknown,) and _requests(pair) == asked + 1
    assert oracle.verify_manager(pair.dst) == 4
    pair.settled()

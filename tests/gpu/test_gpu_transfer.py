"""Page pulls GPU to GPU between two processes over UCX (cuda_ipc / NVLink on one host).

A server process (:class:`raykv.bench.gpu_transfer.ServerProcess`) owns a CacheManager whose top
tier is a GPU tier on cuda:0 (plus a host tier), commits blocks written by the device oracle and
serves them on 127.0.0.1 with a token, twice: sending GPU pages in place, and ``staged`` (gathered
into a plain device allocation first). This process pulls them into a GPU tier on cuda:1 and checks
every byte with the oracle. Skipped without 2 CUDA devices, or without ucxx (a failure instead
under RAYKV_REQUIRE_DEPS=1: tests/deps.py).
Bandwidth: ``python -m raykv.bench.gpu_transfer``.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from deps import require, require_cuda

torch = require_cuda(2)
require("ucxx")

from raykv import ContentOracle, TransferError  # noqa: E402
from raykv.bench.gpu_transfer import Scenario, ServerProcess, _transports, gpu_manager  # noqa: E402
from raykv.core.manager import CacheManager  # noqa: E402
from raykv.core.types import BlockKey  # noqa: E402
from raykv.gpu_oracle import DeviceOracle  # noqa: E402
from raykv.transfer import (  # noqa: E402
    PageClient,
    PeerAddress,
    TransferConfig,
    get_runtime,
    pull_gpu_peer_into,
    pull_into,
)
from raykv.transfer.paths.direct import pull_direct_into  # noqa: E402
from raykv.transfer.planner import pull_pages  # noqa: E402

SCENARIO = Scenario("64x512KiB", 512, 64)
CFG = TransferConfig(host="127.0.0.1", timeout_s=30.0, connect_timeout_s=10.0)


class Remote:
    def __init__(self) -> None:
        self.token = secrets.token_bytes(32)
        self.server = ServerProcess(self.token, [SCENARIO], device=0)
        entry = self.server.ready["servers"][SCENARIO.name]
        self.keys = [bytes.fromhex(k) for k in entry["keys"]]
        self.peers = {v: PeerAddress("127.0.0.1", entry[v]) for v in ("in_place", "staged")}
        self.mgr: CacheManager = gpu_manager(SCENARIO.page_kib, SCENARIO.pages, device=1)
        self.client = PageClient(self.token, CFG)

    def stats(self, variant: str) -> dict[str, Any]:
        return self.server.stats()[f"{SCENARIO.name}/{variant}"]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.close()
        self.mgr.shutdown()
        self.server.close()


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    made = Remote()
    yield made
    made.close()


def _verify(mgr: CacheManager, keys: list[bytes]) -> None:
    """Every byte of every imported page is the oracle's, and the pages are on the GPU tier."""
    blocks = [mgr.tree.get(BlockKey(k)) for k in keys]
    assert all(b is not None and b.page.level == 0 for b in blocks)
    slots = [int(b.page.slot) for b in blocks if b is not None]
    pool: Any = mgr.top_pool
    assert pool.device == torch.device("cuda", 1)
    assert all(DeviceOracle(mgr.layout, pool.device).check(pool, slots, keys))
    assert ContentOracle(mgr.layout).check(pool.tensor[slots[-1]], keys[-1])  # one page on the host too
    mgr.check_invariants()


def test_ucx_reports_cuda_transports(remote: Remote) -> None:
    for transports in (remote.server.ready["transports"], _transports()):
        names = {t.split("/", 1)[0] for t in transports}
        print("UCX transports:", ", ".join(transports))
        assert {"cuda_ipc", "cuda_copy"} <= names, transports


@pytest.mark.parametrize("variant", ["in_place", "staged"])
def test_direct_pull_lands_on_the_gpu_tier(remote: Remote, variant: str) -> None:
    remote.mgr.clear_reusable()
    before = remote.stats(variant)["pulls"].get("direct", 0)
    outcome = get_runtime().run(
        pull_direct_into(remote.client, remote.peers[variant], remote.mgr, remote.keys), 60
    )
    assert outcome.path == "direct" and outcome.complete and list(outcome.imported) == remote.keys
    assert outcome.nbytes == len(remote.keys) * remote.mgr.layout.page_bytes
    _verify(remote.mgr, remote.keys)
    assert remote.client.stats.last_path[str(remote.peers[variant])] == "direct"
    assert remote.stats(variant)["pulls"]["direct"] == before + 1


def test_direct_pull_of_a_scattered_subset(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    keys = remote.keys[:40:3]  # not consecutive on the server: gathered there; only block 0 importable
    outcome = get_runtime().run(
        pull_direct_into(remote.client, remote.peers["in_place"], remote.mgr, keys), 60
    )
    assert list(outcome.imported) == keys[:1] and list(outcome.dropped) == keys[1:]
    _verify(remote.mgr, keys[:1])


def test_ucx_host_path_gpu_to_gpu(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    outcome = get_runtime().run(
        pull_into(remote.client, remote.peers["in_place"], remote.mgr, remote.keys, prefer_shm=False), 60
    )
    assert outcome.path == "ucx" and outcome.complete
    _verify(remote.mgr, remote.keys)
    assert remote.client.stats.last_path[str(remote.peers["in_place"])] == "ucx"
    assert remote.stats("in_place")["pulls"].get("ucx", 0) >= 1


def test_wrong_token_is_refused(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    stranger = PageClient(secrets.token_bytes(32), CFG)
    try:
        with pytest.raises(TransferError) as info:
            get_runtime().run(pull_direct_into(stranger, remote.peers["staged"], remote.mgr, remote.keys), 60)
    finally:
        stranger.close()
    assert info.value.reason == "auth"
    assert remote.stats("staged")["preauth_rejected"] >= 1
    assert not remote.mgr.committed_blocks()


def test_gpu_peer_pull_copies_device_to_device(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    before = remote.stats("staged")["pulls"].get("gpu_peer", 0)
    peer = remote.peers["staged"]
    outcome = get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys), 60)
    assert outcome.path == "gpu_peer" and outcome.complete and list(outcome.imported) == remote.keys
    assert outcome.nbytes == len(remote.keys) * remote.mgr.layout.page_bytes
    _verify(remote.mgr, remote.keys)
    assert remote.client.stats.last_path[str(peer)] == "gpu_peer"
    stats = remote.stats("staged")
    assert stats["pulls"]["gpu_peer"] == before + 1 and "unavailable" not in stats["errors"]
    again = get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys), 60)
    assert not again.imported and list(again.already_present) == remote.keys


def test_gpu_peer_pull_of_a_scattered_subset_and_unknown_keys(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    keys = remote.keys[:40:3]  # only block 0 has its parent here
    unknown = [bytes(32), b"\x01" * 32]
    outcome = get_runtime().run(
        pull_gpu_peer_into(remote.client, remote.peers["staged"], remote.mgr, [*keys, *unknown]), 60
    )
    assert list(outcome.imported) == keys[:1] and list(outcome.dropped) == keys[1:]
    assert list(outcome.missing) == unknown
    _verify(remote.mgr, keys[:1])


def test_pull_pages_prefers_gpu_peer_and_honours_the_switch(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    outcome = pull_pages(remote.client, remote.peers["staged"], remote.mgr, remote.keys)
    assert outcome.path in ("gpu_peer", "gpu_read") and outcome.complete
    _verify(remote.mgr, remote.keys)
    remote.mgr.clear_reusable()
    off = PageClient(remote.token, CFG.replace(use_gpu_peer=False))
    try:
        outcome = pull_pages(off, remote.peers["staged"], remote.mgr, remote.keys)
    finally:
        off.close()
    assert outcome.path == "ucx" and outcome.complete
    _verify(remote.mgr, remote.keys)


def test_gpu_peer_wrong_token_is_refused(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    stranger = PageClient(secrets.token_bytes(32), CFG)
    try:
        with pytest.raises(TransferError) as info:
            get_runtime().run(
                pull_gpu_peer_into(stranger, remote.peers["staged"], remote.mgr, remote.keys), 60
            )
    finally:
        stranger.close()
    assert info.value.reason == "auth" and not remote.mgr.committed_blocks()


def test_gpu_peer_owner_gone_after_the_header_imports_nothing(remote: Remote) -> None:
    remote.mgr.clear_reusable()
    name = f"{SCENARIO.name}/staged"
    fresh = PageClient(remote.token, CFG)  # knows no directory yet: it must ask the owner
    remote.server.set_fault(name, "drop_after_header", True)
    try:
        with pytest.raises(TransferError) as info:
            get_runtime().run(pull_gpu_peer_into(fresh, remote.peers["staged"], remote.mgr, remote.keys), 60)
    finally:
        remote.server.set_fault(name, "drop_after_header", False)
        fresh.close()
    assert info.value.reason in ("closed", "protocol", "fault")
    assert not remote.mgr.committed_blocks() and not remote.mgr.store.leases
    remote.mgr.check_invariants()
    outcome = get_runtime().run(
        pull_gpu_peer_into(remote.client, remote.peers["staged"], remote.mgr, remote.keys), 60
    )
    assert outcome.complete  # the owner ended that lease; the next pull works
    _verify(remote.mgr, remote.keys)


def test_gpu_read_needs_no_request_after_the_first(remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """After one gpu_peer request the owner's slot directory is mapped: later pulls of bound keys
    copy one-sided (path "gpu_read"), the owner serves nothing, every byte matches; a page that
    changes during the copy (simulated) makes the pull ask the owner instead."""
    from raykv.transfer.paths import shm_read

    peer = remote.peers["staged"]
    remote.mgr.clear_reusable()
    get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys[:1]), 60)
    remote.mgr.clear_reusable()
    served = remote.stats("staged")["pulls"].get("gpu_peer", 0)
    outcome = get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys), 60)
    assert outcome.path == "gpu_read" and outcome.complete and list(outcome.imported) == remote.keys
    _verify(remote.mgr, remote.keys)
    assert remote.stats("staged")["pulls"].get("gpu_peer", 0) == served  # the owner was not asked
    assert remote.client.stats.pulls["gpu_read"] >= 1
    remote.mgr.clear_reusable()
    monkeypatch.setattr(shm_read, "unchanged", lambda lookup, located, keys: False)
    outcome = get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys), 60)
    assert outcome.path == "gpu_peer" and outcome.complete  # stale: asked the owner instead
    _verify(remote.mgr, remote.keys)


def test_gpu_read_stale_later_chunk_keeps_the_earlier_ones(
    remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local import runs in chunks whose copies overlap the inserts; when a later chunk's pages
    changed during its copy (simulated), the chunks before it stay imported and the owner is asked
    for the rest: every key arrives, every byte matches, no lease or page is left over."""
    from raykv.transfer.paths import shm_read
    from raykv.transfer.paths.gpu_read import chunk_starts

    peer = remote.peers["staged"]
    remote.mgr.clear_reusable()
    get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys[:1]), 60)
    remote.mgr.clear_reusable()
    real = shm_read.unchanged
    calls: list[int] = []

    def second_chunk_stale(lookup: Any, located: Any, keys: Any) -> bool:
        calls.append(len(keys))
        return len(calls) != 2 and real(lookup, located, keys)

    monkeypatch.setattr(shm_read, "unchanged", second_chunk_stale)
    starts = [*chunk_starts(len(remote.keys)), len(remote.keys)]
    assert len(starts) > 2
    sizes = [b - a for a, b in itertools.pairwise(starts)]
    outcome = get_runtime().run(pull_gpu_peer_into(remote.client, peer, remote.mgr, remote.keys), 60)
    assert outcome.path == "gpu_read+gpu_peer" and outcome.complete
    assert list(outcome.imported) == remote.keys and calls[:2] == sizes[:2]
    assert not remote.mgr.store.leases
    _verify(remote.mgr, remote.keys)


def test_pull_gpu_local_runs_in_the_callers_thread(remote: Remote) -> None:
    """pull_gpu_local: None (nothing imported) before the owner's directory is known; afterwards
    every key imported one-sided with no request, in overlapping chunks, every byte right."""
    from raykv.transfer import pull_gpu_local

    peer = remote.peers["staged"]
    fresh = PageClient(remote.token, CFG)
    try:
        remote.mgr.clear_reusable()
        assert pull_gpu_local(fresh, peer, remote.mgr, remote.keys) is None
        assert not remote.mgr.committed_blocks()
        get_runtime().run(pull_gpu_peer_into(fresh, peer, remote.mgr, remote.keys[:1]), 60)
        remote.mgr.clear_reusable()
        served = remote.stats("staged")["pulls"].get("gpu_peer", 0)
        landed = pull_gpu_local(fresh, peer, remote.mgr, remote.keys)
        assert landed is not None and landed[1] == []
        outcome = landed[0]
        assert outcome.path == "gpu_read" and outcome.complete and list(outcome.imported) == remote.keys
        assert outcome.seconds > 0
        assert remote.stats("staged")["pulls"].get("gpu_peer", 0) == served
        _verify(remote.mgr, remote.keys)
        with pytest.raises(ValueError):
            pull_gpu_local(fresh, peer, remote.mgr, [b"short"])
    finally:
        fresh.close()

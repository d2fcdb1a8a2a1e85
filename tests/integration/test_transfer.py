"""CacheWorker.pull between real worker actors on one Ray node (shared-memory and UCX paths).

Uses the package's ``ray_local`` fixture; the deployment here has a *shared* host tier so that
same-node pulls take the shared-memory path, and page servers bound to 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray_helpers import TPB, get, poll, running, snapshot_view, tokens

from actors.cache.cluster import RayKVCluster
from raykv import CacheConfig, KVLayout, TierConfig, TransferError
from raykv.transfer import AuthToken, PageClient, TransferConfig

XFER = TransferConfig.loopback(timeout_s=30.0, connect_timeout_s=10.0)


def shared_config() -> CacheConfig:
    layout = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB)
    page = layout.page_bytes
    host = TierConfig.host(16 * page, pin_memory=False, shared=True)
    return CacheConfig(layout, (host, TierConfig.disk(32 * page)))


@pytest.fixture(scope="module")
def xfer(ray_local: None) -> Iterator[RayKVCluster]:
    with running("raykv-xfer", num_workers=2, config=shared_config(), transfer=XFER) as dep:
        yield dep


def no_leases(handle: object) -> None:
    poll(lambda: get(handle.transfer_stats.remote())["open_leases"] == 0, timeout=10, what="leases released")  # type: ignore[attr-defined]


def test_decode_worker_pulls_and_reuses(xfer: RayKVCluster) -> None:
    a, b = xfer.worker_ids
    wa, wb = xfer.workers[a], xfer.workers[b]
    prompt = tokens(101, 6)
    assert get(wa.run_request.remote(prompt)).committed_blocks == 6
    keys = xfer.keys(prompt)
    outcome = get(wb.pull.remote(a, keys))
    assert outcome.path == "shm" and len(outcome.imported) == 6 and outcome.complete
    decode = get(wb.run_request.remote([*prompt, 7, 7, 7], decode_tokens=[5, 5]))
    assert decode.reused_tokens == len(prompt)
    assert get(wb.verify_all.remote()) >= 6
    get(wb.check.remote())
    xfer.flush()
    assert xfer.route(prompt)[b].blocks == 6  # the imported blocks reached the index
    no_leases(wa)
    stats = get(wb.transfer_stats.remote())["client"]
    assert stats["pulls"] == {"shm": 1} and stats["last_path"] == {
        str(get(wa.page_server_address.remote())): "shm"
    }


def test_ucx_path_by_address(xfer: RayKVCluster) -> None:
    a, b = xfer.worker_ids
    wa, wb = xfer.workers[a], xfer.workers[b]
    prompt = tokens(102, 4)
    get(wa.run_request.remote(prompt))
    address = get(wa.page_server_address.remote())
    assert address.host == "127.0.0.1"
    outcome = get(wb.pull.remote(address, xfer.keys(prompt), prefer_shm=False))
    assert outcome.path == "ucx" and len(outcome.imported) == 4
    assert get(wb.verify_all.remote()) >= 4
    no_leases(wa)


def test_failed_pull_imports_nothing_and_the_caller_recomputes(xfer: RayKVCluster) -> None:
    a, b = xfer.worker_ids
    wa, wb = xfer.workers[a], xfer.workers[b]
    prompt = tokens(103, 5)
    get(wa.run_request.remote(prompt))
    before = snapshot_view(wb)
    get(wa.set_transfer_faults.remote(corrupt_payload=True))
    try:
        for prefer_shm in (True, False):  # shm carries checksums only when asked to verify
            with pytest.raises(TransferError) as info:
                get(wb.pull.remote(a, xfer.keys(prompt), prefer_shm=prefer_shm, verify=True))
            assert info.value.reason == "integrity"
    finally:
        get(wa.set_transfer_faults.remote(corrupt_payload=False))
    assert snapshot_view(wb) == before
    get(wb.check.remote())
    no_leases(wa)
    recomputed = get(wb.run_request.remote(prompt))  # fall back: compute the prefix locally
    assert recomputed.reused_tokens == 0 and recomputed.committed_blocks == 5
    assert get(wb.verify_all.remote()) >= 5


def test_peer_without_the_token_is_refused(xfer: RayKVCluster) -> None:
    a = xfer.worker_ids[0]
    wa = xfer.workers[a]
    prompt = tokens(104, 2)
    get(wa.run_request.remote(prompt))
    address = get(wa.page_server_address.remote())
    intruder = PageClient(AuthToken.generate(), XFER)
    try:
        with pytest.raises(TransferError) as info:
            intruder.pull_sync(address, xfer.keys(prompt))
    finally:
        intruder.close()
    assert info.value.reason == "auth"
    assert get(wa.transfer_stats.remote())["server"]["preauth_rejected"] >= 1
    token = xfer.spec.token
    assert len(token) == 32 and token.hex() not in repr(xfer.spec) and repr(token) not in repr(xfer.spec)

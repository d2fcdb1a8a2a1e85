"""Disaggregated prefill/decode across two logical Ray nodes: the decode worker pulls exactly the
prefill worker's committed blocks over UCX and continues; every byte is oracle-verified.

Reuses the package's ``cluster`` fixture (logical nodes with ``num_cpus=1``, a 100 MiB object
store and a ``nodeI`` resource each); one worker is pinned to node 1, one to node 2. Page servers
bind 127.0.0.1 and UCX stays on ``lo``. The nodes have different Ray node ids, so the pulls take
the UCX path even though both run on this machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_helpers import TPB, get, poll, running, snapshot_view, tokens

from actors.cache.cluster import RayKVCluster
from actors.testing import disaggregated_request
from raykv import CacheConfig, KVLayout, TierConfig, TransferError
from raykv.transfer import TransferConfig

from .conftest import NODE_RESOURCES

XFER = TransferConfig.loopback(timeout_s=30.0, connect_timeout_s=10.0)


def pd_config() -> CacheConfig:
    layout = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB)
    page = layout.page_bytes
    host = TierConfig.host(32 * page, pin_memory=False, shared=True)
    return CacheConfig(layout, (host, TierConfig.disk(32 * page)))


@pytest.fixture
def pd(cluster: Cluster) -> Iterator[RayKVCluster]:
    with running(
        "raykv-pd", num_workers=2, config=pd_config(), transfer=XFER, worker_resources=NODE_RESOURCES[1:3]
    ) as dep:
        yield dep


def test_prefill_on_one_node_decode_on_another(pd: RayKVCluster) -> None:
    prefill_id, decode_id = pd.worker_ids
    prefill, decode = pd.workers[prefill_id], pd.workers[decode_id]
    nodes = {get(h.page_server_address.remote()).node_id for h in (prefill, decode)}
    assert len(nodes) == 2, "the two workers must sit on different logical nodes"
    for seed, blocks in ((301, 6), (302, 1), (303, 9)):
        prompt = tokens(seed, blocks)
        result = disaggregated_request(prefill, decode, prefill_id, pd.keys(prompt), prompt, [11, 12, 13])
        assert result.prefill.committed_blocks == blocks and result.prefill.reused_tokens == 0
        assert result.pull is not None and result.pull.path == "ucx" and result.pull.complete
        assert len(result.pull.imported) == blocks
        assert result.decode.reused_tokens == len(prompt)  # create() reused every pulled block
    for handle in (prefill, decode):
        assert get(handle.verify_all.remote()) > 0  # every byte of every block, by the oracle
        get(handle.check.remote())
    pd.flush()
    route = pd.route(tokens(303, 9))
    assert route[prefill_id].blocks == 9 and route[decode_id].blocks == 9
    poll(lambda: get(prefill.transfer_stats.remote())["open_leases"] == 0, timeout=10, what="leases")
    client = get(decode.transfer_stats.remote())["client"]
    assert client["pulls"] == {"ucx": 3} and set(client["last_path"].values()) == {"ucx"}


def test_prefill_worker_dying_mid_transfer(pd: RayKVCluster) -> None:
    prefill_id, decode_id = pd.worker_ids
    prefill, decode = pd.workers[prefill_id], pd.workers[decode_id]
    prompt = tokens(304, 5)
    get(prefill.run_request.remote(prompt))
    before = snapshot_view(decode)
    shm_path = get(prefill.transfer_stats.remote())["shm_path"]
    get(prefill.set_transfer_faults.remote(stall_after_header_s=60.0))
    pending = decode.pull.remote(prefill_id, pd.keys(prompt))
    poll(lambda: get(prefill.transfer_stats.remote())["open_leases"] > 0, timeout=20, what="pull underway")
    ray.kill(prefill, no_restart=True)
    start = time.monotonic()
    try:
        _check_failed_pull(pending, start)
    finally:
        for path in (shm_path, f"{shm_path}.dir") if shm_path else ():
            if os.path.exists(path):  # SIGKILL left the shared tier's files behind
                os.unlink(path)
    assert snapshot_view(decode) == before  # nothing half-imported
    get(decode.check.remote())
    assert get(decode.transfer_stats.remote())["open_leases"] == 0
    recomputed = get(decode.run_request.remote(prompt))  # the caller falls back to recomputing
    assert recomputed.reused_tokens == 0 and recomputed.committed_blocks == 5
    assert get(decode.verify_all.remote()) == 5


def _check_failed_pull(pending: object, start: float) -> None:
    with pytest.raises(TransferError) as info:
        get(pending, timeout=40)
    assert info.value.reason in {"closed", "ucx"}
    assert time.monotonic() - start < 20, "a dead peer must fail the pull promptly, not at the timeout"

"""The connector's worker side loads along the one path plan (raykv.transfer.planner).

A real owner (a CacheManager with a shared host tier and a disk tier, behind a PageServer on
loopback) and a worker side on CPU KV tensors. Content, not calls: after every load the engine's
blocks, read back, hold the content oracle's bytes for their keys; the per-request path counters
show which step of the plan landed them.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator

import numpy as np
import pytest
from transfer_support import commit, seq

from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig
from raykv.core.tiers import shm_directory
from raykv.integrations.vllm.plan import EngineLink, LoadOp, RaykvMetadata
from raykv.integrations.vllm.worker import WorkerSide
from raykv.transfer import AuthToken, PageServer, TransferConfig
from raykv.transfer.net.config import default_node_id
from tests.deps import require

TPB = 4
LAYOUT = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB, dtype="float32")
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)
pytestmark = pytest.mark.skipif(not shm_directory.supported(), reason="one-sided reads need x86-64")


@dataclasses.dataclass
class Owner:
    manager: CacheManager
    server: PageServer
    token: bytes


@pytest.fixture
def owner() -> Iterator[Owner]:
    tiers = (
        TierConfig.host(8 * LAYOUT.page_bytes, pin_memory=False, shared=True),
        TierConfig.disk(16 * LAYOUT.page_bytes),
    )
    manager = CacheManager(CacheConfig(LAYOUT, tiers))
    token = secrets.token_bytes(32)
    server = PageServer(manager, AuthToken(token), CFG)
    server.start()
    yield Owner(manager, server, token)
    server.close()
    manager.shutdown()


def _engine() -> WorkerSide:
    require("torch")
    from raykv.integrations.vllm.testing import vllm_kv_caches

    side = WorkerSide(LAYOUT, NAMES)
    side.register(vllm_kv_caches(NAMES, 32, 2, TPB, 8, "float32", "cpu"), "flash_attn")
    return side


def _load(side: WorkerSide, owner: Owner, keys: list[bytes], req: str) -> dict[str, int]:
    """Load ``keys`` into engine blocks 0.. (poisoned first); the request's counters."""
    assert side.copier is not None
    side.copier.load(np.full((len(keys), LAYOUT.page_bytes), 0xEE, np.uint8), list(range(len(keys))))
    assert owner.server.address is not None
    link = EngineLink("w0", owner.server.address, default_node_id(), owner.token)
    side.start_load(RaykvMetadata(link=link, loads=[LoadOp(req, 0, tuple(keys), tuple(range(len(keys))))]))
    report = side.take_report()
    assert report is not None and not side.take_failed()
    return dict(report.per_request[req])


def _requests(side: WorkerSide) -> int:
    """How many requests the worker side's page client has sent (one-sided reads are none)."""
    assert side.client is not None
    return sum(n for path, n in side.client.stats.pulls.items() if path not in ("shm_read", "gpu_read"))


def _engine_holds(side: WorkerSide, oracle: ContentOracle, keys: list[bytes]) -> bool:
    assert side.copier is not None
    rows = np.zeros((len(keys), LAYOUT.page_bytes), np.uint8)
    side.copier.save(list(range(len(keys))), rows)
    return all(oracle.check(row, key) for row, key in zip(rows, keys))


def test_loads_ask_once_then_read_one_sided_then_ask_for_what_the_tier_lacks(owner: Owner) -> None:
    oracle = ContentOracle(LAYOUT)
    side = _engine()
    try:
        first = commit(owner.manager, oracle, seq(1, 3))
        counts = _load(side, owner, first, "r1")  # not mapped yet: the plan's last step asks
        assert counts["loaded_blocks_ok"] == 3 and counts.get("path_shm") == 1
        assert "path_shm_read" not in counts and _engine_holds(side, oracle, first)
        asked = _requests(side)
        counts = _load(side, owner, first, "r2")  # mapped: one-sided, the owner is not asked
        assert counts["loaded_blocks_ok"] == 3 and counts.get("path_shm_read") == 1
        assert _requests(side) == asked
        assert "path_shm" not in counts and _engine_holds(side, oracle, first)
        chain = commit(owner.manager, oracle, seq(2, 8))  # fills the shared tier: `first` to disk
        assert all(t.name == "DISK" for t in owner.manager.probe(keys=first).tiers)
        counts = _load(side, owner, first, "r3")  # the directory lacks them: the owner is asked
        # (it answers over ucx: pages on its disk tier are not in shared memory)
        assert counts["loaded_blocks_ok"] == 3 and counts.get("path_ucx") == 1
        assert "path_shm_read" not in counts
        assert _engine_holds(side, oracle, first)
        assert _requests(side) == asked + 1
        counts = _load(side, owner, chain, "r4")
        assert counts["loaded_blocks_ok"] == 8 and counts.get("path_shm_read") == 1
        assert _engine_holds(side, oracle, chain)
        owner.manager.check_invariants()
    finally:
        side.close()

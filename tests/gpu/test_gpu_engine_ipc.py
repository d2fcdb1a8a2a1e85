"""A GPU engine loads its CacheWorker's pages without a host copy, byte-checked.

The engine side is the vLLM connector's worker side (:class:`WorkerSide`, no vLLM needed) with
KV tensors in vLLM's GPU layouts. GPU tier: the owner is another process (as a CacheWorker is)
whose VMM GPU tier holds blocks written by the device oracle; the engine maps that tier
(:mod:`raykv.transfer.paths.gpu_land`) and copies device to device into its blocks, first by a
``gpu_peer`` request, then one-sided. Host tier: an owner's shared host tier, mapped read-only
and page-locked in the engine's process, is copied to the device by DMA with no staging copy.
Every loaded block is saved back to page rows and checked against the content oracle.
Skipped without CUDA; the GPU-tier tests also without ucxx (the owner process starts UCX), a
failure instead under RAYKV_REQUIRE_DEPS=1 (tests/deps.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from deps import require, require_cuda

torch = require_cuda()

from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig  # noqa: E402
from raykv.bench.core_io import page_layout  # noqa: E402
from raykv.integrations.vllm.plan import EngineLink, LoadOp, RaykvMetadata  # noqa: E402
from raykv.integrations.vllm.testing import vllm_kv_caches  # noqa: E402
from raykv.integrations.vllm.worker import WorkerSide  # noqa: E402
from raykv.transfer import PageServer, PeerAddress, TransferConfig  # noqa: E402
from raykv.transfer.net.config import default_node_id  # noqa: E402

PAGE_KIB, PAGES, BLOCKS = 512, 24, 64
LAYOUT = page_layout(PAGE_KIB)  # 8 layers of K and V, 16 tokens x 8 heads x 128, float16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in LAYOUT.layer_ids]
ENGINES = [("flash_attn", "LBNHC"), ("flashinfer", "LBHNC"), ("flashinfer", "BLHNC")]


class Owner:
    """A page server process whose GPU tier holds :data:`PAGES` oracle-written blocks."""

    def __init__(self) -> None:
        require("ucxx")
        from raykv.bench.gpu_transfer import Scenario, ServerProcess

        self.token = secrets.token_bytes(32)
        scenario = Scenario(f"{PAGES}x{PAGE_KIB}KiB", PAGE_KIB, PAGES)
        self.server = ServerProcess(self.token, [scenario], device=0)
        entry = self.server.ready["servers"][scenario.name]
        self.keys = [bytes.fromhex(k) for k in entry["keys"]]
        self.address = PeerAddress("127.0.0.1", entry["staged"])


@pytest.fixture(scope="module")
def owner() -> Iterator[Owner]:
    made = Owner()
    yield made
    made.server.close()


def _engine(kind: str, order: str, token: bytes, address: PeerAddress) -> tuple[WorkerSide, EngineLink]:
    caches = vllm_kv_caches(NAMES, BLOCKS, 8, LAYOUT.tokens_per_block, 128, "float16", "cuda", order)
    side = WorkerSide(LAYOUT, NAMES)
    side.register(caches, kind)
    link = EngineLink("w0", address, default_node_id(), token)
    return side, link


def _load(side: WorkerSide, link: EngineLink, keys: list[bytes], ids: list[int]) -> tuple[Any, set[int]]:
    side.start_load(RaykvMetadata(link=link, loads=[LoadOp("r", 0, tuple(keys), tuple(ids))]))
    return side.take_report(), side.take_failed()


def _check_blocks(side: WorkerSide, keys: list[bytes], ids: list[int], layout: KVLayout = LAYOUT) -> None:
    """Engine blocks ``ids`` hold the oracle's pages of ``keys`` (read back through a save)."""
    assert side.copier is not None
    rows = np.zeros((len(ids), layout.page_bytes), dtype=np.uint8)
    side.copier.save(ids, rows)
    oracle = ContentOracle(layout)
    bad = [i for i, (row, key) in enumerate(zip(rows, keys)) if not oracle.check(row, key)]
    assert not bad, f"blocks {bad} differ from the oracle"


@pytest.mark.parametrize(("kind", "order"), ENGINES)
def test_gpu_tier_pages_land_in_engine_blocks(owner: Owner, kind: str, order: str) -> None:
    side, link = _engine(kind, order, owner.token, owner.address)
    try:
        ids = [int(b) for b in np.random.default_rng(3).permutation(BLOCKS)[:PAGES]]
        report, failed = _load(side, link, owner.keys[:12], ids[:12])
        assert not failed and report.counters["loaded_blocks_ok"] == 12
        assert report.counters["path_gpu_peer"] + report.counters["path_gpu_read"] >= 1
        assert not any(name.startswith("path_s") for name in report.counters)  # no host path
        _check_blocks(side, owner.keys[:12], ids[:12])
        report, failed = _load(side, link, owner.keys[12:], ids[12:])  # the owner is known now
        assert not failed and report.counters["path_gpu_read"] == 1, report.counters
        _check_blocks(side, owner.keys, ids)
    finally:
        side.close()


def test_keys_off_the_gpu_tier_are_load_errors_after_the_leading_run(owner: Owner) -> None:
    side, link = _engine(*ENGINES[0], owner.token, owner.address)
    try:
        unknown = secrets.token_bytes(32)
        keys, ids = [*owner.keys[:5], unknown, owner.keys[6]], [9, 3, 40, 41, 7, 11, 12]
        report, failed = _load(side, link, keys, ids)
        assert report.counters["loaded_blocks_ok"] == 5 and failed == {11, 12}
        assert report.counters["path_gpu_peer"] == 1
        _check_blocks(side, keys[:5], ids[:5])
    finally:
        side.close()


def test_wrong_token_loads_nothing(owner: Owner) -> None:
    side, link = _engine(*ENGINES[0], secrets.token_bytes(32), owner.address)
    try:
        report, failed = _load(side, link, owner.keys[:4], [0, 1, 2, 3])
        assert failed == {0, 1, 2, 3} and not report.counters["loaded_blocks_ok"]
    finally:
        side.close()


def test_one_sided_host_loads_dma_the_page_locked_mapping() -> None:
    """An owner with a shared host tier (CPU pages): after the first pull the engine reads the
    tier one-sided, and its read-only mapping is page-locked, so loads copy it by DMA."""
    layout = KVLayout.uniform(len(NAMES), 8, 128, LAYOUT.tokens_per_block, "float16")
    tier = TierConfig.host(32 * layout.page_bytes, pin_memory=False, shared=True)
    token = secrets.token_bytes(32)
    with CacheManager(CacheConfig(layout, (tier,))) as mgr:
        oracle, tokens = ContentOracle(layout), list(range(10 * layout.tokens_per_block))
        with mgr.create(tokens) as kv:
            assert kv.resume()
            kv.extend(tokens)
            oracle.fill_cache(kv)
            kv.commit()
            keys = [bytes(kv.block_key(i)) for i in range(10)]
        server = PageServer(mgr, token, TransferConfig.loopback())
        address = server.start()
        side, link = _engine(*ENGINES[1], token, address)
        try:
            report, failed = _load(side, link, keys[:3], [5, 6, 7])  # connects: maps the tier
            assert not failed and report.counters["loaded_blocks_ok"] == 3, report.counters
            report, failed = _load(side, link, keys, list(range(20, 30)))
            assert not failed and report.counters["path_shm_read"] == 1, report.counters
            assert report.counters["dma_direct_blocks"] == 10
            _check_blocks(side, keys, list(range(20, 30)), layout)
            _check_blocks(side, keys[:3], [5, 6, 7], layout)
        finally:
            side.close()
            server.close()
        mgr.check_invariants()

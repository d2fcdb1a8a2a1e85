"""A CacheWorker binding engines (in-process, no Ray): a worker of a deployment started without a
layout takes its engine's layout (capacities in bytes kept, a new incarnation and page server,
content still verifiable); a worker with a fixed layout, or one another engine's layout is in use
on, refuses another with one short ConfigError and changes nothing."""

from __future__ import annotations

import secrets

import pytest

from actors.testing import TestingCacheWorker
from raykv import CacheConfig, ConfigError, KVLayout, TierConfig
from raykv.integrations.vllm.layout import mla_layout
from raykv.transfer import TransferConfig

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)
DEFAULT = KVLayout.uniform(8, 8, 128, 16)
LLAMA = KVLayout.uniform(2, 2, 64, 32, "float32")
MLA = mla_layout(2, 576, 16, "float32")
HOST = 64 * DEFAULT.page_bytes


def _worker(engine_layouts: bool) -> TestingCacheWorker:
    config = CacheConfig(DEFAULT, (TierConfig.host(HOST, pin_memory=False),))
    return TestingCacheWorker(
        "w",
        0,
        config,
        incarnation=1,
        token=secrets.token_bytes(32),
        transfer=CFG,
        engine_layouts=engine_layouts,
    )


def test_a_worker_without_a_layout_takes_its_engines_and_keeps_its_bytes() -> None:
    worker = _worker(engine_layouts=True)
    try:
        worker.run_request(list(range(64)))
        assert worker.manager.stats().capacity_bytes == (HOST,) and len(worker.manager.tree) == 4
        assert worker.bind_engine("e1", LLAMA, "llama", "ab" * 32) == LLAMA
        assert worker.manager.layout == LLAMA and worker.incarnation != 1
        assert len(worker.manager.tree) == 0  # the default layout's blocks are gone
        assert worker.manager.config.tiers[0].num_pages(LLAMA.page_bytes) == HOST // LLAMA.page_bytes
        assert worker.page_server_address() is not None
        outcome = worker.run_request(list(range(100)), verify=True)  # the oracle of the new layout
        assert outcome is not None and worker.verify_all() == 3
        worker.check()
        assert worker.bind_engine("e2", LLAMA, "llama", "ab" * 32) == LLAMA  # same layout: shared
        assert len(worker.manager.tree) == 3
        with pytest.raises(ConfigError) as err:
            worker.bind_engine("e3", MLA, "deepseek", "cd" * 32)
        assert len(str(err.value)) < 300 and "kv_latent" in str(err.value) and "pool=" in str(err.value)
        assert worker.manager.layout == LLAMA and len(worker.manager.tree) == 3  # nothing changed
        assert worker.binding()["engines"] == {"e1": ("llama", "ab" * 32), "e2": ("llama", "ab" * 32)}
        worker.unbind_engine("e1")
        worker.unbind_engine("e2")
        assert worker.bind_engine("e3", MLA, "deepseek", "cd" * 32) == MLA  # no engine left: it moves
        worker.check()
    finally:
        worker.shutdown()


def test_a_worker_with_a_layout_keeps_it() -> None:
    worker = _worker(engine_layouts=False)
    try:
        assert worker.bind_engine("e1", DEFAULT, "default", "") == DEFAULT
        with pytest.raises(ConfigError) as err:
            worker.bind_engine("e2", LLAMA, "llama", "")
        text = str(err.value)
        assert len(text) < 300 and "without a layout" in text and "tokens_per_block 16 -> 32" in text
        assert worker.manager.layout == DEFAULT and worker.incarnation == 1
        assert worker.claim_engine("e3", "another model")  # a fixed layout serves any engine that fits
    finally:
        worker.shutdown()


def test_a_tier_smaller_than_the_engines_page_is_refused_before_anything_moves() -> None:
    tiny = CacheConfig(LLAMA, (TierConfig.host(LLAMA.page_bytes, pin_memory=False),))
    worker = TestingCacheWorker("w", 0, tiny, incarnation=1, engine_layouts=True)
    try:
        with pytest.raises(ConfigError):
            worker.bind_engine("e1", KVLayout.uniform(8, 8, 128, 64), "big", "")
        assert worker.manager.layout == LLAMA and worker.incarnation == 1
    finally:
        worker.shutdown()

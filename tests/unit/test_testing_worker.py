"""The test hooks live on TestingCacheWorker (actors/testing.py), never on the production
CacheWorker; in-process, each hook does what the Ray tests, the demo and the replay rely on."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

import actors.cache.worker
from actors.cache.cluster import start
from actors.cache.transfer import WorkerTransfer
from actors.cache.worker import CacheWorker
from actors.testing import RequestOutcome, TestingCacheWorker
from raykv import CacheConfig, KVLayout, TierConfig, TransferError
from raykv.core.errors import InvalidArgumentError
from raykv.transfer import TransferConfig

HOOKS = ("write_oracle", "run_request", "verify_all", "check", "set_transfer_faults")
CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)


def _config(layout: KVLayout) -> CacheConfig:
    return CacheConfig(layout, (TierConfig.host(16 * layout.page_bytes, pin_memory=False),))


@pytest.fixture
def worker(layout: KVLayout) -> Iterator[TestingCacheWorker]:
    made = TestingCacheWorker("t", 0, _config(layout), incarnation=1)
    yield made
    made.shutdown()


def test_the_production_worker_has_no_test_hooks(layout: KVLayout) -> None:
    for name in HOOKS:
        assert not hasattr(CacheWorker, name), f"CacheWorker.{name} is a test hook"
        assert callable(getattr(TestingCacheWorker, name))
    assert not hasattr(CacheWorker, "set_sink")  # the sink is a constructor argument (or attach)
    assert not hasattr(WorkerTransfer, "set_faults")  # faults are set by the testing worker only
    for name in ("ContentOracle", "RequestOutcome"):
        assert not hasattr(actors.cache.worker, name), f"actors/cache/worker.py still uses {name}"
    production = CacheWorker("p", 0, _config(layout), incarnation=1)
    try:
        assert not hasattr(production, "oracle")
    finally:
        production.shutdown()
    assert issubclass(TestingCacheWorker, CacheWorker)


def test_start_takes_only_cacheworker_classes() -> None:
    for bad in (object, "TestingCacheWorker", None):
        with pytest.raises(ValueError, match="worker_class"):
            start(worker_class=bad)  # type: ignore[arg-type]


def test_run_request_reuses_and_the_oracle_verifies(worker: TestingCacheWorker, layout: KVLayout) -> None:
    prompt = list(range(5 * layout.tokens_per_block))
    first = worker.run_request(prompt, salt=3)
    assert first == RequestOutcome(worker.worker_id, len(prompt), 0, (0, 0, 0), 5)
    second = worker.run_request([*prompt, 7], salt=3, decode_tokens=[1, 2, 3])
    assert second.reused_tokens == len(prompt) and second.reused_by_tier == (0, 5, 0)
    assert second.committed_blocks == 1  # 20 reused + 4 new tokens: one more full block
    assert worker.run_request(prompt).reused_tokens == 0  # another scope shares nothing
    assert worker.verify_all() == len(worker.manager.tree)
    worker.check()
    assert worker.manager.num_open_requests == 0  # run_request closes its request


def test_write_oracle_fills_an_open_request(worker: TestingCacheWorker, layout: KVLayout) -> None:
    tokens = list(range(100, 100 + 3 * layout.tokens_per_block))
    handle, reused = worker.create(tokens)
    assert reused == 0 and worker.resume(handle)
    worker.extend(handle, tokens)
    worker.write_oracle(handle)
    assert worker.commit(handle) == 3
    worker.close(handle)
    assert worker.verify_all() == 3
    with pytest.raises(InvalidArgumentError):
        worker.write_oracle(handle)  # closed


def test_transfer_faults_need_a_page_server_and_known_names(
    worker: TestingCacheWorker, layout: KVLayout
) -> None:
    with pytest.raises(TransferError):
        worker.set_transfer_faults(corrupt_payload=True)
    served = TestingCacheWorker("s", 1, _config(layout), token=secrets.token_bytes(32), transfer=CFG)
    try:
        server = served.transfer.server
        assert server is not None
        with pytest.raises(ValueError, match="no_such_fault"):
            served.set_transfer_faults(corrupt_payload=True, no_such_fault=1)
        assert not server.faults.corrupt_payload  # a rejected call sets nothing
        served.set_transfer_faults(corrupt_payload=True, stall_after_header_s=0.5)
        assert server.faults.corrupt_payload and server.faults.stall_after_header_s == 0.5
    finally:
        served.shutdown()

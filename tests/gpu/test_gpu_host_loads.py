"""A CUDA engine's worker side loads from its CacheWorker's shared host tier by DMA, byte-checked.

The owner (a CacheManager with a shared host tier and a page server, in this process:
:class:`raykv.bench.vllm_host_loads.Owner`) holds pages of seeded random bytes; the engine is the
vLLM connector's :class:`WorkerSide` on KV tensors in vLLM's GPU layout, driven through
``start_load``. Its read-only mapping of the owner's tier is page-locked by the worker side
(``PageClient.pin_for_cuda``), so the one-sided load copies it to the device with no staging copy:
the worker side counts those blocks in ``dma_direct_blocks``. With the page-locking skipped the
same load stages (no direct blocks) and lands the same bytes. Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
from deps import require_cuda

torch = require_cuda()

from raykv.bench.vllm_host_loads import (  # noqa: E402
    DTYPE,
    ENGINE,
    HEAD,
    HEADS,
    Owner,
    Settings,
    host_load_rows,
    layout_of,
    pinning,
)
from raykv.integrations.vllm.plan import EngineLink, LoadOp, RaykvMetadata  # noqa: E402
from raykv.integrations.vllm.testing import vllm_kv_caches  # noqa: E402
from raykv.integrations.vllm.worker import WorkerSide  # noqa: E402
from raykv.transfer.net.config import default_node_id  # noqa: E402

PAGES, BLOCKS = 96, 128
"""96 pages of 1 MiB (2 layers of 512 KiB): 96 MiB, two of the copier's 64 MiB chunks."""


@pytest.mark.parametrize("pin", [True, False], ids=["registered", "pageable"])
def test_worker_side_host_loads_dma_the_registered_mapping(pin: bool) -> None:
    layout = layout_of(512, layers=2)
    owner = Owner(layout, PAGES, seed=7)
    names = [f"model.layers.{i}.self_attn.attn" for i in layout.layer_ids]
    tpb = layout.tokens_per_block
    caches = vllm_kv_caches(names, BLOCKS, HEADS, tpb, HEAD, DTYPE, "cuda", ENGINE[1])
    side = WorkerSide(layout, names)
    side.register(caches, ENGINE[0])
    link = EngineLink("w0", owner.address, default_node_id(), owner.token)
    ids = tuple(int(b) for b in np.random.default_rng(5).permutation(BLOCKS)[:PAGES])
    meta = RaykvMetadata(link=link, loads=[LoadOp("r", 0, tuple(owner.keys), ids)])
    try:
        for attempt in range(2):  # the first connects, maps and page-locks the owner's tier
            for tensor in caches.values():
                tensor.view(torch.int16).fill_(-1)
            with pinning(pin):
                side.start_load(meta)
            report, failed = side.take_report(), side.take_failed()
            assert report is not None and not failed, (attempt, failed)
            counters = report.counters
            assert counters["loaded_blocks_ok"] == PAGES, counters
            if attempt:  # mapped now: one-sided, straight from the mapping when page-locked
                assert counters["path_shm_read"] == 1, counters
                assert counters["dma_direct_blocks"] == (PAGES if pin else 0), counters
            assert side.copier is not None
            back = np.zeros_like(owner.rows)
            side.copier.save(list(ids), back)
            assert np.array_equal(back, owner.rows), f"load {attempt}: blocks differ from the pages"
        owner.manager.check_invariants()
    finally:
        side.close()
        owner.close()


def test_host_loads_bench_rows_are_measured_on_the_direct_path() -> None:
    """The bench's registered-mapping rows: the worker side's load took the direct path for every
    block, and both rows have a figure and a baseline."""
    rows = host_load_rows(Settings(repeats=2, warmup=1, warm_s=0.0), 64, True, blocks=32)
    assert [r.name.split(",")[0] for r in rows] == ["WorkerSide load", "BlockCopier.load"]
    assert "dma_direct_blocks 32/32" in rows[0].info and rows[0].goal is not None
    assert all(r.ratio is not None and r.ratio > 0 for r in rows), rows

"""The vLLM connector's stores from a CPU engine, through the worker side's real path, vs a memcpy
of the same bytes.

``python -m raykv.bench.vllm_stores [--quick]`` (``raykv bench stores``) prints one table; it needs
torch, and neither Ray, ucxx nor vLLM. Everything runs in this process: the owner (a CacheWorker's
side: a :class:`raykv.CacheManager` whose only tier is a shared host tier, its
:class:`raykv.transfer.inbox.Inboxes` and their store socket, served on the owner's threads) and
the engine (per-layer KV tensors as vLLM 0.32's CPU backend registers them, ``engine_native``
pages of the ``raykv bench vllm`` Llama: 8 layers of 4 KV heads x 64 float32, 16-token blocks,
256 KiB pages), driven through :class:`raykv.integrations.vllm.worker.WorkerSide` itself:
``register``, then ``save(RaykvMetadata(link=..., stores=[StoreOp(...)]))`` of one new prompt's
blocks per sample.

Rows, each against ``np.copyto`` of the same number of bytes between two preallocated arrays,
sampled alternately (the issue's goal: >= 0.8x):

* ``one copy (shared KV memory)``: the worker side's request and its wait while the owner gathers
  the blocks out of the engine's memory into its pages and commits them (what ``save`` costs).
* ``two copies (inbox)``: the same engine with its lease's store socket withheld: the worker
  side's copy into the inbox, then the owner's commit of it (``Inboxes.commit``), back to back.

Checks: after every sample the owner must hold every block of the prompt, and the first and last
pages of each store are compared byte for byte with the engine's blocks read back with
``BlockCopier.save``; each sample stores a prompt not seen before (a store of blocks held already
would copy nothing), on blocks the engine's tensors were refilled with random bytes for.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from raykv.bench.harness import Benchmark, Row, module_main, paired_seconds, timed
from raykv.core.config import CacheConfig, TierConfig
from raykv.core.keys import ReuseScope, block_keys
from raykv.core.manager import CacheManager
from raykv.transfer import PeerAddress
from raykv.transfer.inbox import Inboxes

LAYERS, HEADS, HEAD, TOKENS = 8, 4, 64, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SCOPE = ReuseScope(None, 11, b"s" * 32)


class _Setup:
    """An owner and one engine's worker side on ``blocks``-block stores."""

    def __init__(self, blocks: int, samples: int, shared: bool) -> None:
        import torch

        from raykv.integrations.vllm.layout import native_layout
        from raykv.integrations.vllm.plan import EngineLink
        from raykv.integrations.vllm.testing import vllm_kv_caches
        from raykv.integrations.vllm.worker import WorkerSide

        self.layout = native_layout(LAYERS, HEADS, HEAD, TOKENS, "float32")
        page = self.layout.page_bytes
        tier = TierConfig.host((samples + 2) * blocks * page, pin_memory=False, shared=True)
        self.manager = CacheManager(CacheConfig(self.layout, (tier,)))
        self.inboxes = Inboxes(self.manager)
        # an engine of 4 stores' blocks (the quick run's 64 MiB is over memory.MIN_BYTES too)
        caches = vllm_kv_caches(NAMES, 4 * blocks + 2, HEADS, TOKENS, HEAD, "float32", "cpu", order="LBHNC")
        for tensor in caches.values():
            tensor.copy_(torch.randn(tensor.shape))
        self.side = WorkerSide(self.layout, NAMES)
        self.side.register(caches, "cpu")
        leases = self.inboxes.open("bench-engine", 1, (blocks + 1) * page)
        if not shared:
            leases = tuple(dataclasses.replace(lease, socket="") for lease in leases)
        self.link = EngineLink("owner", PeerAddress("127.0.0.1", 1), "node", b"b" * 32, leases)
        self.blocks, self.count, self.shared = blocks, 0, shared

    def store(self) -> None:
        """One store of a new prompt's ``blocks`` blocks (engine blocks 1 .. blocks, or after
        them every other sample), committed when this returns; checked after."""
        from raykv.integrations.vllm.plan import RaykvMetadata, StoreOp

        self.count += 1
        first_id = 1 + (self.count % 2) * self.blocks
        ids = tuple(range(first_id, first_id + self.blocks))
        tokens = tuple(
            int(t) for t in np.random.default_rng(self.count).integers(0, 30000, self.blocks * TOKENS)
        )
        self.side.save(
            RaykvMetadata(link=self.link, stores=[StoreOp(f"r{self.count}", tokens, SCOPE, ids, 0)])
        )
        report = self.side.take_report()
        assert report is not None
        if report.commits:
            self.inboxes.commit(report.commits)
        self._last = (tokens, ids)

    def check(self) -> None:
        """The last store's blocks are held, its first and last pages equal to the engine's."""
        tokens, ids = self._last
        keys = [bytes(k) for k in block_keys(list(tokens), TOKENS, SCOPE)]
        pages = self.manager.export_blocks([keys[0], keys[-1]])
        if len(pages) != 2 or self.manager.probe(list(tokens), SCOPE).num_blocks != self.blocks:
            raise AssertionError(
                f"the owner holds {self.manager.probe(list(tokens), SCOPE).num_blocks} blocks"
            )
        want = np.zeros((2, self.layout.page_bytes), dtype=np.uint8)
        assert self.side.copier is not None
        self.side.copier.save([ids[0], ids[-1]], want)
        for page, row in zip(pages, want):
            if not np.array_equal(np.frombuffer(page.data, np.uint8), row):
                raise AssertionError("a stored page differs from the engine's block")

    def close(self) -> None:
        self.side.close()
        self.inboxes.close()
        self.manager.shutdown()


def _row(shared: bool, nbytes: int, repeats: int) -> Row:
    blocks = max(1, nbytes // (2 * LAYERS * TOKENS * HEADS * HEAD * 4))
    setup = _Setup(blocks, repeats + 3, shared)
    page = setup.layout.page_bytes
    src = np.random.default_rng(0).integers(0, 256, blocks * page, dtype=np.uint8)
    dst = np.empty_like(src)
    try:

        def ours() -> float:
            start = time.perf_counter()
            setup.store()
            took = time.perf_counter() - start
            setup.check()
            return took

        ours_s, base_s = paired_seconds(ours, timed(lambda: np.copyto(dst, src)), repeats, warmup=1)
        name = "one copy (shared KV memory)" if shared else "two copies (inbox)"
        info = f"{blocks} blocks of {page >> 10} KiB; the worker side's store as save() runs it"
        if shared and setup.side.shared is None:
            info += " (the shared path did not open: it ran through the inbox)"
        nbytes = blocks * page
        return Row(
            f"store {name}, {nbytes >> 20} MiB",
            nbytes / ours_s / 1e9,
            nbytes / base_s / 1e9,
            "GB/s",
            0.8,
            info=info,
        )
    finally:
        setup.close()


def _rows(shared: bool, nbytes: int, repeats: int) -> list[Row]:
    return [_row(shared, nbytes, repeats)]


def suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The two rows, 64 MiB stores (16 MiB with ``quick``)."""
    nbytes, repeats = (16 << 20, 3) if quick else (64 << 20, 9)
    desc = (
        f"vLLM connector stores from a CPU engine (engine_native pages, {LAYERS} layers x {HEADS} KV heads "
        f"x {HEAD} float32, {TOKENS}-token blocks) vs np.copyto of the same bytes; median of {repeats}"
    )
    benches = [
        Benchmark("store, one copy", functools.partial(_rows, True, nbytes, repeats)),
        Benchmark("store, two copies", functools.partial(_rows, False, nbytes, repeats)),
    ]
    return benches, desc


if __name__ == "__main__":
    raise SystemExit(module_main("vllm_stores", suite))

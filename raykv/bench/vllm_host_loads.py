"""The vLLM connector's loads from a CacheWorker's shared host tier, through the worker side's real
path, vs a raw pinned host-to-device copy of the same bytes.

``python -m raykv.bench.vllm_host_loads [--quick]`` (``raykv bench host_loads``) prints one table;
it needs CUDA, and neither Ray, ucxx nor vLLM. Everything runs in this process, as the connector's
GPU tests do: the one-sided path needs no distinct owner, only a page server of the same node id.

Owner (a CacheWorker's host side): a :class:`raykv.CacheManager` whose only tier is a shared host
tier (a ``/dev/shm`` file, not pinned by its owner), holding :data:`BLOCKS` committed pages of
seeded random bytes, and a :class:`raykv.transfer.PageServer` on it over loopback. Engine: per-layer
CUDA KV tensors as vLLM 0.32 registers them (``flash_attn``, vLLM's default ``NHD`` order: the
engine of :mod:`raykv.bench.vllm_blocks`, 4 layers of 8 KV heads x 128 bfloat16, twice as many
blocks as are loaded), driven through :class:`raykv.integrations.vllm.worker.WorkerSide` itself:
``register``, then ``start_load(RaykvMetadata(link=EngineLink(...), loads=[LoadOp(...)]))`` of
every page into :data:`BLOCKS` random blocks. The link names no inbox, so the worker side maps
none and stores nothing: only its load path runs. On a CUDA engine that is: the GPU-tier attempt (the
owner has no GPU tier: refused once, then skipped), ``PageClient.land_local`` (a one-sided read
of the owner's tier, mapped read-only in the engine's process and, as ``WorkerSide._open`` asks,
page-locked with ``cuMemHostRegister``), then ``BlockCopier.load`` of the rows into the engine's
blocks (one host-to-device copy per 64 MiB chunk straight from the mapping when it is
page-locked, else staged through a pinned buffer; one block-kernel scatter per chunk).

Rows, for layer-blocks of 64 KiB and 512 KiB (64 MiB and 512 MiB per load), each against one raw
``copy_(non_blocking=True)`` of a pinned host tensor holding the same bytes into a device tensor,
then a stream synchronize (the issue's goal: >= 0.85x on 1x H200):

* ``registered mapping``: the connector as it runs (its mapping of the owner's tier page-locked);
  the note says how many blocks the worker side counted as DMA'd directly (``dma_direct_blocks``).
* ``BlockCopier.load, pinned rows``: the copier alone on the same bytes in a pinned tensor (what
  the worker side adds is the difference between this row and the one above).
* ``pageable mapping``: the same worker side with ``PageClient.pin_for_cuda`` skipped (what
  loads did before the registration).

Checks: every sample's load is checked (untimed) against the first load of its engine, whose
blocks were read back through ``BlockCopier.save`` and compared byte for byte with the committed
pages; before every sample the engine's tensors are overwritten, so a load that writes nothing
(or the wrong blocks) fails the row instead of reporting a fast wrong copy. Every worker-side load
must report all blocks loaded over ``shm_read``, none failed. Figures are GB/s (1e9 page bytes
per second), the median of ``repeats`` samples taken alternately with the baseline, wall clock from
the call until the blocks are written, after untimed pairs for at least ``warm_s``.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from raykv.bench.harness import Benchmark, Row, module_main, paired_seconds, timed
from raykv.bench.vllm_blocks import DTYPE, HEAD, HEADS, LAYER_BLOCK_KIB
from raykv.core.config import CacheConfig, KVLayout, TierConfig
from raykv.core.errors import StateError
from raykv.core.manager import CacheManager

BLOCKS = 256
"""Pages per load (the engine has twice as many blocks)."""
LAYERS = 4
ENGINE = ("flash_attn", "LBNHC")
"""(``kv_cache_layout``, vLLM's physical order) of the engine: vLLM's default on CUDA."""
GOAL = 0.85
"""Issue 39: loads from the host tier at >= 0.85x a raw pinned copy (1x H200)."""
POISON = -1
"""What the engine's tensors hold (as int16) before every timed load."""


@dataclass(frozen=True)
class Settings:
    """Samples per row (``repeats``, after ``warmup`` untimed pairs and ``warm_s``)."""

    repeats: int
    warmup: int
    warm_s: float
    """Untimed pairs for at least this long before each row's samples (GPU clocks up)."""


FULL = Settings(repeats=15, warmup=3, warm_s=0.25)
QUICK = Settings(repeats=5, warmup=2, warm_s=0.05)


def layout_of(kib: int, layers: int = LAYERS) -> KVLayout:
    """The engine's layout for layer-blocks of ``kib`` KiB (:data:`LAYER_BLOCK_KIB`)."""
    return KVLayout.uniform(layers, HEADS, HEAD, LAYER_BLOCK_KIB[kib], DTYPE)


class Owner:
    """A CacheWorker's host side in this process: a manager with one shared host tier of
    ``blocks`` pages, every page committed with seeded random bytes (``rows``, ``keys`` in block
    order), and a page server on it over loopback (``address``, ``token``). :meth:`close` stops
    both (the tier's file goes with the manager)."""

    def __init__(self, layout: KVLayout, blocks: int = BLOCKS, seed: int = 0) -> None:
        from raykv.transfer import PageServer, TransferConfig

        self.layout = layout
        self.token = secrets.token_bytes(32)
        tier = TierConfig.host(blocks * layout.page_bytes, pin_memory=False, shared=True)
        self.manager = CacheManager(CacheConfig(layout, (tier,)))
        try:
            data = np.random.default_rng(seed).bytes(blocks * layout.page_bytes)
            self.rows = np.frombuffer(data, dtype=np.uint8).reshape(blocks, layout.page_bytes)
            self.keys = commit_rows(self.manager, self.rows)
            self.server = PageServer(self.manager, self.token, TransferConfig.loopback())
            self.address = self.server.start()
        except BaseException:
            self.manager.shutdown()
            raise

    def close(self) -> None:
        self.server.close()
        self.manager.shutdown()


def commit_rows(manager: CacheManager, rows: npt.NDArray[np.uint8]) -> list[bytes]:
    """Commit one request of ``len(rows)`` blocks whose pages hold ``rows``; their keys.
    StateError when the manager has no room for them."""
    tokens = list(range(len(rows) * manager.tokens_per_block))
    with manager.create(tokens) as kv:
        if not kv.resume():
            raise StateError("no room on the owner's tier for the pages")
        kv.extend(tokens)
        for i, row in enumerate(rows):
            kv.page(i)[:] = row
        kv.commit()
        return [bytes(kv.block_key(i)) for i in range(len(rows))]


@contextlib.contextmanager
def pinning(on: bool) -> Iterator[None]:
    """Leave the worker side's page-locking of the owner's mapping as it is (``on``), or skip it
    (``PageClient.pin_for_cuda`` a no-op meanwhile: the pageable mapping loads read before)."""
    if on:
        yield
        return
    from unittest import mock

    from raykv.transfer import PageClient

    with mock.patch.object(PageClient, "pin_for_cuda", lambda self: None):
        yield


class Engine:
    """A CUDA engine's worker side linked to ``owner``: per-layer KV tensors in vLLM's layout
    (``caches``, ``2 * len(owner.keys)`` blocks), a :class:`WorkerSide` registered on them
    (``side``), and one load op of every owner page into random blocks ``into``. ``pin``: the
    mapping is page-locked as the connector does (else :func:`pinning` off). :meth:`prime` runs
    the first load; :meth:`sample` the timed ones; :meth:`close` closes the worker side.
    ``device``: where the KV tensors live (``cpu`` only to try the plumbing without a GPU).
    The link carries no inbox lease, so the worker side maps no inbox: only its load path runs."""

    def __init__(self, owner: Owner, pin: bool = True, device: str = "cuda") -> None:
        from raykv.integrations.vllm.plan import EngineLink, LoadOp, RaykvMetadata
        from raykv.integrations.vllm.testing import vllm_kv_caches
        from raykv.integrations.vllm.worker import WorkerSide
        from raykv.transfer.net.config import default_node_id

        layout, blocks = owner.layout, len(owner.keys)
        names = [f"model.layers.{i}.self_attn.attn" for i in layout.layer_ids]
        kind, order = ENGINE
        tpb = layout.tokens_per_block
        self.caches = vllm_kv_caches(names, 2 * blocks, HEADS, tpb, HEAD, DTYPE, device, order)
        self.side = WorkerSide(layout, names)
        self.side.register(self.caches, kind)
        self.owner, self.pin, self.cuda = owner, pin, device == "cuda"
        self.into = [int(b) for b in np.random.default_rng(tpb).permutation(2 * blocks)[:blocks]]
        link = EngineLink("bench", owner.address, default_node_id(), owner.token)  # no inbox: no stores
        op = LoadOp("bench", 0, tuple(owner.keys), tuple(self.into))
        self.meta = RaykvMetadata(link=link, loads=[op])
        self.direct = 0
        """``dma_direct_blocks`` of the last load."""
        self.reference: list[Any] = []

    def prime(self) -> None:
        """The first load (connects, maps the owner's tier, page-locks it when ``pin``; a CPU
        engine's takes the ``shm`` request path), then a one-sided one, checked byte for byte
        against the committed pages: it becomes every later load's reference."""
        import torch

        with pinning(self.pin):
            self.side.start_load(self.meta)
        self._check_report(one_sided=False)
        self._poison()
        self.side.start_load(self.meta)
        self._check_report()
        assert self.side.copier is not None
        back = np.zeros_like(self.owner.rows)
        self.side.copier.save(self.into, back)
        if not np.array_equal(back, self.owner.rows):
            raise AssertionError("loaded blocks differ from the owner's committed pages")
        self.reference = [t.view(torch.int16).clone() for t in self.caches.values()]

    def sample(self) -> float:
        """Seconds of one worker-side load of every page (engine overwritten first, report and
        content checked after: all untimed)."""
        return self.checked(lambda: self.side.start_load(self.meta), report=True)

    def checked(self, load: Callable[[], object], report: bool = False) -> float:
        """Seconds of ``load()`` from an overwritten engine; AssertionError unless it left the
        engine as :meth:`prime`'s load did (and, with ``report``, the worker side reported it)."""
        import torch

        self._poison()
        start = time.perf_counter()
        load()
        seconds = time.perf_counter() - start
        if report:
            self._check_report()
        got = [t.view(torch.int16) for t in self.caches.values()]
        if not all(torch.equal(a, b) for a, b in zip(got, self.reference)):
            raise AssertionError("a load left the engine's blocks different from the first load's")
        return seconds

    def _poison(self) -> None:
        """Overwrite every block of the engine, and wait for it."""
        import torch

        for tensor in self.caches.values():
            tensor.view(torch.int16).fill_(POISON)
        if self.cuda:
            torch.cuda.synchronize()

    def _check_report(self, one_sided: bool = True) -> None:
        """AssertionError unless the last load landed every block (over ``shm_read`` when
        ``one_sided``); keeps its ``dma_direct_blocks`` (and refuses direct DMA from a mapping that
        should be pageable)."""
        report, failed = self.side.take_report(), self.side.take_failed()
        counters = report.counters if report is not None else {}
        n, path = len(self.into), counters.get("path_shm_read") == 1 or not one_sided
        if failed or counters.get("loaded_blocks_ok") != n or not path:
            raise AssertionError(f"worker-side load not served one-sided: {dict(counters)}, failed {failed}")
        self.direct = int(counters.get("dma_direct_blocks", 0))
        if self.direct and not self.pin:
            raise AssertionError("the pageable case DMA'd directly: the mapping was page-locked")

    def close(self) -> None:
        self.side.close()


class RawCopy:
    """The baseline: a pinned host tensor holding ``rows`` and a device tensor of its size;
    :meth:`copy` copies the one into the other (checked once here)."""

    def __init__(self, rows: npt.NDArray[np.uint8]) -> None:
        import torch

        self.torch = torch
        self.host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        self.host.numpy()[:] = rows
        self.dev = torch.empty(rows.shape, dtype=torch.uint8, device="cuda")
        self.copy()
        if not np.array_equal(self.dev.cpu().numpy(), rows):
            raise AssertionError("the raw pinned copy changed the bytes")

    def copy(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)
        self.torch.cuda.current_stream().synchronize()


def host_load_rows(settings: Settings, kib: int, pin: bool, blocks: int = BLOCKS) -> list[Row]:
    """The rows of one owner and engine: worker-side loads from the registered (``pin``) or
    pageable mapping, and with ``pin`` the copier alone on pinned rows; GB/s vs :class:`RawCopy`."""
    owner = Owner(layout_of(kib), blocks, seed=kib)
    try:
        raw, engine = RawCopy(owner.rows), Engine(owner, pin)
        try:
            engine.prime()
            return _measure(settings, kib, engine, raw)
        finally:
            engine.close()
    finally:
        owner.close()


def _measure(settings: Settings, kib: int, engine: Engine, raw: RawCopy) -> list[Row]:
    """Time the worker side (and with ``engine.pin`` the copier alone) against ``raw``."""
    nbytes, n = raw.host.numel(), len(engine.into)
    size = f"{kib}KiB x{n}x{len(engine.owner.layout.layer_ids)}L ({nbytes >> 20} MiB)"
    base, out = timed(raw.copy), []
    t_ours, t_base = paired_seconds(engine.sample, base, settings.repeats, settings.warmup, settings.warm_s)
    mapping = "registered" if engine.pin else "pageable"
    info = f"dma_direct_blocks {engine.direct}/{n}; baseline: raw pinned h2d"
    goal = GOAL if engine.pin else None
    name = f"WorkerSide load, {mapping} mapping {size}"
    out.append(Row(name, nbytes / t_ours / 1e9, nbytes / t_base / 1e9, "GB/s", goal=goal, info=info))
    if engine.pin:
        assert engine.side.copier is not None
        copier, rows = engine.side.copier, raw.host.numpy()
        alone = functools.partial(engine.checked, lambda: copier.load(rows, engine.into))
        t_ours, t_base = paired_seconds(alone, base, settings.repeats, settings.warmup, settings.warm_s)
        info = "no WorkerSide, no mapping; baseline: raw pinned h2d"
        name = f"BlockCopier.load, pinned rows {size}"
        out.append(Row(name, nbytes / t_ours / 1e9, nbytes / t_base / 1e9, "GB/s", info=info))
    return out


def benchmarks(settings: Settings) -> list[Benchmark]:
    """Per layer-block size: the registered mapping (and the copier alone), then the pageable."""
    out = []
    for kib in LAYER_BLOCK_KIB:
        for pin in (True, False):
            label = f"{'registered' if pin else 'pageable'} mapping {kib}KiB"
            out.append(Benchmark(label, functools.partial(host_load_rows, settings, kib, pin)))
    return out


def describe() -> str:
    """The device, torch, and which one-sided reader runs (compiled or Python)."""
    import torch

    from raykv import native

    reader = "compiled" if native.load("_shmread") is not None else "python"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return f"{device}, torch {torch.__version__}, one-sided reader {reader}"


def suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The suite's benchmarks and description line (``quick``: fewer samples, same sizes)."""
    settings = QUICK if quick else FULL
    desc = (
        f"{'quick' if quick else 'full'} mode, {BLOCKS} blocks of {LAYERS} layers, {HEADS} heads x "
        f"{HEAD} {DTYPE}, {ENGINE[0]}/{ENGINE[1]}, median of {settings.repeats}; {describe()}"
    )
    return benchmarks(settings), desc


if __name__ == "__main__":
    import sys

    sys.exit(module_main("vllm_host_loads", suite))

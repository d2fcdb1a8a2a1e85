"""The ``gpu`` suite: GPU tier page copies against raw CUDA copies of the same bytes (needs CUDA).

For pages of 64 KiB, 512 KiB and 4 MiB, a batch of ``total_bytes`` worth of pages at *random*
slots (nothing coalesces into one run) is copied:

* ``d2h``/``h2d batched``: one ``CopyEngine.copy`` between a GPU pool and a pinned host pool (the
  engine's own choice of method), then wait for it; ``... per page``: one ``CopyEngine.copy`` call
  per page, then wait; ``... kernel``/``... memcpy``/``... batch dma``: the batch with the method
  forced (one copy kernel launch, one ``cuMemcpyAsync`` per page, or chunked
  ``cuMemcpyBatchAsync``). Baseline: one raw ``cudaMemcpyAsync`` (torch
  ``copy_(non_blocking=True)``) of the same total bytes between one pinned host buffer and one
  device buffer, then a stream synchronize. Goal for the batched rows: >= 0.85x.
* ``d2d batched``: ``GpuPool.copy_slots`` within the pool vs one raw device-to-device copy of the
  same bytes (bytes counted once).

Timing is wall clock from the call to the end of the copy (host overhead included), the median of
``repeats`` samples taken alternately with the baseline, after untimed pairs for at least
``warm_s`` seconds (an idle GPU clocks down, which slows the copy kernels more than the raw
copy). Page bytes are random.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from raykv.bench.core_io import fill_random, page_layout
from raykv.bench.harness import Benchmark, Row, paired_seconds, timed
from raykv.core.config import KVLayout, TierConfig
from raykv.core.copy import CopyEngine
from raykv.core.errors import CudaError
from raykv.core.tiers.host import HostPool
from raykv.core.types import PageId

PAGE_KIB = (64, 512, 4096)
GOAL = 0.8
"""Device-to-device rows: at least this fraction of a raw device copy."""
HOST_GOAL = 0.85
"""Host <-> GPU batched rows: at least this fraction of a raw pinned copy."""


@dataclass(frozen=True)
class GpuSettings:
    total_bytes: int
    d2d_bytes: int
    repeats: int
    warmup: int
    warm_s: float
    """Untimed pairs for at least this long before each row's samples (GPU clocks up)."""


FULL = GpuSettings(total_bytes=256 << 20, d2d_bytes=1 << 30, repeats=15, warmup=3, warm_s=0.25)
QUICK = GpuSettings(total_bytes=64 << 20, d2d_bytes=256 << 20, repeats=5, warmup=2, warm_s=0.05)


class _Setup:
    """A GPU pool and a pinned host pool of 2x the batch, filled with random bytes."""

    def __init__(self, layout: KVLayout, total_bytes: int, seed: int) -> None:
        import torch

        from raykv.core.tiers.gpu import GpuPool

        self.torch = torch
        page = layout.page_bytes
        self.n = max(1, total_bytes // page)
        self.gpu = GpuPool(TierConfig.gpu(2 * self.n * page), layout)
        self.host = HostPool(TierConfig.host(2 * self.n * page), layout, pin=True)
        if not self.host.pinned:
            raise CudaError("pinned host memory unavailable", cuda_error="cudaErrorMemoryAllocation")
        self.engine = CopyEngine([self.gpu, self.host])
        gen = torch.Generator(device=self.gpu.device).manual_seed(seed)
        self.gpu.tensor.copy_(
            torch.randint(
                0, 256, self.gpu.tensor.shape, dtype=torch.uint8, device=self.gpu.device, generator=gen
            )
        )
        fill_random(self.host.array, seed)
        rng = np.random.default_rng(seed)
        self.gpu_slots = [PageId(int(s)) for s in rng.permutation(2 * self.n)[: self.n]]
        self.host_slots = [PageId(int(s)) for s in rng.permutation(2 * self.n)[: self.n]]
        nbytes = self.n * page
        self.raw_dev = torch.empty(nbytes, dtype=torch.uint8, device=self.gpu.device)
        self.raw_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.nbytes = nbytes

    def sync(self) -> None:
        self.engine.synchronize()

    def close(self) -> None:
        self.engine.synchronize()
        self.gpu.close()
        self.host.close()


def _batched(s: _Setup, d2h: bool, method: str | None = None) -> None:
    copier = s.gpu.copier
    saved = copier.method
    if method is not None:
        copier.method = method
    try:
        if d2h:
            s.engine.copy(0, s.gpu_slots, 1, s.host_slots)
        else:
            s.engine.copy(1, s.host_slots, 0, s.gpu_slots)
        s.sync()
    finally:
        copier.method = saved


def _per_page(s: _Setup, d2h: bool) -> None:
    copy = s.engine.copy
    for g, h in zip(s.gpu_slots, s.host_slots):
        if d2h:
            copy(0, [g], 1, [h])
        else:
            copy(1, [h], 0, [g])
    s.sync()


def _raw(s: _Setup, d2h: bool) -> None:
    if d2h:
        s.raw_host.copy_(s.raw_dev, non_blocking=True)
    else:
        s.raw_dev.copy_(s.raw_host, non_blocking=True)
    s.torch.cuda.current_stream().synchronize()


def _check_round_trip(s: _Setup) -> None:
    """Bytes survive GPU -> host -> GPU at the benchmark's own slots (before timing)."""
    torch = s.torch
    before = s.gpu.tensor[torch.as_tensor(s.gpu_slots, device=s.gpu.device)].clone()
    _batched(s, d2h=True)
    s.gpu.tensor[torch.as_tensor(s.gpu_slots, device=s.gpu.device)] = 0
    _batched(s, d2h=False)
    after = s.gpu.tensor[torch.as_tensor(s.gpu_slots, device=s.gpu.device)]
    if not torch.equal(before, after):
        raise AssertionError("GPU -> host -> GPU round trip changed the bytes")


def host_copy_benchmark(settings: GpuSettings, page_kib: int) -> list[Row]:
    """GB/s of GPU <-> pinned host page copies (four variants each way) vs one raw copy."""
    layout = page_layout(page_kib)
    s = _Setup(layout, settings.total_bytes, seed=page_kib)
    try:
        _check_round_trip(s)
        rows = []
        label = f"{page_kib}KiB x{s.n}"
        for d2h in (True, False):
            direction = "d2h" if d2h else "h2d"
            cases: list[tuple[str, Callable[[], object], float | None]] = [
                ("batched", functools.partial(_batched, s, d2h), HOST_GOAL),
                ("per page", functools.partial(_per_page, s, d2h), None),
                ("kernel", functools.partial(_batched, s, d2h, "kernel"), None),
                ("memcpy", functools.partial(_batched, s, d2h, "memcpy"), None),
                ("batch dma", functools.partial(_batched, s, d2h, "batch"), None),
            ]
            base = timed(functools.partial(_raw, s, d2h))
            for name, fn, goal in cases:
                t_ours, t_base = paired_seconds(
                    timed(fn), base, settings.repeats, settings.warmup, settings.warm_s
                )
                rows.append(
                    Row(
                        f"{direction} {name} {label}",
                        s.nbytes / t_ours / 1e9,
                        s.nbytes / t_base / 1e9,
                        "GB/s",
                        goal,
                    )
                )
        return rows
    finally:
        s.close()


def d2d_benchmark(settings: GpuSettings, page_kib: int) -> list[Row]:
    """GB/s of page copies within the GPU pool vs one raw device copy of the same bytes."""
    import torch

    from raykv.core.tiers.gpu import GpuPool

    layout = page_layout(page_kib)
    page = layout.page_bytes
    n = max(1, settings.d2d_bytes // page)
    pool = GpuPool(TierConfig.gpu(2 * n * page), layout)
    try:
        rng = np.random.default_rng(page_kib)
        perm = rng.permutation(2 * n)
        src, dst = perm[:n].astype(np.int64), perm[n:].astype(np.int64)  # block tables are arrays
        pool.tensor.random_(0, 256)
        a = torch.empty(n * page, dtype=torch.uint8, device=pool.device).random_(0, 256)
        b = torch.empty_like(a)

        def ours() -> None:
            pool.copy_slots(src, dst)
            pool.synchronize()

        def raw() -> None:
            b.copy_(a)
            torch.cuda.current_stream().synchronize()

        ours()
        idx_s, idx_d = torch.as_tensor(src, device=pool.device), torch.as_tensor(dst, device=pool.device)
        if not torch.equal(pool.tensor[idx_s], pool.tensor[idx_d]):
            raise AssertionError("device page copy changed the bytes")
        t_ours, t_base = paired_seconds(
            timed(ours), timed(raw), settings.repeats, settings.warmup, settings.warm_s
        )
        nbytes = n * page
        name = f"d2d batched {page_kib}KiB x{n}"
        gpu_ours = _gpu_seconds(pool.copier.streams["d2d"], lambda: pool.copy_slots(src, dst), settings)
        gpu_raw = _gpu_seconds(torch.cuda.current_stream(), lambda: b.copy_(a), settings)
        return [
            Row(name, nbytes / t_ours / 1e9, nbytes / t_base / 1e9, "GB/s", GOAL),
            Row(f"{name} GPU time", nbytes / gpu_ours / 1e9, nbytes / gpu_raw / 1e9, "GB/s"),
        ]
    finally:
        pool.close()


def _gpu_seconds(stream: Any, enqueue: Callable[[], object], settings: GpuSettings) -> float:
    """Median seconds the GPU spends on what ``enqueue`` puts on ``stream``, host work excluded:
    the stream first sleeps ~2 ms on the GPU, so the copy is queued before the start event is
    reached (CUDA events, not the host clock)."""
    import torch

    times = []
    for _ in range(settings.warmup + settings.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(4_000_000)
            start.record(stream)
        enqueue()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times[settings.warmup :]))


def _require_cuda() -> list[Row]:
    raise CudaError("the gpu suite needs torch with a CUDA device", cuda_error="cudaErrorNoDevice")


def describe() -> str:
    """Device, torch version and how the pool is backed (VMM or plain allocation)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        name = torch.cuda.get_device_name()
    except ImportError:
        return "no torch"
    vmm = "off (RAYKV_GPU_VMM=0)" if os.environ.get("RAYKV_GPU_VMM") == "0" else "on"
    method = os.environ.get("RAYKV_GPU_COPY", "auto")
    return f"{name}, torch {torch.__version__}, VMM {vmm}, copy method {method}"


def gpu_benchmarks(settings: GpuSettings) -> list[Benchmark]:
    """The suite's benchmarks (one error row when there is no CUDA device)."""
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    if not has_cuda:
        return [Benchmark("gpu copies", _require_cuda)]
    benches: list[Benchmark] = []
    for kib in PAGE_KIB:
        benches.append(
            Benchmark(f"gpu<->host {kib}KiB", functools.partial(host_copy_benchmark, settings, kib))
        )
    for kib in PAGE_KIB:
        benches.append(Benchmark(f"d2d {kib}KiB", functools.partial(d2d_benchmark, settings, kib)))
    return benches


def suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The suite's benchmarks and description line (``quick``: CI mode)."""

    settings = QUICK if quick else FULL
    desc = (
        f"{'quick' if quick else 'full'} mode, {settings.total_bytes >> 20} MiB per host batch, "
        f"{settings.d2d_bytes >> 20} MiB per device batch, median of {settings.repeats}; {describe()}"
    )
    return gpu_benchmarks(settings), desc


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import module_main

    sys.exit(module_main("gpu", suite))

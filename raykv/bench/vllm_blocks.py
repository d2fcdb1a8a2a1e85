"""The vLLM connector's block copies (BlockCopier) vs raw torch copies of the same bytes.

``python -m raykv.bench.vllm_blocks [--quick] [--device cuda|cpu] [--repeats N]`` prints one table.
No vLLM needed: the engine's KV tensors are built as vLLM 0.32 registers them with a connector
(:func:`raykv.integrations.vllm.testing.vllm_kv_caches`), one per layer, in the physical orders
that matter on a GPU: ``LBNHC`` (vLLM's default, "NHD"), ``LBHNC`` ("HND", FlashInfer on
Blackwell) and ``BLNHC`` (blocks outermost, each block holds every layer's page); on
``--device cpu`` the CPU backend's ``LBHNC`` and ``LBNHC``.

For layer-blocks (one layer's K and V of one block: 8 KV heads x 128, bfloat16) of 64 KiB
(16 tokens) and 512 KiB (128 tokens), 4 layers (2 with ``--quick``), engines of 512 blocks of
which 256 move; and for an MLA engine's latents (``mla``: 576 bfloat16 per token, DeepSeek-V3's,
in 64-token blocks: 72 KiB layer-blocks):

* ``save``: ``BlockCopier.save`` of 256 blocks at random ids into token-major page rows (a
  pageable numpy array, as the connector's staging pages are): per layer one gather on the
  device into a staging buffer, one device-to-host copy into pinned memory per chunk, then a
  host copy into the rows. Baseline: one ``copy_(non_blocking=True)`` of a device tensor of the
  same bytes into a pinned host tensor, then a stream synchronize.
* ``load``: ``BlockCopier.load`` of those rows into 256 random blocks (host copy into pinned
  memory, one host-to-device copy per chunk, one scatter per layer). Baseline: the raw copy the
  other way.
* ``run``: the same with 256 consecutive block ids (slices instead of gathers), NHD only.
* ``load from GPU pages`` (CUDA): ``BlockCopier.load_device`` of 256 pages of a device tensor
  (what a CacheWorker's GPU tier is once mapped into the engine) into 256 blocks: per chunk one
  gather of the pages (none for a run of slots) and one scatter per layer. Baseline: one raw
  device-to-device copy of the same bytes.

Figures are GB/s (1e9 page bytes per second), the median of ``repeats`` samples taken
alternately with the baseline, wall clock from the call until the copy is done, after untimed
pairs for at least ``warm_s`` (an idle GPU clocks down, and a few samples of 50-100 us do not
bring it back: the block kernel measured 0.69-0.71x of the raw copy at 64 MiB with 3 warm-up
pairs against 0.79-0.81x once warm, 1x H200). Before timing,
the rows saved from one engine are loaded into another and compared byte for byte.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass

import numpy as np

from raykv.bench.harness import Benchmark, Row, paired_seconds, run_suite, timed
from raykv.core.config import KVLayout

LAYER_BLOCK_KIB = {64: 16, 512: 128}
"""Layer-block KiB -> tokens per block (8 heads x 128, bfloat16: 4 KiB of K and V per token)."""
HEADS, HEAD, DTYPE = 8, 128, "bfloat16"
BLOCKS = 256
MLA_LATENT, MLA_TOKENS = 576, 64
"""MLA rows (``kind`` ``"mla"``): DeepSeek-V3's latent (512 + 64 bfloat16 per token) in blocks of
64 tokens (FlashMLA's): 72 KiB layer-blocks."""


@dataclass(frozen=True)
class Settings:
    layers: int
    repeats: int
    warmup: int
    warm_s: float
    """Untimed pairs for at least this long before each row's samples (GPU clocks up)."""


FULL = Settings(layers=4, repeats=15, warmup=3, warm_s=0.25)
QUICK = Settings(layers=2, repeats=5, warmup=2, warm_s=0.05)

ENGINES = {
    "cuda": (("flash_attn", "LBNHC"), ("flashinfer", "LBHNC"), ("flash_attn", "BLNHC")),
    "cpu": (("cpu", "LBHNC"), ("flash_attn", "LBNHC")),
}
"""Per device: (``kv_cache_layout``, vLLM's physical order) of the engines measured."""
MLA_ENGINE = ("mla", "LBNHC")


class _Case:
    """Two engines of one layout and order, the page rows, the block ids and the raw buffers."""

    def __init__(
        self,
        settings: Settings,
        kib: int,
        kind: str,
        order: str,
        device: str,
        run: bool,
        pinned: bool = False,
    ) -> None:
        import torch

        from raykv.integrations.vllm.copier import BlockCopier
        from raykv.integrations.vllm.layout import mla_layout
        from raykv.integrations.vllm.testing import vllm_kv_caches

        self.torch, self.device = torch, torch.device(device)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(settings.layers)]
        if kind == "mla":
            layout = mla_layout(settings.layers, MLA_LATENT, MLA_TOKENS, DTYPE)
            shape = (names, 2 * BLOCKS, 1, MLA_TOKENS, 0, DTYPE, device, order)
            cells: int | None = MLA_LATENT
        else:
            tokens = LAYER_BLOCK_KIB[kib]
            layout = KVLayout.uniform(settings.layers, HEADS, HEAD, tokens, DTYPE)
            shape = (names, 2 * BLOCKS, HEADS, tokens, HEAD, DTYPE, device, order)
            cells = None
        self.src = vllm_kv_caches(*shape, cells=cells)
        self.dst = vllm_kv_caches(*shape, cells=cells)
        for tensor in self.src.values():
            tensor.normal_()
        self.copy_src = BlockCopier(layout, names, self.src, kind)
        self.copy_dst = BlockCopier(layout, names, self.dst, kind)
        rng = np.random.default_rng(kib)
        picks = [[int(b) for b in rng.permutation(2 * BLOCKS)[:BLOCKS]] for _ in range(2)]
        if run:
            picks = [list(range(BLOCKS)), list(range(BLOCKS, 2 * BLOCKS))]
        self.ids: list[int] = picks[0]
        self.into: list[int] = picks[1]
        cuda = self.device.type == "cuda"
        if pinned and cuda:  # page rows in page-locked memory (a pinned tier, a registered buffer)
            self.rows = torch.zeros((BLOCKS, layout.page_bytes), dtype=torch.uint8, pin_memory=True).numpy()
        else:
            self.rows = np.zeros((BLOCKS, layout.page_bytes), dtype=np.uint8)
        self.nbytes = self.rows.nbytes
        self.raw_dev = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.raw_host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=cuda)

    def save(self) -> None:
        self.copy_src.save(self.ids, self.rows)

    def load(self) -> None:
        self.copy_dst.load(self.rows, self.into)

    def raw(self, d2h: bool) -> None:
        cuda = self.device.type == "cuda"
        if d2h:
            self.raw_host.copy_(self.raw_dev, non_blocking=cuda)
        else:
            self.raw_dev.copy_(self.raw_host, non_blocking=cuda)
        if cuda:
            self.torch.cuda.current_stream(self.device).synchronize()

    def check(self) -> None:
        """Blocks saved from ``src`` and loaded into ``dst`` are the same bytes."""
        torch = self.torch
        self.save()
        self.load()
        ids, into = (torch.as_tensor(x, device=self.device) for x in (self.ids, self.into))
        for name, tensor in self.src.items():
            want, got = tensor.index_select(0, ids), self.dst[name].index_select(0, into)
            if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
                raise AssertionError(f"{name}: blocks changed on the way engine -> page -> engine")


def copy_benchmark(
    settings: Settings, kib: int, kind: str, order: str, device: str, run: bool, pinned: bool = False
) -> list[Row]:
    """GB/s of BlockCopier save and load vs raw copies of the same bytes (``pinned``: the page
    rows are page-locked, so the copier DMAs them directly)."""
    case = _Case(settings, kib, kind, order, device, run, pinned)
    case.check()
    rows_kind = " pinned rows" if pinned else ""
    label = f"{kind}/{order} {'run' if run else 'scattered'}{rows_kind} {kib}KiB x{BLOCKS}x{settings.layers}L"
    rows = []
    for name, fn, d2h in (("save", case.save, True), ("load", case.load, False)):
        base = timed(functools.partial(case.raw, d2h))
        t_ours, t_base = paired_seconds(timed(fn), base, settings.repeats, settings.warmup, settings.warm_s)
        raw = "d2h" if d2h else "h2d"
        info = f"baseline: raw {raw}" if device == "cuda" else "baseline: host memcpy"
        ours, baseline = case.nbytes / t_ours / 1e9, case.nbytes / t_base / 1e9
        rows.append(Row(f"{name} {label}", ours, baseline, "GB/s", info=info))
    return rows


def gpu_pages_benchmark(settings: Settings, kib: int, kind: str, order: str, run: bool) -> list[Row]:
    """GB/s of ``BlockCopier.load_device`` (pages of a GPU tier, as a CacheWorker's tier mapped
    into the engine, into engine blocks) vs a raw device copy of the same bytes."""
    case = _Case(settings, kib, kind, order, "cuda", run)
    torch = case.torch
    slots = (
        case.into
        if run
        else [int(b) for b in np.random.default_rng(kib + 1).permutation(2 * BLOCKS)[:BLOCKS]]
    )
    pages = torch.zeros((2 * BLOCKS, case.rows.shape[1]), dtype=torch.uint8, device=case.device)
    case.save()
    pages[torch.as_tensor(slots, device=case.device)] = torch.from_numpy(case.rows).to(case.device)

    def load() -> None:
        case.copy_dst.load_device(pages, slots, case.into)

    load()
    ids, into = (torch.as_tensor(x, device=case.device) for x in (case.ids, case.into))
    for name, tensor in case.src.items():
        if not torch.equal(
            tensor.index_select(0, ids).view(torch.int16),
            case.dst[name].index_select(0, into).view(torch.int16),
        ):
            raise AssertionError(f"{name}: blocks changed on the way engine -> GPU page -> engine")
    other = torch.empty_like(case.raw_dev)

    def raw() -> None:
        other.copy_(case.raw_dev)
        torch.cuda.current_stream(case.device).synchronize()

    t_ours, t_base = paired_seconds(
        timed(load), timed(raw), settings.repeats, settings.warmup, settings.warm_s
    )
    label = f"{kind}/{order} {'run' if run else 'scattered'} {kib}KiB x{BLOCKS}x{settings.layers}L"
    ours, baseline = case.nbytes / t_ours / 1e9, case.nbytes / t_base / 1e9
    return [Row(f"load from GPU pages {label}", ours, baseline, "GB/s", info="baseline: raw d2d")]


def benchmarks(settings: Settings, device: str) -> list[Benchmark]:
    out = []
    for kib in LAYER_BLOCK_KIB:
        for kind, order in ENGINES[device]:
            fn = functools.partial(copy_benchmark, settings, kib, kind, order, device, False)
            out.append(Benchmark(f"{kind}/{order} {kib}KiB", fn))
        kind, order = ENGINES[device][0]
        fn = functools.partial(copy_benchmark, settings, kib, kind, order, device, True)
        out.append(Benchmark(f"{kind}/{order} run {kib}KiB", fn))
        if device == "cuda":
            fn = functools.partial(copy_benchmark, settings, kib, kind, order, device, False, True)
            out.append(Benchmark(f"{kind}/{order} pinned rows {kib}KiB", fn))
            for run in (False, True):
                fn = functools.partial(gpu_pages_benchmark, settings, kib, kind, order, run)
                out.append(Benchmark(f"{kind}/{order} GPU pages {'run ' if run else ''}{kib}KiB", fn))
    return out + _mla_benchmarks(settings, device)


def _mla_benchmarks(settings: Settings, device: str) -> list[Benchmark]:
    """MLA latent caches (:data:`MLA_LATENT` x :data:`MLA_TOKENS`): scattered saves and loads,
    and on CUDA the same with page-locked rows and loads from GPU pages."""
    kind, order = MLA_ENGINE
    kib = MLA_LATENT * 2 * MLA_TOKENS // 1024
    out = [
        Benchmark(
            f"{kind} {kib}KiB", functools.partial(copy_benchmark, settings, kib, kind, order, device, False)
        )
    ]
    if device == "cuda":
        fn = functools.partial(copy_benchmark, settings, kib, kind, order, device, False, True)
        out.append(Benchmark(f"{kind} pinned rows {kib}KiB", fn))
        fn = functools.partial(gpu_pages_benchmark, settings, kib, kind, order, False)
        out.append(Benchmark(f"{kind} GPU pages {kib}KiB", fn))
    return out


def describe(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=sorted(ENGINES), default="cuda")
    parser.add_argument("--repeats", type=int, help="timed samples per row (default 5 quick, 15 full)")
    opts = parser.parse_args(argv)
    settings = QUICK if opts.quick else FULL
    if opts.repeats:
        settings = Settings(settings.layers, opts.repeats, settings.warmup, settings.warm_s)
    desc = (
        f"{'quick' if opts.quick else 'full'} mode, {BLOCKS} blocks of {settings.layers} layers, "
        f"{HEADS} heads x {HEAD} {DTYPE}, median of {settings.repeats}; {describe(opts.device)}"
    )
    return run_suite("vllm_blocks", benchmarks(settings, opts.device), desc, sys.stdout, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

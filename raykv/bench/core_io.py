"""Host <-> disk benchmarks of the core suite.

* ``copy host->host``: ``CopyEngine.copy`` between two batches of host slots vs ``np.copyto`` of
  the same bytes between two contiguous arrays (the memory-bandwidth floor).
* ``demote host->disk`` / ``promote disk->host``: ``CopyEngine.copy`` between a HostPool (level 0)
  and a DiskPool (level 1) vs one ``os.pwrite`` / one ``os.preadv`` (a pread into an existing buffer)
  of one contiguous buffer of the same bytes, in a file in the disk tier's own directory.
* ``checksum <function>``: per-page checksums of a batch of pages, as the disk tier computes them
  on every write and read (``zlib.crc32``; ISA-L's ``crc32`` when ``isal`` is installed, the one
  the tier uses then; ``xxhash.xxh3_64`` when ``xxhash`` is installed, for comparison) vs one
  ``np.copyto`` of the same bytes (a memcpy). ``demote``/``promote`` above include them.
* ``manager demotion``: a host tier full of committed blocks; ``extend`` of a new request needs N
  fresh pages, which demotes the N coldest blocks to disk (planning, copy, re-pointing, events).
  Timed is the ``extend`` call; the floor is one ``os.pwrite`` of the same number of bytes.

Page contents are random bytes written before timing (no untouched zero pages). Files go to the
page cache; these are not fsync'd durability figures, for ours or for the baseline.
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

import numpy as np
import numpy.typing as npt

from raykv.bench.core_settings import CoreSettings
from raykv.bench.harness import Row, paired_seconds, timed
from raykv.core.config import CacheConfig, KVLayout, TierConfig
from raykv.core.manager import CacheManager
from raykv.core.tiers.disk import DiskPool
from raykv.core.tiers.host import HostPool
from raykv.core.types import PageId

VOCAB = 32_000


def page_layout(page_kib: int) -> KVLayout:
    """A layout whose page is exactly ``page_kib`` KiB (a multiple of 64).

    Each layer is 64 KiB: K and V of 16 tokens x 8 heads x 128 dims in float16.
    """
    layout = KVLayout.uniform(page_kib // 64, 8, 128, tokens_per_block=16)
    if layout.page_bytes != page_kib * 1024:
        raise ValueError(f"page_kib must be a multiple of 64, got {page_kib}")
    return layout


def fill_random(array: npt.NDArray[np.uint8], seed: int) -> None:
    """Overwrite ``array`` with random bytes (faults every page in; nothing stays a zero page)."""
    flat = array.reshape(-1)
    flat[:] = np.frombuffer(np.random.default_rng(seed).bytes(flat.size), dtype=np.uint8)


@contextmanager
def scratch_file(directory: str, nbytes: int) -> Iterator[int]:
    """File descriptor of a preallocated file in ``directory`` (like the disk tier's), removed on exit."""
    fd, path = tempfile.mkstemp(prefix="bench-", suffix=".bin", dir=directory)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        yield fd
    finally:
        os.close(fd)
        os.unlink(path)


def _pools(mgr: CacheManager) -> tuple[HostPool, DiskPool]:
    host, disk = mgr.pools[0], mgr.pools[1]
    if not isinstance(host, HostPool) or not isinstance(disk, DiskPool):
        raise TypeError("expected a host tier at level 0 and a disk tier at level 1")
    return host, disk


def _pwrite(fd: int, data: npt.NDArray[np.uint8]) -> None:
    """Raw floor for a demotion: one pwrite of the whole contiguous buffer at offset 0."""
    if os.pwrite(fd, data.data, 0) != data.nbytes:
        raise OSError("short pwrite")


def _pread(fd: int, out: npt.NDArray[np.uint8]) -> None:
    """Raw floor for a promotion: one pread (``preadv`` of a single buffer) into ``out``."""
    if os.preadv(fd, [out.data], 0) != out.nbytes:
        raise OSError("short pread")


def copy_benchmark(settings: CoreSettings, page_kib: int) -> list[Row]:
    """host->host, host->disk and disk->host MB/s of ``CopyEngine.copy`` for one page size."""
    layout = page_layout(page_kib)
    page, batch = layout.page_bytes, settings.copy_batch
    config = CacheConfig(layout, (TierConfig.host(2 * batch * page), TierConfig.disk(batch * page)))
    with CacheManager(config) as mgr:
        host, disk = _pools(mgr)
        src, dst, on_disk = host.allocate(batch), host.allocate(batch), disk.allocate(batch)
        fill_random(host.array, seed=page_kib)
        with scratch_file(disk.directory, batch * page) as fd:
            return _copy_rows(mgr, (src, dst, on_disk), fd, settings, f"{page_kib}KiB x{batch}")


def _copy_rows(
    mgr: CacheManager,
    slots: tuple[list[PageId], list[PageId], list[PageId]],
    fd: int,
    settings: CoreSettings,
    label: str,
) -> list[Row]:
    """Time the three copy directions against their raw floors (one contiguous buffer each)."""
    host, _disk = _pools(mgr)
    src, dst, on_disk = slots
    copy = mgr.copy.copy
    copy(0, src, 1, on_disk)
    copy(1, on_disk, 0, dst)
    if not np.array_equal(host.array[src], host.array[dst]):
        raise AssertionError("host -> disk -> host round trip changed the bytes")
    raw_src = np.array(host.array[src])
    raw_dst = np.empty_like(raw_src)
    _pwrite(fd, raw_src)
    _pread(fd, raw_dst)
    if not np.array_equal(raw_src, raw_dst):
        raise AssertionError("raw pwrite/pread round trip changed the bytes")
    nbytes = raw_src.nbytes
    cases = [
        (
            "copy host->host",
            functools.partial(copy, 0, src, 0, dst),
            functools.partial(np.copyto, raw_dst, raw_src),
        ),
        (
            "demote host->disk",
            functools.partial(copy, 0, src, 1, on_disk),
            functools.partial(_pwrite, fd, raw_src),
        ),
        (
            "promote disk->host",
            functools.partial(copy, 1, on_disk, 0, dst),
            functools.partial(_pread, fd, raw_dst),
        ),
    ]
    rows = []
    for name, ours, base in cases:
        t_ours, t_base = paired_seconds(timed(ours), timed(base), settings.copy_repeats, settings.warmup)
        rows.append(Row(f"{name} {label}", nbytes / t_ours / 1e6, nbytes / t_base / 1e6, "MB/s"))
    return rows


def checksum_functions() -> list[tuple[str, Callable[[memoryview], int]]]:
    """(name, function of one page's buffer) of each checksum candidate installed here."""
    found: list[tuple[str, Callable[[memoryview], int]]] = [("zlib.crc32", zlib.crc32)]
    for module, name, label in (
        ("isal.isal_zlib", "crc32", "isal crc32"),
        ("xxhash", "xxh3_64_intdigest", "xxh3_64"),
    ):
        try:
            found.append((label, getattr(importlib.import_module(module), name)))
        except ImportError:
            pass
    return found


def checksum_benchmark(settings: CoreSettings) -> list[Row]:
    """MB/s of per-page checksums over a batch of 64 KiB and of 512 KiB pages vs a memcpy."""
    rows = []
    for kib in (64, 512):
        batch = settings.copy_batch
        pages = np.empty((batch, kib * 1024), dtype=np.uint8)
        fill_random(pages, seed=kib)
        copy = np.empty_like(pages)
        views = [memoryview(pages[i]) for i in range(batch)]
        memcpy = timed(functools.partial(np.copyto, copy, pages))
        for name, fn in checksum_functions():
            ours = timed(functools.partial(_sum_pages, fn, views))
            t_ours, t_base = paired_seconds(ours, memcpy, settings.copy_repeats, settings.warmup)
            label = f"checksum {name} {kib}KiB x{batch}"
            rows.append(Row(label, pages.nbytes / t_ours / 1e6, pages.nbytes / t_base / 1e6, "MB/s"))
    return rows


def _sum_pages(fn: Callable[[memoryview], int], views: list[memoryview]) -> list[int]:
    return [fn(view) for view in views]


def commit_new(mgr: CacheManager, tokens: npt.NDArray[np.int32]) -> int:
    """A new request's whole lifecycle, as an engine runs it: ``create`` with the whole prompt
    (keys it, matches the cached prefix), resume, extend with the tokens not reused, commit,
    close. Returns how many blocks were newly committed."""
    cache = mgr.create(tokens)
    try:
        if not cache.resume():
            raise RuntimeError("resume refused")
        cache.extend(tokens[cache.num_reused_tokens :])
        return cache.commit()
    finally:
        cache.close()


def _demote_once(
    mgr: CacheManager, fills: list[npt.NDArray[np.int32]], tokens: npt.NDArray[np.int32]
) -> float:
    """Seconds of one ``extend`` that must demote ``len(tokens) // 16`` committed pages to disk.

    Untimed setup: drop every block, refill the host tier by committing ``fills``, open and resume
    a request for ``tokens``. Untimed teardown: close it (its private pages are freed).
    """
    mgr.clear_reusable()
    for prompt in fills:
        commit_new(mgr, prompt)
    expect = len(tokens) // mgr.tokens_per_block
    if mgr.pools[0].num_free != 0 or mgr.pools[1].num_free < expect:
        raise AssertionError("setup: the host tier must be full and the disk tier have room")
    with mgr.create(tokens) as cache:
        if not cache.resume():
            raise RuntimeError("resume refused")
        before = mgr.counters.demotions[0]
        start = perf_counter()
        cache.extend(tokens)
        elapsed = perf_counter() - start
        moved = mgr.counters.demotions[0] - before
    if moved != expect:
        raise AssertionError(f"extend demoted {moved} pages, expected {expect}")
    return elapsed


def demotion_benchmark(settings: CoreSettings) -> list[Row]:
    """MB/s of a manager-level demotion of N pages (64 KiB) forced by ``extend`` vs one pwrite."""
    layout = page_layout(64)
    page, n = layout.page_bytes, settings.demote_pages
    config = CacheConfig(layout, (TierConfig.host(2 * n * page), TierConfig.disk(n * page)))
    rng = np.random.default_rng(11)
    fills = [rng.integers(0, VOCAB, n * 16, dtype=np.int32) for _ in range(2)]
    tokens = rng.integers(0, VOCAB, n * 16, dtype=np.int32)
    with CacheManager(config) as mgr:
        host, disk = _pools(mgr)
        fill_random(host.array, seed=5)
        raw = np.empty(n * page, dtype=np.uint8)
        fill_random(raw, seed=6)
        with scratch_file(disk.directory, raw.nbytes) as fd:
            t_ours, t_base = paired_seconds(
                functools.partial(_demote_once, mgr, fills, tokens),
                timed(functools.partial(_pwrite, fd, raw)),
                settings.demote_repeats,
                settings.warmup,
            )
    name = f"manager demotion 64KiB x{n} (extend)"
    return [Row(name, raw.nbytes / t_ours / 1e6, raw.nbytes / t_base / 1e6, "MB/s")]


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import part_of

    sys.exit(part_of("core"))

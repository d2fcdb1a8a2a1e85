"""Page-transfer benchmarks (``raykv bench transfer``): pull bandwidth against same-run baselines.

A peer process (:class:`BenchPeer` in a spawned helper; ``actors.cache.transfer`` runs the same class as
a Ray actor for the object-store row) holds, per page size, a manager whose shared host tier
holds a committed chain of blocks, and serves it with a PageServer. This process pulls the first
N blocks, which sit in consecutive slots (sent in place, copied with one memcpy). Rows, each
moving the same bytes between the same two processes in the same run:

- ``shm_read pull``: what a same-node pull does by default once connected: a one-sided read
  (:mod:`raykv.transfer.paths.shm_read`: slots from the owner's directory, one copy out of its mapping,
  generations checked, no request) vs a plain ``np.copyto`` of the same pages out of the same
  mapping. Goal >= 0.5x.
- ``shm pull``: the same-node request path (one-sided reads off: request, header, one copy out of
  the owner's mapping, no checksums: the owner acknowledges the lease instead) vs the same memcpy.
- ``ucx pull``: the UCX path (per-page CRC-32 on both sides, overlapped with the transfer) vs raw
  ucxx: one request message, then one contiguous buffer of the same size sent with ucxx from the
  peer's tier memory. Goal >= 0.8x for 16 pages or more.

For 16 pages or more also:

- ``... pull+import``: ``pull_into`` a manager's top tier (what ``CacheWorker.pull`` does): over
  shm one copy from the owner's mapping into the tier, over ucx one copy from the receive buffer.
  The destination is emptied (untimed) before each sample.
- ``shm pull ..., verified``: the shm pull with ``verify=True`` (CRC-32 on both sides).
- ``ucx pull ..., no receiver CRC``: ``verify=False`` (``import_pages`` then checks the pages).

CRC-32 runs about ten times faster with the optional ``isal`` package installed (the same values;
see :func:`raykv.core.records.page_checksum`); on a machine with few cores the CRC passes, not the
transport, bound the ucx figures without it. Pulls land in a preallocated buffer
(``PageClient.pull(out=...)``), as the baselines do. Both processes use ``UCX_TLS=tcp,self``
unless UCX_TLS is set: two nodes would talk TCP, not shared memory. Figures are MB/s (10^6 bytes
per second).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import multiprocessing.connection
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from raykv.bench.harness import Benchmark, Row, Sampler, paired_seconds, timed
from raykv.core.config import CacheConfig, KVLayout, TierConfig
from raykv.core.manager import CacheManager
from raykv.core.records import crc32
from raykv.transfer import PageClient, PageServer, PeerAddress, TransferConfig, get_runtime, pull_into
from raykv.transfer.net.runtime import (
    active_transports,
    configure_ucx,
    ucx_address,
    ucx_context,
    ucx_endpoint,
)
from raykv.transfer.pages.shm import ShmMapping
from raykv.transfer.paths.importer import pull_into_local

KIB = 1024
RAW_REQUEST_TAG = 0x5241574B56  # "RAWKV"
TPB = 16
SHORT_ROW_BYTES = 1 << 20
"""Rows moving at most this many bytes (a few us to a few ms per sample) take ``short_factor``
times the samples and at least ``short_warmup`` warmups: Python 3.11+ specializes a function's
bytecode only after it ran 8 times, so the first samples of a one-sided pull would time cold code
(its memcpy baseline is one C call), and a median of 9 samples of a few us is noisy."""


@dataclass(frozen=True)
class TransferSettings:
    page_sizes: tuple[int, ...]
    counts: tuple[int, ...]
    repeats: int
    warmup: int
    short_factor: int = 3  # see SHORT_ROW_BYTES
    short_warmup: int = 20


QUICK = TransferSettings(page_sizes=(64 * KIB, 2048 * KIB), counts=(1, 16), repeats=7, warmup=2)
FULL = TransferSettings(
    page_sizes=(64 * KIB, 512 * KIB, 2048 * KIB), counts=(1, 16, 256), repeats=9, warmup=2
)


def bench_config(ucx_tls: str = "tcp,self") -> TransferConfig:
    return TransferConfig.loopback(ucx_tls=ucx_tls, timeout_s=300.0)


def layout_for(page_bytes: int) -> KVLayout:
    """A float16 layout of 8 heads x 128 dims x 16 tokens with ``page_bytes`` per page."""
    per_layer = 2 * 8 * 128 * TPB * 2
    if page_bytes % per_layer:
        raise ValueError(f"page size {page_bytes} is not a multiple of {per_layer}")
    return KVLayout.uniform(page_bytes // per_layer, 8, 128, tokens_per_block=TPB)


def label(count: int, page_bytes: int) -> str:
    size = f"{page_bytes // KIB} KiB" if page_bytes < 1 << 20 else f"{page_bytes >> 20} MiB"
    return f"{count} x {size}"


class BenchPeer:
    """The serving side: per page size, a shared-tier manager with a committed chain + server."""

    def __init__(
        self, page_sizes: tuple[int, ...], max_pages: int, token: bytes, config: TransferConfig
    ) -> None:
        self.token = token
        self.managers: dict[int, CacheManager] = {}
        self.servers: dict[int, PageServer] = {}
        self.keys: dict[int, list[bytes]] = {}
        self._raw: asyncio.Future[Any] | None = None
        for page in page_sizes:
            layout = layout_for(page)
            tiers = (TierConfig.host((max_pages + 1) * page, pin_memory=False, shared=True),)
            mgr = CacheManager(CacheConfig(layout, tiers))
            self.managers[page] = mgr
            self.keys[page] = _commit_chain(mgr, max_pages)
            self.servers[page] = PageServer(mgr, token, config)
            self.servers[page].start()

    def info(self) -> dict[int, tuple[PeerAddress, list[bytes], str]]:
        """Per page size: the server address, the chain's keys, the shared tier's file."""
        out = {}
        for page, mgr in self.managers.items():
            address = self.servers[page].address
            assert address is not None
            out[page] = (address, self.keys[page], str(getattr(mgr.pools[0], "shm_path", "")))
        return out

    def ucx_address(self) -> bytes:
        return get_runtime().run(_address(), 30)

    def start_raw(self, client_address: bytes) -> None:
        """Serve raw-ucxx requests from the client at ``client_address`` (baseline)."""
        memory = {page: mgr.pools[0].array.reshape(-1) for page, mgr in self.managers.items()}  # type: ignore[attr-defined]
        self._raw = get_runtime().submit(_raw_server(client_address, memory))  # type: ignore[assignment]

    def array(self, page_bytes: int, count: int) -> np.ndarray:
        """The first ``count`` pages, in place (returned through Ray, they go via the object store)."""
        return self.managers[page_bytes].pools[0].array[:count]  # type: ignore[attr-defined, no-any-return]

    def close(self) -> None:
        if self._raw is not None:
            self._raw.cancel()
        for server in self.servers.values():
            server.close()
        for mgr in self.managers.values():
            mgr.shutdown()


def _commit_chain(mgr: CacheManager, count: int) -> list[bytes]:
    """Commit one request of ``count`` full blocks (cheap fill: page i holds byte i % 251)."""
    tokens = list(range(count * TPB))
    with mgr.create(tokens) as cache:
        assert cache.resume()
        cache.extend(tokens)
        for i in range(count):
            cache.page(i)[:] = i % 251
        cache.commit()
        return [bytes(cache.block_key(i)) for i in range(count)]


async def _address() -> bytes:
    return ucx_address(ucx_context())


async def _raw_server(client_address: bytes, memory: dict[int, np.ndarray]) -> None:
    """Raw baseline: receive (page size, bytes, tag), send that many bytes of the tier in one go."""
    ctx = ucx_context()
    endpoint = await ucx_endpoint(ctx, client_address)
    request = np.empty(3, dtype=np.uint64)
    while True:
        await ctx.recv(request, RAW_REQUEST_TAG)
        page, nbytes, tag = (int(x) for x in request)
        await endpoint.send(memory[page][:nbytes], tag=tag, force_tag=True)


def _helper_main(conn: multiprocessing.connection.Connection, args: tuple[Any, ...]) -> None:
    """The spawned peer process: build a BenchPeer, answer commands on ``conn`` until "close"."""
    peer = BenchPeer(*args)
    conn.send((peer.info(), peer.ucx_address()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "raw":
            peer.start_raw(arg)
            conn.send(None)
        elif cmd == "close":
            peer.close()
            conn.send(None)
            return


class _Client:
    """This process's side: a PageClient, raw ucxx endpoint, shm mappings, receive buffers, and
    per page size a destination manager for the pull+import rows (its tier pre-touched)."""

    def __init__(self, token: bytes, config: TransferConfig, info: dict[int, Any], peer_ucx: bytes) -> None:
        self.client = PageClient(token, config.replace(use_shm_read=False))  # the request paths
        self.local = PageClient(token, config)  # one-sided same-node reads (the default)
        self.info = info
        self.runtime = get_runtime()
        self.runtime.run(self._connect(peer_ucx), 60)
        self.maps = {page: ShmMapping(path, len(keys) + 1, page) for page, (_, keys, path) in info.items()}
        self.dst: dict[int, CacheManager] = {}
        for page, (_, keys, _) in info.items():
            tier = TierConfig.host(len(keys) * page, pin_memory=False)
            self.dst[page] = CacheManager(CacheConfig(layout_for(page), (tier,)))
            self.dst[page].pools[0].array.fill(0)  # type: ignore[attr-defined]

    async def _connect(self, peer_ucx: bytes) -> None:
        self.ctx = ucx_context()
        self.endpoint = await ucx_endpoint(self.ctx, peer_ucx)

    @property
    def my_address(self) -> bytes:
        return ucx_address(self.ctx)

    def pull(self, page: int, count: int, shm: bool, out: np.ndarray, verify: bool | None = None) -> None:
        address, keys, _ = self.info[page]
        pull = self.client.pull(address, keys[:count], shm, out=out, verify=verify)
        pulled = self.client.runtime.run(pull, 300)
        assert len(pulled.keys) == count and pulled.path == ("shm" if shm else "ucx"), pulled.path

    def local_sampler(self, page: int, count: int, out: np.ndarray) -> Sampler:
        """Times one one-sided pull (``PageClient.pull_sync`` in this thread; the first one
        connects), checking its result after the clock stopped (the memcpy has no checks)."""
        address, keys, _ = self.info[page]
        keys, pull = keys[:count], self.local.pull_sync

        def sample() -> float:
            start = time.perf_counter()
            pulled = pull(address, keys, out=out)
            seconds = time.perf_counter() - start
            assert len(pulled.keys) == count and pulled.path in ("shm_read", "shm"), pulled.path
            return seconds

        return sample

    def import_sampler(self, page: int, count: int, shm: bool, one_sided: bool = False) -> Sampler:
        """Times one ``pull_into`` of ``count`` pages (emptying the destination first, untimed)."""
        address, keys, _ = self.info[page]
        dst = self.dst[page]
        client = self.local if one_sided else self.client
        paths = ("shm_read", "shm") if one_sided else ("shm",) if shm else ("ucx",)

        def sample() -> float:
            dst.clear_reusable()
            start = time.perf_counter()
            outcome = pull_into_local(client, address, dst, keys[:count]) if one_sided else None
            if outcome is None:
                outcome = self.runtime.run(pull_into(client, address, dst, keys[:count], shm), 300)
            seconds = time.perf_counter() - start
            assert len(outcome.imported) == count and outcome.path in paths, outcome.path
            return seconds

        return sample

    def raw(self, page: int, nbytes: int, out: np.ndarray) -> None:
        self.runtime.run(self._raw(page, nbytes, out.reshape(-1)[:nbytes]), 300)

    async def _raw(self, page: int, nbytes: int, out: np.ndarray) -> None:
        tag = secrets.randbits(48)
        recv = asyncio.ensure_future(self.endpoint.recv(out, tag=tag, force_tag=True))
        request = np.array([page, nbytes, tag], dtype=np.uint64)
        await self.endpoint.send(request, tag=RAW_REQUEST_TAG, force_tag=True)
        await recv

    def close(self) -> None:
        for mapping in self.maps.values():
            mapping.close()
        self.client.close()
        self.local.close()
        for mgr in self.dst.values():
            mgr.shutdown()


def _rows(cl: _Client, settings: TransferSettings) -> list[Row]:
    rows: list[Row] = []
    for page in settings.page_sizes:
        out = np.empty((max(settings.counts), page), dtype=np.uint8)
        out.fill(0)  # touch every page: no first-touch faults inside the timings
        for count in settings.counts:
            rows.extend(_size_rows(cl, settings, page, count, out[:count]))
    return rows


def _size_rows(cl: _Client, settings: TransferSettings, page: int, count: int, dst: np.ndarray) -> list[Row]:
    """The rows of one (page size, page count): each path against its baseline; for 16 pages or
    more also pull+import and each path with the other checksum setting (module docstring)."""
    nbytes = count * page
    src = cl.maps[page].array[:count]
    memcpy = timed(functools.partial(np.copyto, dst, src))
    raw = timed(functools.partial(cl.raw, page, nbytes, dst))

    def pull(shm: bool, verify: bool | None) -> Sampler:
        return timed(functools.partial(cl.pull, page, count, shm, dst, verify))

    size = label(count, page)
    local = cl.local_sampler(page, count, dst)
    cases: list[tuple[str, Sampler, Sampler, float | None, str]] = [
        (f"shm_read pull {size}", local, memcpy, 0.5, "vs memcpy; one-sided, no request"),
        (f"shm pull {size}", pull(True, None), memcpy, None, "vs memcpy; request + ack"),
        (f"ucx pull {size}", pull(False, None), raw, 0.8 if count >= 16 else None, "vs raw ucxx"),
    ]
    if count >= 16:
        cases += [
            (
                f"shm_read pull+import {size}",
                cl.import_sampler(page, count, True, True),
                memcpy,
                None,
                "vs memcpy",
            ),
            (f"shm pull+import {size}", cl.import_sampler(page, count, True), memcpy, None, "vs memcpy"),
            (f"ucx pull+import {size}", cl.import_sampler(page, count, False), raw, None, "vs raw ucxx"),
            (f"shm pull {size}, verified", pull(True, True), memcpy, None, "vs memcpy; CRC on both sides"),
            (f"ucx pull {size}, no receiver CRC", pull(False, False), raw, None, "vs raw ucxx"),
        ]
    short = nbytes <= SHORT_ROW_BYTES
    repeats = settings.repeats * (settings.short_factor if short else 1)
    warmup = max(settings.warmup, settings.short_warmup) if short else settings.warmup
    rows = []
    for name, ours_fn, base_fn, goal, info in cases:
        ours, base = paired_seconds(ours_fn, base_fn, repeats, warmup)
        rows.append(Row(name, nbytes / ours / 1e6, nbytes / base / 1e6, "MB/s", goal, info=info))
    return rows


def run_process_rows(settings: TransferSettings) -> list[Row]:
    """Spawn the peer process, measure every row, shut the peer down (also on errors)."""
    token = secrets.token_bytes(32)
    config = bench_config()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (settings.page_sizes, max(settings.counts), token, config)
    proc = ctx.Process(target=_helper_main, args=(child, args), daemon=True)
    proc.start()
    client: _Client | None = None
    try:
        if not parent.poll(120):
            raise TimeoutError("the benchmark peer did not start within 120 s")
        info, peer_ucx = parent.recv()
        client = _Client(token, config, info, peer_ucx)
        parent.send(("raw", client.my_address))
        parent.recv()
        return _rows(client, settings)
    finally:
        if client is not None:
            client.close()
        if proc.is_alive():
            parent.send(("close", None))
            if parent.poll(30):
                parent.recv()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def describe(settings: TransferSettings, quick: bool) -> str:
    """The table's description line (starts UCX here, with the benchmark's settings)."""
    config = bench_config()
    configure_ucx(config.ucx_net_devices, config.ucx_tls, config.ucx_progress)
    try:
        ctx_info = ", ".join(get_runtime().run(_transports(), 30))
    except Exception:
        ctx_info = "UCX unavailable"
    mode = "quick" if quick else "full"
    return (
        f"{mode} mode, median of {settings.repeats} after {settings.warmup} warmup "
        f"({settings.repeats * settings.short_factor} after {max(settings.warmup, settings.short_warmup)}"
        f" for rows of <= {SHORT_ROW_BYTES >> 20} MiB); "
        f"peer in another process on this node; UCX transports: {ctx_info}; "
        f"CRC-32 from {getattr(crc32, '__module__', '?')}"
    )


async def _transports() -> list[str]:
    return active_transports(ucx_context().ucp_context_info)


def transfer_suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The ``transfer`` suite: (benchmarks, description line)."""
    settings = QUICK if quick else FULL
    description = describe(settings, quick)
    return [Benchmark("pull bandwidth (peer process)", lambda: run_process_rows(settings))], description


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import module_main

    sys.exit(
        module_main(
            "transfer", transfer_suite, note="for the Ray object-store baseline row: raykv bench transfer"
        )
    )

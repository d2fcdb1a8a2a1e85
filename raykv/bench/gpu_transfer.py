"""GPU-to-GPU page pulls between two processes (needs 2 CUDA devices and ucxx).

``python -m raykv.bench.gpu_transfer [--quick] [--json PATH] [--gpu-read-only] [--repeats N]``:
a page-server process owns a CacheManager whose top tier is a GPU tier on cuda:0 (plus a pinned
host tier) holding committed blocks written by the device oracle; this process pulls them into a
manager on cuda:1 and times:

* ``direct pull``: :func:`raykv.transfer.paths.direct.pull_direct` into a buffer on cuda:1, every page's
  digest checked; the sender gathers the pages into a plain device allocation (``staged``: up to 4
  UCX messages; ``staged_1msg``: one), or with ``--in-place`` also sends them straight from the
  GPU tier (slow: UCX cannot map its CUDA virtual memory); each row also gives the median split
  of a pull into request (to the header), payload and digest check;
* ``direct pull+import``: the same plus :func:`raykv.transfer.paths.direct.import_direct` into the
  GPU tier, device synchronized;
* ``gpu_peer pull+import``: :func:`raykv.transfer.paths.gpu_peer.pull_gpu_peer_into` with one-sided
  reads off: cuda:1 maps the server's GPU tier and copies the leased pages into its own GPU tier
  (request, header, copy, done/ack); ``gpu_read pull+import (event loop)``: the same call with its
  defaults, which after the first request copies with no request at all (the owner's slot
  directory), in overlapping chunks; ``(caller's thread)``: what ``CacheWorker.pull`` does,
  :func:`raykv.transfer.paths.gpu_peer.pull_gpu_local` with no event-loop or executor hop;
* ``ucx pull+import``: the host path (:func:`raykv.transfer.pull_into`): pages land in host memory,
  CRC-32 on both sides, then imported (only with ``--host-path``; fewer samples: it is slow).

``--gpu-read-only`` times only the raw copy, gpu_read in the caller's thread and the raw copy
again (the host's speed drifts; the two raw rows bracket the pull).

Baseline, measured in the same run: one torch copy of one contiguous buffer of the same bytes
from cuda:0 to cuda:1 (``copy_``, then synchronize). Issue goal: >= 0.75x for 256 pages of 2 MiB.
Figures are GB/s (1e9 bytes), the median of the samples after a warm-up.

``python -m raykv.bench.gpu_transfer serve SPEC`` is the server process (also used by
tests/gpu/test_gpu_transfer.py through :class:`ServerProcess`); its token comes in the
environment (``RAYKV_TRANSFER_TOKEN``, hex), never on the command line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MARK = "RAYKV-JSON "
GOAL = 0.75


@dataclass(frozen=True)
class Scenario:
    name: str
    page_kib: int
    pages: int


SCENARIOS = (Scenario("256x2MiB", 2048, 256), Scenario("16x512KiB", 512, 16))
VARIANTS = {"in_place": (True, 4), "staged": (False, 4), "staged_1msg": (False, 1)}
"""Server variants: (send a GPU tier's consecutive pages in place, most UCX messages per pull).
The benchmark skips ``in_place`` unless asked: UCX cannot map the GPU tier's VMM memory."""


def _emit(obj: Any) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _transports() -> list[str]:
    """The UCX transports this process's context reports (starts UCX)."""
    from raykv.transfer.net.runtime import active_transports, get_runtime, ucx_context

    async def read() -> list[str]:
        return active_transports(ucx_context(device_memory=True).ucp_context_info)

    return get_runtime().run(read(), 60)


def gpu_manager(page_kib: int, pages: int, device: int) -> Any:
    """A CacheManager with a GPU top tier of ``pages`` (+4) pages on ``device`` and a host tier."""
    from raykv.bench.core_io import page_layout
    from raykv.core.config import CacheConfig, TierConfig
    from raykv.core.manager import CacheManager

    layout = page_layout(page_kib)
    size = (pages + 4) * layout.page_bytes
    return CacheManager(CacheConfig(layout, (TierConfig.gpu(size, device=device), TierConfig.host(size))))


def commit_blocks(manager: Any, pages: int, seed: int) -> list[bytes]:
    """Commit one request of ``pages`` full blocks written by the device oracle; its keys."""
    import torch

    from raykv.gpu_oracle import DeviceOracle

    pool = manager.top_pool
    oracle = DeviceOracle(manager.layout, pool.device)
    tokens = [seed * 1_000_000 + i for i in range(pages * manager.tokens_per_block)]
    with manager.create(tokens) as cache:
        assert cache.resume()
        cache.extend(tokens)
        oracle.fill_cache(pool, cache)
        torch.cuda.synchronize(pool.device)
        cache.commit()
        return [bytes(cache.block_key(i)) for i in range(pages)]


def serve(spec: dict[str, Any]) -> int:
    """The server process: build, commit, serve; then answer ``stats`` and ``fault`` lines until
    ``quit``/EOF."""
    from raykv.transfer import AuthToken, PageServer, TransferConfig

    token = AuthToken(bytes.fromhex(os.environ["RAYKV_TRANSFER_TOKEN"]))
    device = int(spec.get("device", 0))
    config = TransferConfig(host="127.0.0.1", timeout_s=120.0)
    managers, servers, ready = [], {}, {}
    for i, sc in enumerate(spec["scenarios"]):
        mgr = gpu_manager(sc["page_kib"], sc["pages"], device)
        managers.append(mgr)
        keys = commit_blocks(mgr, sc["pages"], seed=i + 1)
        entry: dict[str, Any] = {"keys": [k.hex() for k in keys], "page_bytes": mgr.layout.page_bytes}
        for variant, (in_place, pieces) in VARIANTS.items():
            server = PageServer(mgr, token, config)
            server.direct_in_place = in_place  # type: ignore[attr-defined]
            server.direct_pieces = pieces  # type: ignore[attr-defined]
            entry[variant] = server.start().port
            servers[f"{sc['name']}/{variant}"] = server
        ready[sc["name"]] = entry
    _emit({"servers": ready, "transports": _transports(), "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip() == "stats":
            _emit({name: s.stats.as_dict() for name, s in servers.items()})
        elif line.startswith("fault "):  # fault SERVER NAME JSON-VALUE (test hook)
            _, name, fault, value = line.split(" ", 3)
            setattr(servers[name].faults, fault, json.loads(value))
            _emit({"fault": fault})
        elif line.strip() == "quit":
            break
    for server in servers.values():
        server.close()
    for mgr in managers:
        mgr.shutdown()
    return 0


class ServerProcess:
    """A :func:`serve` process (cuda ``device``; ``env``: extra environment, e.g.
    CUDA_VISIBLE_DEVICES), its ready message, and a ``stats`` call."""

    def __init__(
        self,
        token: bytes,
        scenarios: list[Scenario],
        device: int = 0,
        timeout: float = 240,
        env: dict[str, str] | None = None,
    ) -> None:
        spec = {"device": device, "scenarios": [vars(s) for s in scenarios]}
        env = dict(os.environ, **(env or {}), RAYKV_TRANSFER_TOKEN=token.hex())
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raykv.bench.gpu_transfer", "serve", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self._read(timeout)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(json.loads(line[len(MARK) :]))
        self._lines.put(None)

    def _read(self, timeout: float) -> Any:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"server process did not answer within {timeout}s:\n{self.stderr()}") from None
        if msg is None:
            raise RuntimeError(f"server process exited ({self.proc.wait()}):\n{self.stderr()}")
        return msg

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()[-6000:]

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return self._read(30)  # type: ignore[no-any-return]

    def set_fault(self, server: str, name: str, value: Any) -> None:
        """Set a :class:`raykv.transfer.ServerFaults` field on one of the process's servers."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"fault {server} {name} {json.dumps(value)}\n")
        self.proc.stdin.flush()
        self._read(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _median_seconds(fn: Callable[[], Any], before: Callable[[], Any], repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        before()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Pulls:
    """One scenario's clients, managers and buffers, and each kind of timed pull (the rows of
    :func:`_scenario`). ``close`` releases them."""

    def __init__(self, sc: Scenario, entry: dict[str, Any], token: bytes, device: int = 1) -> None:
        """``device``: the pulling side's CUDA device (the server's is cuda:0)."""
        import torch

        from raykv.transfer import PageClient, TransferConfig, get_runtime

        self.torch, self.runtime, self.entry = torch, get_runtime(), entry
        self.keys = [bytes.fromhex(k) for k in entry["keys"]]
        self.nbytes = len(self.keys) * entry["page_bytes"]
        self.dst_dev = torch.device("cuda", device)
        self.mgr = gpu_manager(sc.page_kib, sc.pages, device)
        self.client = PageClient(token, TransferConfig(host="127.0.0.1", timeout_s=30.0))
        self.slow = PageClient(token, TransferConfig(host="127.0.0.1", timeout_s=60.0))
        self.asking = PageClient(token, TransferConfig(host="127.0.0.1", timeout_s=30.0, use_shm_read=False))
        self.src = torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, device=torch.device("cuda", 0))
        self.dst = torch.empty(self.nbytes, dtype=torch.uint8, device=self.dst_dev)
        self.phases: list[tuple[float, float, float]] = []
        self.local_served: list[int] = []

    def peer(self, variant: str) -> Any:
        from raykv.transfer import PeerAddress

        return PeerAddress("127.0.0.1", self.entry[variant])

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.dst_dev)

    def raw(self) -> None:
        """The baseline: one torch copy of the same bytes from cuda:0 to cuda:1."""
        self.dst.copy_(self.src)
        self.sync()

    def clear(self) -> None:
        self.mgr.clear_reusable()

    def pull(self, peer: Any) -> Any:
        from raykv.transfer.paths.direct import pull_direct

        pages = self.runtime.run(pull_direct(self.client, peer, self.keys, self.dst_dev), 60)
        self.sync()
        self.phases.append(pages.phases)
        return pages

    def pull_import(self, peer: Any) -> None:
        from raykv.transfer.paths.direct import import_direct

        outcome = import_direct(self.mgr, self.pull(peer))
        self.sync()
        assert len(outcome.imported) == len(self.keys)

    def peer_pull_import(self, one_sided: bool) -> None:
        from raykv.transfer import pull_gpu_peer_into

        client = self.client if one_sided else self.asking
        outcome = self.runtime.run(pull_gpu_peer_into(client, self.peer("staged"), self.mgr, self.keys), 60)
        self.sync()
        assert len(outcome.imported) == len(self.keys)
        assert outcome.path in (("gpu_read", "gpu_peer") if one_sided else ("gpu_peer",)), outcome.path

    def local_pull_import(self) -> None:
        """What CacheWorker.pull does on a GPU worker: gpu_read in the caller's thread, the owner
        asked only for what that could not serve (the first pull: the directory is not known)."""
        from raykv.transfer import pull_gpu_local, pull_gpu_peer_into

        peer = self.peer("staged")
        landed = pull_gpu_local(self.client, peer, self.mgr, self.keys)
        if landed is None or landed[1]:
            rest = self.keys if landed is None else landed[1]
            self.runtime.run(pull_gpu_peer_into(self.client, peer, self.mgr, rest), 60)
        else:
            self.local_served.append(len(landed[0].imported))
        self.sync()

    def ucx_pull_import(self) -> None:
        from raykv.transfer import pull_into

        outcome = self.runtime.run(
            pull_into(self.slow, self.peer("in_place"), self.mgr, self.keys, prefer_shm=False), 90
        )
        self.sync()
        assert len(outcome.imported) == len(self.keys) and outcome.path == "ucx"

    def close(self) -> None:
        self.client.close()
        self.slow.close()
        self.asking.close()
        self.mgr.shutdown()


Rows = list[tuple[str, float]]


def _nothing() -> None:
    pass


def _direct_rows(
    p: _Pulls, sc: Scenario, options: argparse.Namespace, repeats: int, warmup: int
) -> tuple[Rows, dict[str, str], list[str]]:
    """The ``direct pull`` and ``direct pull+import`` rows of every variant, the per-row split
    of a pull into phases, and errors (a variant whose first row failed skips its second)."""
    rows: Rows = []
    info: dict[str, str] = {}
    errors: list[str] = []
    for variant in [v for v in VARIANTS if options.in_place or v != "in_place"]:
        peer = p.peer(variant)
        for what, fn, before in (("pull", p.pull, _nothing), ("pull+import", p.pull_import, p.clear)):
            try:
                p.phases.clear()
                seconds = _median_seconds(lambda: fn(peer), before, repeats, warmup)  # noqa: B023
                rows.append((f"direct {what} ({variant})", seconds))
                split = [statistics.median(ph[i] for ph in p.phases[warmup:]) * 1e3 for i in range(3)]
                info[rows[-1][0]] = "request/payload/verify ms: " + "/".join(f"{x:.2f}" for x in split)
            except Exception as exc:  # recorded; the variant's other row is skipped
                errors.append(f"{sc.name} direct {what} ({variant}): {type(exc).__name__}: {exc}")
                break
    return rows, info, errors


def _peer_rows(p: _Pulls, sc: Scenario, only: bool, repeats: int, warmup: int) -> tuple[Rows, list[str]]:
    """The gpu_peer / gpu_read rows (only the caller's-thread one with ``only``), and errors;
    run after the direct rows: the first gpu_peer pull makes the server's pool shared."""
    rows: Rows = []
    errors: list[str] = []
    labelled = (
        ("gpu_peer pull+import", functools.partial(p.peer_pull_import, False)),
        ("gpu_read pull+import (event loop)", functools.partial(p.peer_pull_import, True)),
        ("gpu_read pull+import (caller's thread)", p.local_pull_import),
    )[2 if only else 0 :]
    for label, work in labelled:
        try:
            rows.append((label, _median_seconds(work, p.clear, repeats, warmup)))
        except Exception as exc:
            errors.append(f"{sc.name} {label}: {type(exc).__name__}: {exc}")
    if len(p.local_served) < repeats:
        errors.append(f"{sc.name}: gpu_read served {len(p.local_served)} of {repeats} timed pulls")
    return rows, errors


def _scenario(
    sc: Scenario, entry: dict[str, Any], token: bytes, repeats: int, warmup: int, options: argparse.Namespace
) -> dict[str, Any]:
    """Rows of one scenario (seconds per pull) against the server's ``entry``."""
    p = _Pulls(sc, entry, token)
    errors: list[str] = []
    info: dict[str, str] = {}
    try:
        rows: Rows = [("raw torch peer copy", _median_seconds(p.raw, _nothing, repeats, warmup))]
        only = getattr(options, "gpu_read_only", False)
        if not only:
            direct, info, errors = _direct_rows(p, sc, options, repeats, warmup)
            rows += direct
        peer_rows, peer_errors = _peer_rows(p, sc, only, repeats, warmup)
        rows += peer_rows
        errors += peer_errors
        if only:  # the machine drifts: the baseline again, after the rows it is compared with
            rows.append(("raw torch peer copy (again)", _median_seconds(p.raw, _nothing, repeats, warmup)))
        if options.host_path:
            try:
                rows.append(
                    ("ucx pull+import (host path)", _median_seconds(p.ucx_pull_import, p.clear, 2, 1))
                )
            except Exception as exc:
                errors.append(f"{sc.name} ucx host path: {type(exc).__name__}: {exc}")
    finally:
        p.close()
    raw_s = rows[0][1]
    out = [
        {
            "scenario": sc.name,
            "what": name,
            "ms": round(seconds * 1e3, 3),
            "GB/s": round(p.nbytes / seconds / 1e9, 2),
            "ratio": round(raw_s / seconds, 3),
            "info": info.get(name, ""),
        }
        for name, seconds in rows
    ]
    return {"rows": out, "errors": errors}


def measure(options: argparse.Namespace, scenarios: tuple[Scenario, ...] = SCENARIOS) -> dict[str, Any]:
    """Run every scenario against one server process; rows of GB/s and ratios to the raw copy."""
    import secrets

    repeats, warmup = (5, 2) if options.quick else (15, 3)
    if getattr(options, "repeats", None):
        repeats = options.repeats
    token = secrets.token_bytes(32)
    server = ServerProcess(token, list(scenarios))
    out: dict[str, Any] = {"server_transports": server.ready["transports"], "rows": [], "errors": []}
    try:
        out["client_transports"] = _transports()
        for sc in scenarios:
            part = _scenario(sc, server.ready["servers"][sc.name], token, repeats, warmup, options)
            out["rows"] += part["rows"]
            out["errors"] += part["errors"]
        out["server_stats"] = server.stats()
    finally:
        server.close()
    return out


def host_speed_ms() -> float:
    """Milliseconds for a fixed pure-Python loop (the best of 3): the pulls' bookkeeping is
    Python, so their ratio to the raw copy follows this number, which varies between hosts."""
    best = float("inf")
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(1_000_000):
            total += i
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "serve":
        return serve(json.loads(args[1]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--host-path", action="store_true", help="also time the ucx host path (slow)")
    parser.add_argument("--in-place", action="store_true", help="also time in-place GPU sends (slow)")
    parser.add_argument(
        "--gpu-read-only", action="store_true", help="only the raw copy and gpu_read in the caller's thread"
    )
    parser.add_argument("--repeats", type=int, help="timed samples per row (default 5 quick, 15 full)")
    opts = parser.parse_args(args)
    before = host_speed_ms()
    result = measure(opts)
    print(f"UCX transports: server {result['server_transports']}, client {result['client_transports']}")
    print(f"host speed: 10^6 Python additions took {before:.1f} ms before, {host_speed_ms():.1f} ms after")
    print(f"{'scenario':<11} {'what':<32} {'ms':>9} {'GB/s':>8} {'x raw':>7}")
    for row in result["rows"]:
        print(
            f"{row['scenario']:<11} {row['what']:<32} {row['ms']:>9} {row['GB/s']:>8} {row['ratio']:>7}"
            f"  {row['info']}"
        )
    for error in result["errors"]:
        print("error:", error)
    print(f"goal: pull+import of 256x2MiB >= {GOAL}x the raw peer copy (gpu_peer on one node)")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

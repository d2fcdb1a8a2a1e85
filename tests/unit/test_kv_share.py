"""One-copy stores (raykv.transfer.kv_share): a CPU engine shares its KV memory read-only, its
owner copies stored blocks straight out of it into matchable pages.

Content, not calls: engine blocks hold the content oracle's bytes for their keys; after each store
the owner holds exactly those bytes under keys it derived itself, and check_invariants() holds.
A bad request, an abandoned store or a refused hello leaves the owner unchanged.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from raykv import CacheConfig, CacheManager, ReuseScope, TierConfig, block_keys
from raykv.core.errors import InvalidArgumentError, StateError
from raykv.testing import ContentOracle
from raykv.transfer.inbox import Inboxes
from raykv.transfer.kv_share import memory
from raykv.transfer.kv_share.engine import SharedKV
from raykv.transfer.kv_share.owner import StoreOutcome, StoreServer
from raykv.transfer.kv_share.protocol import commit_wire
from tests.deps import require

pytestmark = pytest.mark.skipif(not memory.supported(), reason="engine memory is shared on Linux x86-64 only")

TPB = 4
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = list(range(100, 100 + 8 * TPB))
SCOPE = ReuseScope(None, 7, b"m" * 32)
Owner = tuple[CacheManager, Inboxes]
BLOCKS = 40_000  # x 2 layers x 512 bytes: 39 MiB, over memory.MIN_BYTES (a mapping of its own)


def _layout() -> Any:
    require("torch")
    from raykv.integrations.vllm.layout import native_layout

    return native_layout(len(NAMES), 2, 8, TPB, "float32")


@pytest.fixture(params=["host", "disk"])
def owner(request: pytest.FixtureRequest) -> Iterator[Owner]:
    """An owner whose top tier is a host tier (the gather writes its rows) or, for the other
    branch of the writer, a disk tier (the gather writes host rows, then the tier's write)."""
    layout = _layout()
    top = TierConfig.host if request.param == "host" else TierConfig.disk
    manager = CacheManager(CacheConfig(layout, (top(64 * layout.page_bytes),)))
    inboxes = Inboxes(manager)
    yield manager, inboxes
    inboxes.close()
    manager.shutdown()


def _engine(layout: Any) -> tuple[Any, list[bytes]]:
    """A CPU engine's copier whose blocks 10..17 hold the oracle's pages of the prompt."""
    from raykv.integrations.vllm.copier import BlockCopier
    from raykv.integrations.vllm.testing import vllm_kv_caches

    caches = vllm_kv_caches(NAMES, BLOCKS, 2, TPB, 8, "float32", "cpu", order="LBHNC")
    copier = BlockCopier(layout, NAMES, caches, "cpu")
    keys = [bytes(k) for k in block_keys(PROMPT, TPB, SCOPE)]
    oracle = ContentOracle(layout)
    copier.load(np.stack([oracle.expected(k) for k in keys]), list(range(10, 18)))
    return copier, keys


def _shared(inboxes: Inboxes, copier: Any, timeout_s: float = 5.0) -> SharedKV:
    (lease,) = inboxes.open("engine-a", 1, 4 * copier.page_bytes)
    assert lease.socket
    described = copier.shared_segments()
    assert described is not None
    memories, segments = described
    blocks, page = copier.num_blocks, copier.page_bytes
    return SharedKV(lease.socket, lease.lease_id, memories, segments, blocks, page, timeout_s)


def _commit(first: int, end: int, parent: bytes | None) -> list[Any]:
    return commit_wire(list(range(10 + first, 10 + end)), first, parent, PROMPT[: end * TPB], SCOPE, (), "r1")


def _held(manager: CacheManager, keys: list[bytes]) -> int:
    """How many leading ``keys`` the manager holds with the oracle's bytes."""
    manager.check_invariants()
    oracle = ContentOracle(manager.config.layout)
    good = 0
    for key, block in zip(keys, manager.export_blocks(keys)):
        if block.key != key or not oracle.check(np.frombuffer(block.data, np.uint8), key):
            break
        good += 1
    return good


def test_sharing_keeps_the_bytes_and_the_owner_sees_later_writes() -> None:
    data = np.arange(12 << 20, dtype=np.uint32)  # 48 MiB, not page-aligned at its ends
    address, nbytes = int(data.ctypes.data), data.nbytes
    region = memory.share_memory(address, nbytes)
    assert region is not None and region.start % memory.PAGE == 0
    assert region.start >= address and region.start + region.size <= address + nbytes
    assert np.array_equal(data, np.arange(12 << 20, dtype=np.uint32))  # bytes kept, array works
    reader = memory.ReadOnlyRegion(region.fd, region.start, region.size)
    try:
        index = (region.start - address) // 4 + 1000
        assert reader.u64(address + index * 4 - region.start) & 0xFFFFFFFF == index
        data[index] = 0xDEADBEEF  # the engine writes: the owner's mapping sees it
        assert reader.u64(address + index * 4 - region.start) & 0xFFFFFFFF == 0xDEADBEEF
        assert ctypes.string_at(reader.address + address + index * 4 - region.start, 4) == b"\xef\xbe\xad\xde"
    finally:
        reader.close()
    assert memory.share_memory(address + 1, 100) is None  # under MIN_BYTES: maybe the malloc heap
    with pytest.raises(InvalidArgumentError):
        memory.share_memory(0, 10)


def test_a_child_forked_after_sharing_does_not_inherit_the_shared_pages() -> None:
    """A MAP_SHARED range would be shared with a forked child instead of copied on write: the
    moved pages are MADV_DONTFORK, absent from the child."""
    import os

    data = np.zeros(40 << 20, dtype=np.uint8)
    region = memory.share_memory(int(data.ctypes.data), data.nbytes)
    assert region is not None
    os.close(region.fd)
    pid = os.fork()
    if pid == 0:  # the child: is any mapping over the region's first page?
        with open("/proc/self/maps") as maps:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
        os._exit(1 if any(lo <= region.start < hi for lo, hi in spans) else 0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("pure", [False, True], ids=["native", "python"])
def test_gather_copies_segments_back_to_back(pure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if pure:
        monkeypatch.setenv("RAYKV_PURE_GATHER", "1")
    src = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    starts, lens = [4096, 64, 9000, 128], [1024, 4096, 77, 64]
    dst = np.zeros(sum(lens) + 16, dtype=np.uint8)
    addrs = np.asarray([int(src.ctypes.data) + s for s in starts], dtype=np.uint64)
    memory.gather(dst, addrs, np.asarray(lens, dtype=np.int64))
    want = np.concatenate([src[s : s + n] for s, n in zip(starts, lens)])
    assert np.array_equal(dst[: len(want)], want) and not dst[len(want) :].any()
    with pytest.raises(InvalidArgumentError):
        memory.gather(dst[:10], addrs, np.asarray(lens, dtype=np.int64))


def test_the_owner_copies_engine_blocks_into_pages_it_keys_itself(owner: Owner) -> None:
    manager, inboxes = owner
    copier, keys = _engine(manager.config.layout)
    shared = _shared(inboxes, copier)
    try:
        assert shared.covers(list(range(10, 18))) and not shared.covers([BLOCKS])
        answer = shared.store([_commit(0, 3, None)])
        assert answer is not None and answer["per"] == [[3, 0, 0, 0]]
        assert _held(manager, keys) == 3
        answer = shared.store([_commit(3, 8, keys[2]), _commit(0, 2, None)])  # chained; held already
        assert answer is not None and answer["per"] == [[5, 0, 0, 0], [0, 2, 0, 0]]
        assert _held(manager, keys) == 8
        assert inboxes.counters["stored"] == 8 and inboxes.counters["shared_stores"] == 2
    finally:
        shared.close()


def test_bad_commits_are_refused_and_change_nothing(owner: Owner) -> None:
    manager, inboxes = owner
    copier, keys = _engine(manager.config.layout)
    shared = _shared(inboxes, copier)
    try:
        bad = [
            _commit(2, 4, keys[1]),  # parent not held
            _commit(2, 4, None),  # no parent key for block 2
            commit_wire([10, 11], 0, None, PROMPT[:TPB], SCOPE, (), "r1"),  # too few tokens
            commit_wire([BLOCKS + 5], 0, None, PROMPT[:TPB], SCOPE, (), "r1"),  # not an engine block
            commit_wire([-1], 0, None, PROMPT[:TPB], SCOPE, (), "r1"),
            [[10], 0, None, "tokens", [None, 7, b"m" * 32], [], "r1"],  # tokens not bytes
            [[10], 0, None, b"\0" * 16, [None, -7, None], [], "r1"],  # a bad salt
            "not a commit",
        ]
        answer = shared.store(bad)
        assert answer is not None
        assert [p[2] for p in answer["per"]] == [2, 2, 2, 1, 1, 1, 1, 0]
        assert len(answer["reasons"]) == 8 and len(manager.tree) == 0
        manager.check_invariants()
        good = shared.store([_commit(0, 2, None)])  # the connection goes on
        assert good is not None and good["stored"] == 2 and _held(manager, keys) == 2
    finally:
        shared.close()


def test_hellos_without_a_lease_or_of_another_page_size_are_refused(owner: Owner) -> None:
    manager, inboxes = owner
    copier, _ = _engine(manager.config.layout)
    (lease,) = inboxes.open("engine-a", 1, 4 * copier.page_bytes)
    described = copier.shared_segments()
    assert described is not None
    memories, segments = described
    with pytest.raises(StateError, match="lease"):
        SharedKV(lease.socket, lease.lease_id + 1, memories, segments, BLOCKS, copier.page_bytes, 5.0)
    with pytest.raises(StateError, match="page"):
        SharedKV(lease.socket, lease.lease_id, memories, segments, BLOCKS, copier.page_bytes * 2, 5.0)
    short = [(a, s, n // 2) for a, s, n in segments]
    huge = [(a, 1 << 60, n) for a, s, n in segments]  # would overflow the owner's address math
    for bad in (short, huge):
        with pytest.raises(StateError, match="segments"):
            SharedKV(lease.socket, lease.lease_id, memories, bad, BLOCKS, copier.page_bytes, 5.0)
    shared = SharedKV(lease.socket, lease.lease_id, memories, segments, BLOCKS, copier.page_bytes, 5.0)
    inboxes.close_engine("engine-a")  # the lease ends: later stores are refused
    with pytest.raises(StateError, match="lease"):
        shared.store([_commit(0, 2, None)])
    shared.close()
    assert len(manager.tree) == 0


def test_a_connection_that_never_says_hello_is_closed(owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from raykv.transfer.kv_share import owner as owner_module

    monkeypatch.setattr(owner_module, "HELLO_TIMEOUT_S", 0.2)
    _, inboxes = owner
    (lease,) = inboxes.open("engine-a", 1, 4 * _layout().page_bytes)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(lease.socket)
        assert sock.recv(1) == b""  # closed by the owner, nothing answered


class _SlowServer(StoreServer):
    """A store server whose gather waits for ``release`` (the engine meanwhile gives up)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.release = threading.Event()
        self.entered = threading.Event()

    def _write(self, *args: Any) -> None:
        self.entered.set()
        self.release.wait(10)
        super()._write(*args)


def test_an_abandoned_store_is_never_committed(owner: Owner) -> None:
    """The engine stops waiting: the owner, still copying, must not insert the blocks (the
    engine may be rewriting them); the next store's answer is not confused with the old one."""
    manager, inboxes = owner
    copier, keys = _engine(manager.config.layout)
    (lease,) = inboxes.open("engine-a", 1, 4 * copier.page_bytes)
    outcomes: list[StoreOutcome] = []
    server = _SlowServer(manager, lambda lease_id: lease_id == lease.lease_id, outcomes.append)
    described = copier.shared_segments()
    assert described is not None
    shared = SharedKV(server.path, lease.lease_id, *described, BLOCKS, copier.page_bytes, 0.3)
    try:
        assert shared.store([_commit(0, 3, None)]) is None  # gave up: epoch moved on
        assert server.entered.wait(5)
        server.release.set()
        shared.timeout_s = 10.0
        answer = shared.store([_commit(0, 2, None)])  # skips the abandoned store's late answer
        assert answer is not None and answer["per"] == [[2, 0, 0, 0]]
        assert outcomes[0].abandoned == 3 and outcomes[0].stored == 0
        assert _held(manager, keys) == 2  # only the second store's blocks
    finally:
        shared.close()
        server.close()


def test_worker_side_stores_through_the_shared_memory(owner: Owner) -> None:
    """The connector's worker side on an engine_native CPU engine: stores take the shared path
    (no inbox commits), the owner holds the oracle's bytes, a store of blocks the memory does not
    cover goes through the inbox."""
    from raykv.integrations.vllm.plan import EngineLink, RaykvMetadata, StoreOp
    from raykv.integrations.vllm.testing import vllm_kv_caches
    from raykv.integrations.vllm.worker import WorkerSide
    from raykv.transfer import PeerAddress

    manager, inboxes = owner
    layout = manager.config.layout
    side = WorkerSide(layout, NAMES)
    side.register(vllm_kv_caches(NAMES, BLOCKS, 2, TPB, 8, "float32", "cpu", order="LBHNC"), "cpu")
    assert side.copier is not None
    keys = [bytes(k) for k in block_keys(PROMPT, TPB, SCOPE)]
    oracle = ContentOracle(layout)
    side.copier.load(np.stack([oracle.expected(k) for k in keys]), list(range(10, 18)))
    leases = inboxes.open("engine-a", 1, 8 * layout.page_bytes)
    link = EngineLink("w0", PeerAddress("127.0.0.1", 1), "node", b"t" * 32, leases)
    blocks = tuple(range(10, 18))
    try:
        for first, end in ((0, 3), (3, 6)):
            op = StoreOp("r1", tuple(PROMPT[: end * TPB]), SCOPE, blocks[:end], first)
            side.save(RaykvMetadata(link=link, stores=[op]))
            report = side.take_report()
            assert side.shared is not None and report is not None and not report.commits
            counts = report.per_request["r1"]
            assert counts["shared_store_blocks"] == counts["stored_blocks"] == end - first
            assert _held(manager, keys) == end
    finally:
        side.close()

"""The ``direct`` pull path (raykv.transfer.paths.direct) between host-tier managers over UCX loopback.

On this CPU-only machine the "device" is the host: pages land in a torch CPU buffer, digests are
computed there and the import copies into the host top tier. tests/gpu/test_gpu_transfer.py runs
the same path GPU to GPU. Every test checks content with the oracle and that no lease is left.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import numpy as np
import pytest
from deps import require

torch = require("torch")

from raykv import CacheConfig, CacheManager, ContentOracle, KVLayout, TierConfig, TransferError  # noqa: E402
from raykv.transfer import AuthToken, PageClient, PageServer, TransferConfig, get_runtime  # noqa: E402
from raykv.transfer.paths.direct import (  # noqa: E402
    MAX_PIECES,
    SPLIT_BYTES,
    DirectPages,
    direct_counts,
    import_direct,
    page_digests,
    pull_direct,
    pull_direct_into,
)

CFG = TransferConfig.loopback(timeout_s=20.0, connect_timeout_s=5.0)
BIG = KVLayout.uniform(num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=4)  # 64 KiB pages


def _manager(layout: KVLayout, pages: int) -> CacheManager:
    tiers = (TierConfig.host(pages * layout.page_bytes, pin_memory=False),)
    return CacheManager(CacheConfig(layout, tiers))


def _commit(mgr: CacheManager, oracle: ContentOracle, seed: int, blocks: int) -> list[bytes]:
    tokens = [seed * 10_000 + i for i in range(blocks * mgr.tokens_per_block)]
    with mgr.create(tokens) as cache:
        assert cache.resume()
        cache.extend(tokens)
        oracle.fill_cache(cache)
        cache.commit()
        return [bytes(cache.block_key(i)) for i in range(blocks)]


@pytest.fixture
def pair() -> Iterator[tuple[CacheManager, CacheManager, PageServer, PageClient]]:
    token = AuthToken.generate()
    src, dst = _manager(BIG, 200), _manager(BIG, 200)
    server = PageServer(src, token, CFG)
    server.start()
    client = PageClient(token, CFG)
    yield src, dst, server, client
    client.close()
    server.close()
    assert server.open_leases == 0 and not src.store.leases
    src.shutdown()
    dst.shutdown()


def _pull(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
    oracle: ContentOracle,
    seed: int,
    blocks: int,
) -> tuple[list[bytes], DirectPages]:
    """Commit ``blocks`` blocks on the pair's source and pull them direct onto the CPU: (keys, pages)."""
    src, _, server, client = pair
    keys = _commit(src, oracle, seed, blocks)
    pages = get_runtime().run(pull_direct(client, server.address, keys, "cpu"), 30)  # type: ignore[arg-type]
    return keys, pages


def _no_leases(server: PageServer, src: CacheManager) -> None:
    deadline = time.monotonic() + 5
    while (server.open_leases or src.store.leases) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.open_leases == 0 and not src.store.leases


def test_digests_agree_on_numpy_and_torch_and_catch_changes() -> None:
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 256, (5, 4096), dtype=np.uint8)
    sums = page_digests(rows)
    assert sums == page_digests(torch.from_numpy(rows.copy())) and len(set(sums)) == 5
    assert all(0 <= s <= 0xFFFFFFFF for s in sums)
    flipped = rows.copy()
    flipped[2, 777] ^= 1
    assert [a == b for a, b in zip(page_digests(flipped), sums)] == [True, True, False, True, True]
    swapped = rows.copy()
    swapped[1, :512], swapped[1, 512:1024] = rows[1, 512:1024], rows[1, :512]  # two rows moved
    assert page_digests(swapped)[1] != sums[1]
    odd = rng.integers(0, 256, (3, 1001), dtype=np.uint8)  # not a whole number of words
    assert page_digests(odd) == page_digests(torch.from_numpy(odd.copy())) and page_digests(odd[:0]) == []


def test_direct_counts_send_a_few_large_messages() -> None:
    assert direct_counts(0, 1 << 20) == []
    assert direct_counts(16, 512 << 10) == [16]
    counts = direct_counts(256, 2 << 20)
    assert len(counts) == MAX_PIECES and sum(counts) == 256
    assert direct_counts(SPLIT_BYTES // 4096 + 1, 4096)[0] * 4096 <= SPLIT_BYTES


@pytest.mark.parametrize("blocks", [3, 150])
def test_direct_pull_imports_verified_pages(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
    blocks: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("raykv.transfer.paths.direct.SPLIT_BYTES", 1 << 20)  # 150 blocks: 4 messages
    src, dst, server, client = pair
    oracle = ContentOracle(BIG)
    keys = _commit(src, oracle, 1, blocks)
    want = [*keys[:2], b"\x07" * 32, *keys[2:]]  # one key the server lacks
    outcome = get_runtime().run(pull_direct_into(client, server.address, dst, want), 30)  # type: ignore[arg-type]
    assert outcome.path == "direct" and outcome.complete is False and outcome.missing == (b"\x07" * 32,)
    assert list(outcome.imported) == keys and not outcome.dropped
    assert outcome.nbytes == blocks * BIG.page_bytes
    assert oracle.verify_manager(dst) == blocks
    assert client.stats.pulls == {"direct": 1} and client.stats.pages == {"direct": blocks}
    _no_leases(server, src)
    assert server.stats.pulls == {"direct": 1}
    again = get_runtime().run(pull_direct_into(client, server.address, dst, keys), 30)  # type: ignore[arg-type]
    assert not again.imported and list(again.already_present) == keys
    dst.check_invariants()
    src.check_invariants()


def test_direct_pull_of_scattered_pages_is_gathered(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
) -> None:
    src, dst, server, client = pair
    oracle = ContentOracle(BIG)
    keys = _commit(src, oracle, 2, 8)
    order = keys[::2] + keys[1::2]  # not one consecutive run: staged on the sender
    pages = get_runtime().run(pull_direct(client, server.address, order, "cpu"), 30)  # type: ignore[arg-type]
    assert list(pages.keys) == order and tuple(pages.data.shape) == (8, BIG.page_bytes)
    for key, row in zip(pages.keys, pages.data):
        assert oracle.check(row.numpy(), key)
    outcome = import_direct(dst, pages)
    assert list(outcome.imported) == order[:1] and len(outcome.dropped) == 7  # block 2's parent: later
    assert oracle.verify_manager(dst) == 1
    _no_leases(server, src)


def test_corrupt_direct_payload_imports_nothing(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
) -> None:
    src, dst, server, client = pair
    keys = _commit(src, ContentOracle(BIG), 3, 4)
    server.faults.corrupt_payload = True
    with pytest.raises(TransferError) as info:
        get_runtime().run(pull_direct_into(client, server.address, dst, keys), 30)  # type: ignore[arg-type]
    assert info.value.reason == "integrity" and keys[0] in info.value.bad_keys
    assert not dst.committed_blocks() and client.stats.failures == {"integrity": 1}
    _no_leases(server, src)
    server.faults.corrupt_payload = False
    outcome = get_runtime().run(pull_direct_into(client, server.address, dst, keys), 30)  # type: ignore[arg-type]
    assert len(outcome.imported) == 4


def test_direct_pull_with_a_wrong_token_is_refused(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
) -> None:
    src, dst, server, _ = pair
    keys = _commit(src, ContentOracle(BIG), 4, 2)
    stranger = PageClient(AuthToken.generate(), CFG)
    with pytest.raises(TransferError) as info:
        get_runtime().run(pull_direct_into(stranger, server.address, dst, keys), 30)  # type: ignore[arg-type]
    stranger.close()
    assert info.value.reason == "auth" and server.stats.preauth_rejected == 1
    assert not dst.committed_blocks()


def test_a_key_repeated_in_one_import_is_refused_and_leaks_no_page(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
) -> None:
    src, dst, server, _ = pair
    oracle = ContentOracle(BIG)
    keys, pulled = _pull(pair, oracle, 3, 3)
    rows = [0, 0, 1, 2, 1]  # pull_direct refuses repeated keys; import_direct is public too

    def repeat(rows: list[int]) -> DirectPages:
        return dataclasses.replace(
            pulled,
            keys=tuple(pulled.keys[i] for i in rows),
            parent_keys=tuple(pulled.parent_keys[i] for i in rows),
            parent_is_root=tuple(pulled.parent_is_root[i] for i in rows),
            num_tokens=tuple(pulled.num_tokens[i] for i in rows),
            data=pulled.data[rows],
        )

    free = dst.pools[0].num_free
    with pytest.raises(TransferError) as info:  # the one import procedure refuses it (issue 39)
        import_direct(dst, repeat(rows))
    assert info.value.reason == "rejected" and "duplicate" in str(info.value)
    dst.check_invariants()
    assert not dst.committed_blocks() and dst.pools[0].num_free == free
    outcome = import_direct(dst, repeat([0, 1, 2]))  # the distinct keys: imported
    assert list(outcome.imported) == keys and outcome.dropped == ()
    assert dst.pools[0].num_free == free - 3
    assert oracle.verify_manager(dst) == 3
    _no_leases(server, src)


def test_a_partial_block_in_a_direct_import_is_refused_and_imports_nothing(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
) -> None:
    src, dst, server, _ = pair
    oracle = ContentOracle(BIG)
    keys, pulled = _pull(pair, oracle, 5, 3)
    short = dataclasses.replace(pulled, num_tokens=(*pulled.num_tokens[:2], BIG.tokens_per_block - 1))
    free = dst.pools[0].num_free
    with pytest.raises(TransferError) as info:
        import_direct(dst, short)
    assert info.value.reason == "rejected"
    assert not dst.committed_blocks() and dst.pools[0].num_free == free
    dst.check_invariants()
    outcome = import_direct(dst, pulled)  # the same pages, whole: imported
    assert list(outcome.imported) == keys and oracle.verify_manager(dst) == 3
    _no_leases(server, src)


def test_direct_import_skips_present_blocks_and_refuses_other_page_sizes(
    pair: tuple[CacheManager, CacheManager, PageServer, PageClient],
) -> None:
    src, dst, server, _ = pair
    oracle = ContentOracle(BIG)
    keys, pulled = _pull(pair, oracle, 6, 4)
    narrow = dataclasses.replace(pulled, data=pulled.data[:, : BIG.page_bytes // 2])
    with pytest.raises(TransferError) as info:
        import_direct(dst, narrow)
    assert info.value.reason == "rejected" and "page size" in str(info.value)
    first = dataclasses.replace(
        pulled,
        keys=pulled.keys[:1],
        parent_keys=pulled.parent_keys[:1],
        parent_is_root=pulled.parent_is_root[:1],
        num_tokens=pulled.num_tokens[:1],
        data=pulled.data[:1],
    )
    assert list(import_direct(dst, first).imported) == keys[:1]
    free = dst.pools[0].num_free
    outcome = import_direct(dst, pulled)
    assert list(outcome.imported) == keys[1:] and list(outcome.already_present) == keys[:1]
    assert dst.pools[0].num_free == free - 3 and oracle.verify_manager(dst) == 4
    dst.check_invariants()
    _no_leases(server, src)

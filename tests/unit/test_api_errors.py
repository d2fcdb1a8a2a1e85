"""Every public entry point refuses bad arguments with a typed raykv error naming the argument.

One table row per (entry point, bad call): the call, the error type expected and the attributes
it must carry (``argument`` for InvalidArgumentError, ``field`` for ConfigError, ``reason`` for
TransferError, ``index`` for ImportRejectedError). Each row runs against a manager holding a
committed prefix and an open request, and asserts that its invariants, stats and state are the
same after the refused call. Every error type a row expects is exported from ``raykv``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from api_errors_support import CONFIGS, KEY, TRANSFER, Row, World, arg, client, free_port

import raykv
from raykv import (
    CacheManager,
    ConfigError,
    ExportedBlock,
    ImportRejectedError,
    InvalidArgumentError,
    MultimodalItem,
    ReuseScope,
    TransferError,
    block_keys,
    lora_id_from_name,
)
from raykv.core.records import BlockRecords

TOKENS = list(range(100, 112))  # three blocks of the conftest layout (4 tokens per block)


def _bad_block(w: World, **changes: Any) -> ExportedBlock:
    fields = {**w.block.__dict__, **changes}
    return ExportedBlock(**fields)


def _bad_records(w: World) -> object:
    return [w.block]  # ExportedBlocks where BlockRecords columns are expected


CREATE = [
    Row("create", "bytes as tokens", lambda w: w.mgr.create(b"abc"), InvalidArgumentError, arg("tokens")),
    Row("create", "bytearray", lambda w: w.mgr.create(bytearray(8)), InvalidArgumentError, arg("tokens")),
    Row("create", "str as tokens", lambda w: w.mgr.create("abcd"), InvalidArgumentError, arg("tokens")),
    Row("create", "token too large", lambda w: w.mgr.create([2**31]), InvalidArgumentError, arg("tokens")),
    Row("create", "negative token", lambda w: w.mgr.create([-1]), InvalidArgumentError, arg("tokens")),
    Row("create", "float tokens", lambda w: w.mgr.create([1.5]), InvalidArgumentError, arg("tokens")),
    Row("create", "float array", lambda w: w.mgr.create(np.ones(4)), InvalidArgumentError, arg("tokens")),
    Row(
        "create",
        "2-d array",
        lambda w: w.mgr.create(np.ones((2, 4), np.int64)),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row("create", "None tokens", lambda w: w.mgr.create(None), InvalidArgumentError, arg("tokens")),
    Row(
        "create",
        "priority str",
        lambda w: w.mgr.create(TOKENS, priority="high"),
        InvalidArgumentError,
        arg("priority"),
    ),
    Row(
        "create",
        "priority 101",
        lambda w: w.mgr.create(TOKENS, priority=101),
        InvalidArgumentError,
        arg("priority"),
    ),
    Row(
        "create",
        "priority bool",
        lambda w: w.mgr.create(TOKENS, priority=True),
        InvalidArgumentError,
        arg("priority"),
    ),
    Row(
        "create",
        "request_id float",
        lambda w: w.mgr.create(TOKENS, request_id=3.5),
        InvalidArgumentError,
        arg("request_id"),
    ),
    Row(
        "create",
        "request_id < 0",
        lambda w: w.mgr.create(TOKENS, request_id=-1),
        InvalidArgumentError,
        arg("request_id"),
    ),
    Row(
        "create",
        "request_id > u64",
        lambda w: w.mgr.create(TOKENS, request_id=2**64),
        InvalidArgumentError,
        arg("request_id"),
    ),
    Row("create", "scope int", lambda w: w.mgr.create(TOKENS, scope=3), InvalidArgumentError, arg("scope")),
    Row(
        "create",
        "mm_items not iterable",
        lambda w: w.mgr.create(TOKENS, mm_items=3),
        InvalidArgumentError,
        arg("mm_items"),
    ),
    Row(
        "create",
        "mm_items wrong type",
        lambda w: w.mgr.create(TOKENS, mm_items=[3]),
        InvalidArgumentError,
        arg("mm_items"),
    ),
    Row(
        "create",
        "mm item past tokens",
        lambda w: w.mgr.create(TOKENS, mm_items=[MultimodalItem(KEY, 10, 5)]),
        InvalidArgumentError,
        arg("mm_items"),
    ),
]

KEYS_AND_SCOPES = [
    Row("ReuseScope", "salt str", lambda w: ReuseScope(salt="x"), InvalidArgumentError, arg("salt")),
    Row("ReuseScope", "salt bytes", lambda w: ReuseScope(salt=b"x"), InvalidArgumentError, arg("salt")),
    Row("ReuseScope", "salt > u64", lambda w: ReuseScope(salt=2**64), InvalidArgumentError, arg("salt")),
    Row("ReuseScope", "lora_id < 0", lambda w: ReuseScope(lora_id=-1), InvalidArgumentError, arg("lora_id")),
    Row(
        "ReuseScope",
        "lora_id float",
        lambda w: ReuseScope(lora_id=1.0),
        InvalidArgumentError,
        arg("lora_id"),
    ),
    Row(
        "ReuseScope.from_cache_salt",
        "bytes",
        lambda w: ReuseScope.from_cache_salt(b"x"),
        InvalidArgumentError,
        arg("text"),
    ),
    Row(
        "block_keys",
        "token too large",
        lambda w: block_keys([2**31], 4),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row(
        "block_keys",
        "negative token",
        lambda w: block_keys(np.array([-1]), 4),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row(
        "block_keys",
        "bytes as tokens",
        lambda w: block_keys(b"abcd", 4),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row(
        "block_keys", "tpb 0", lambda w: block_keys(TOKENS, 0), InvalidArgumentError, arg("tokens_per_block")
    ),
    Row(
        "block_keys",
        "tpb str",
        lambda w: block_keys(TOKENS, "4"),
        InvalidArgumentError,
        arg("tokens_per_block"),
    ),
    Row(
        "block_keys",
        "tpb bool",
        lambda w: block_keys(TOKENS, True),
        InvalidArgumentError,
        arg("tokens_per_block"),
    ),
    Row("block_keys", "scope str", lambda w: block_keys(TOKENS, 4, "s"), InvalidArgumentError, arg("scope")),
    Row(
        "MultimodalItem",
        "short digest",
        lambda w: MultimodalItem(b"x", 0, 1),
        InvalidArgumentError,
        arg("digest"),
    ),
    Row(
        "MultimodalItem",
        "length 0",
        lambda w: MultimodalItem(KEY, 0, 0),
        InvalidArgumentError,
        arg("length"),
    ),
    Row(
        "lora_id_from_name", "empty", lambda w: lora_id_from_name(""), InvalidArgumentError, arg("lora name")
    ),
]

LOOKUPS = [
    Row("probe", "key 31 bytes", lambda w: w.mgr.probe(keys=[b"x" * 31]), InvalidArgumentError, arg("key")),
    Row("probe", "key str", lambda w: w.mgr.probe(keys=["x" * 32]), InvalidArgumentError, arg("key")),
    Row("probe", "one key as keys", lambda w: w.mgr.probe(keys=KEY), InvalidArgumentError, arg("keys")),
    Row(
        "probe",
        "tokens and keys",
        lambda w: w.mgr.probe(TOKENS, keys=[KEY]),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row("probe", "bytes as tokens", lambda w: w.mgr.probe(b"abcd"), InvalidArgumentError, arg("tokens")),
    Row(
        "export_blocks",
        "key 33 bytes",
        lambda w: w.mgr.export_blocks([b"x" * 33]),
        InvalidArgumentError,
        arg("key"),
    ),
    Row("export_blocks", "key int", lambda w: w.mgr.export_blocks([3]), InvalidArgumentError, arg("key")),
    Row(
        "export_blocks",
        "one key as keys",
        lambda w: w.mgr.export_blocks(KEY),
        InvalidArgumentError,
        arg("keys"),
    ),
    Row(
        "cool_blocks",
        "key 31 bytes",
        lambda w: w.mgr.cool_blocks([KEY, b"x" * 31]),
        InvalidArgumentError,
        arg("key"),
    ),
    Row("cool_blocks", "keys None", lambda w: w.mgr.cool_blocks(None), InvalidArgumentError, arg("keys")),
    Row(
        "lease_blocks", "key str", lambda w: w.mgr.lease_blocks(["x" * 32]), InvalidArgumentError, arg("key")
    ),
    Row(
        "lease_blocks",
        "one key as keys",
        lambda w: w.mgr.lease_blocks(KEY),
        InvalidArgumentError,
        arg("keys"),
    ),
    Row("release_lease", "str id", lambda w: w.mgr.release_lease("1"), InvalidArgumentError, arg("lease_id")),
    Row(
        "remember_checksums",
        "length mismatch",
        lambda w: w.mgr.remember_checksums([], [1]),
        InvalidArgumentError,
        arg("sums"),
    ),
    Row(
        "drain_events", "negative", lambda w: w.mgr.drain_events(-1), InvalidArgumentError, arg("max_events")
    ),
    Row("drain_events", "str", lambda w: w.mgr.drain_events("all"), InvalidArgumentError, arg("max_events")),
]

IMPORTS = [
    Row(
        "import_blocks",
        "not a sequence",
        lambda w: w.mgr.import_blocks(3),
        InvalidArgumentError,
        arg("blocks"),
    ),
    Row(
        "import_blocks",
        "priority str",
        lambda w: w.mgr.import_blocks([], priority="x"),
        InvalidArgumentError,
        arg("priority"),
    ),
    Row(
        "import_blocks",
        "record not a block",
        lambda w: w.mgr.import_blocks([3]),
        ImportRejectedError,
        {"index": 0},
    ),
    Row(
        "import_blocks",
        "short page",
        lambda w: w.mgr.import_blocks([_bad_block(w, data=b"x")]),
        ImportRejectedError,
        {"index": 0},
    ),
    Row(
        "import_blocks",
        "bad key",
        lambda w: w.mgr.import_blocks([_bad_block(w, key=b"k")]),
        ImportRejectedError,
        {"index": 0},
    ),
    Row(
        "import_pages",
        "records not BlockRecords",
        lambda w: w.mgr.import_pages(_bad_records(w), np.zeros((1, 512), np.uint8)),
        InvalidArgumentError,
        arg("records"),
    ),
    Row(
        "import_pages",
        "data of the wrong shape",
        lambda w: w.mgr.import_pages(BlockRecords.of([w.block]), np.zeros((1, 8), np.uint8), [0]),
        ImportRejectedError,
        {"index": None},
    ),
]

REQUESTS = [
    Row(
        "KvCache.extend",
        "bytes as tokens",
        lambda w: w.cache.extend(b"ab"),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row(
        "KvCache.extend",
        "token too large",
        lambda w: w.cache.extend([2**31]),
        InvalidArgumentError,
        arg("tokens"),
    ),
    Row(
        "KvCache.commit", "str count", lambda w: w.cache.commit("4"), InvalidArgumentError, arg("num_tokens")
    ),
    Row(
        "KvCache.commit",
        "past the tokens",
        lambda w: w.cache.commit(999),
        InvalidArgumentError,
        arg("num_tokens"),
    ),
    Row(
        "KvCache.block_key",
        "str index",
        lambda w: w.cache.block_key("0"),
        InvalidArgumentError,
        arg("index"),
    ),
    Row(
        "KvCache.block_key",
        "past the blocks",
        lambda w: w.cache.block_key(99),
        InvalidArgumentError,
        arg("index"),
    ),
    Row(
        "KvCache.block_num_tokens",
        "past the blocks",
        lambda w: w.cache.block_num_tokens(99),
        InvalidArgumentError,
        arg("index"),
    ),
    Row("KvCache.page", "negative", lambda w: w.cache.page(-1), InvalidArgumentError, arg("index")),
    Row(
        "KvCache.buffer_view",
        "past the blocks",
        lambda w: w.cache.buffer_view(99, 0, "k"),
        InvalidArgumentError,
        arg("index"),
    ),
]

TABLE = CREATE + KEYS_AND_SCOPES + LOOKUPS + IMPORTS + REQUESTS + CONFIGS + TRANSFER


@pytest.fixture
def world(make_manager: Callable[..., CacheManager], run_request: Callable[..., Any]) -> World:
    mgr = make_manager(8)
    run_request(mgr, TOKENS, request_id=1)
    block = mgr.export_blocks(block_keys(TOKENS, mgr.tokens_per_block))[0]
    cache = mgr.create(TOKENS[:4], request_id=2)
    assert cache.resume()
    return World(mgr, cache, block)


def _check_error(err: BaseException, row: Row) -> None:
    assert type(err) is row.error, f"{row.entry} {row.case}: {type(err).__name__}: {err}"
    for name, value in row.attrs.items():
        assert getattr(err, name) == value, f"{row.entry} {row.case}: {name}={getattr(err, name, None)!r}"
    assert type(err).__name__ in raykv.__all__ and getattr(raykv, type(err).__name__) is type(err)


@pytest.mark.parametrize("row", TABLE, ids=[f"{r.entry}-{r.case}" for r in TABLE])
def test_bad_call_raises_a_typed_error_and_changes_nothing(
    world: World, state_of: Callable[[CacheManager], dict[str, Any]], row: Row
) -> None:
    before = state_of(world.mgr)
    events_before = world.mgr.events.last_event_id
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        row.call(world)
    assert time.monotonic() - start < 10.0, f"{row.entry} {row.case} took too long"
    _check_error(info.value, row)
    assert isinstance(info.value, raykv.RayKVError)
    if isinstance(info.value, InvalidArgumentError | ConfigError):
        assert isinstance(info.value, ValueError)  # callers catching ValueError keep working
    assert state_of(world.mgr) == before
    assert world.mgr.events.last_event_id == events_before
    world.cache.close()


def test_every_entry_point_has_a_row_and_every_error_is_exported() -> None:
    entries = {row.entry for row in TABLE}
    assert len(TABLE) >= 80 and len(entries) >= 30
    for cls in {row.error for row in TABLE}:
        assert getattr(raykv, cls.__name__) is cls


def test_unanswered_connect_is_a_connect_error_within_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer that never answers the connection (SYNs dropped): reason ``connect``, bounded by
    ``connect_timeout_s``, not the whole pull's ``timeout_s``."""
    import asyncio

    async def hang(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(asyncio, "open_connection", hang)
    pc = client(connect_timeout_s=0.5, timeout_s=60.0)
    start = time.monotonic()
    with pytest.raises(TransferError) as info:
        pc.pull_sync(("127.0.0.1", free_port()), [KEY], prefer_shm=False)
    assert info.value.reason == "connect"
    assert time.monotonic() - start < 5.0
    assert pc.stats.failures["connect"] == 1
    pc.close()

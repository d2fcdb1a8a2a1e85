"""The ``core`` suite: block keys, radix tree operations, host <-> disk copies.

Rows (every figure higher-is-better; every baseline measured in the same run on the same data):

* ``block_keys <input> tpb=N``: MB/s of token bytes hashed by :func:`raykv.core.keys.block_keys` for an
  8192-token prompt given as a numpy int32 array or a Python list, against a raw
  ``hashlib.sha256(prev + chunk).digest()`` chain over the same (precomputed) bytes. Issue goal:
  >= 0.7x on the numpy path.
* ``probe(keys)`` / ``tree.match``: matches/s of a 100-block committed prefix through
  ``CacheManager.probe(keys=...)`` and through the bare ``BlockRadixTree.match``, against a walk of
  a plain ``dict`` of key -> children dicts over the same keys (a floor, not a competitor).
* ``create+close`` (tokens -> keys, match, hold, release) and the ``commit lifecycle``
  (create -> resume -> extend -> commit -> close of a new 100-block sequence): no baseline.
* host/disk copies and page checksums in :mod:`raykv.bench.core_io`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from time import perf_counter

import numpy as np
import numpy.typing as npt

from raykv.bench.core_io import checksum_benchmark, commit_new, copy_benchmark, demotion_benchmark
from raykv.bench.core_settings import FULL, QUICK, CoreSettings
from raykv.bench.harness import Benchmark, Row, median_seconds, paired_seconds, timed
from raykv.core.config import CacheConfig, KVLayout, TierConfig
from raykv.core.keys import DEFAULT_SCOPE, TokenSeq, block_keys
from raykv.core.manager import CacheManager
from raykv.core.types import BlockKey

TOKENS_PER_BLOCK = (16, 32, 64)
PREFIX_BLOCKS = 100
VOCAB = 32_000
NUMPY_GOAL = 0.7

Trie = dict[bytes, "Trie"]
"""A nested-dict trie: key -> children (the radix benchmarks' floor)."""


def core_benchmarks(settings: CoreSettings) -> list[Benchmark]:
    """The suite, in table order."""
    benches = [
        Benchmark(f"block_keys tpb={tpb}", functools.partial(bench_block_keys, settings, tpb))
        for tpb in TOKENS_PER_BLOCK
    ]
    benches.append(Benchmark("radix tree (100-block prefixes)", functools.partial(bench_radix, settings)))
    for kib in (64, 512):
        benches.append(
            Benchmark(f"host<->disk copies {kib} KiB", functools.partial(copy_benchmark, settings, kib))
        )
    benches.append(Benchmark("page checksums", functools.partial(checksum_benchmark, settings)))
    benches.append(Benchmark("manager demotion", functools.partial(demotion_benchmark, settings)))
    return benches


# ---- block keys ----------------------------------------------------------------------------------
def sha_chain_baseline(tokens: npt.NDArray[np.int32], tpb: int) -> tuple[Callable[[], bytes], int]:
    """The floor for block keys: ``sha256(prev + chunk).digest()`` over precomputed block bytes.

    Returns the loop (its result is the last key) and how many bytes it hashes per call (the full
    blocks' tokens as 4-byte little-endian, exactly what ``block_keys`` hashes).
    """
    n_full = len(tokens) // tpb
    data = tokens[: n_full * tpb].astype("<u4").tobytes()
    step = tpb * 4
    chunks = [data[i : i + step] for i in range(0, len(data), step)]
    root = bytes(DEFAULT_SCOPE.root_key())
    sha = hashlib.sha256

    def chain() -> bytes:
        prev = root
        for chunk in chunks:
            prev = sha(prev + chunk).digest()
        return prev

    return chain, len(data)


def bench_block_keys(settings: CoreSettings, tpb: int) -> list[Row]:
    """MB/s of ``block_keys(tokens, tpb)`` for numpy int32 and list input vs the raw sha256 chain."""
    rng = np.random.default_rng(tpb)
    tokens = rng.integers(0, VOCAB, settings.prompt_tokens, dtype=np.int32)
    inputs: list[tuple[str, TokenSeq, float | None]] = [
        ("numpy int32", tokens, NUMPY_GOAL),
        ("list", tokens.tolist(), None),
    ]
    chain, nbytes = sha_chain_baseline(tokens, tpb)
    expected = chain()
    rows = []
    for label, given, goal in inputs:
        ours = functools.partial(block_keys, given, tpb)
        if ours()[-1] != expected:
            raise AssertionError(f"block_keys({label}) disagrees with the raw sha256 chain")
        t_ours, t_base = paired_seconds(timed(ours), timed(chain), settings.key_repeats, settings.warmup)
        rows.append(
            Row(f"block_keys {label} tpb={tpb}", nbytes / t_ours / 1e6, nbytes / t_base / 1e6, "MB/s", goal)
        )
    return rows


# ---- radix tree ----------------------------------------------------------------------------------
def _radix_manager(settings: CoreSettings) -> CacheManager:
    """A host-only manager with tiny pages (512 bytes) and room for every sequence we commit."""
    layout = KVLayout.uniform(1, 1, 8, tokens_per_block=16)
    pages = (settings.radix_sequences + settings.warmup + 1) * PREFIX_BLOCKS
    return CacheManager(CacheConfig(layout, (TierConfig.host(pages * layout.page_bytes),)))


def _commit_sequence(mgr: CacheManager, tokens: npt.NDArray[np.int32]) -> float:
    """Seconds for create -> resume -> extend -> commit -> close of a brand-new sequence.

    As an engine does it: ``create`` gets the whole prompt (keys it, matches nothing), ``extend``
    appends the tokens that were not reused.
    """
    start = perf_counter()
    committed = commit_new(mgr, tokens)
    elapsed = perf_counter() - start
    if committed != len(tokens) // mgr.tokens_per_block:
        raise AssertionError(f"committed {committed} blocks, expected {len(tokens) // mgr.tokens_per_block}")
    return elapsed


def dict_trie(key_lists: list[list[BlockKey]]) -> Trie:
    """The floor's index: nested dicts, key -> children dict, one path per sequence."""
    trie: Trie = {}
    for keys in key_lists:
        node = trie
        for key in keys:
            node = node.setdefault(key, {})
    return trie


def dict_walk(trie: Trie, keys: list[BlockKey]) -> int:
    """How many leading ``keys`` the nested-dict trie holds (the probe's floor)."""
    node: Trie | None = trie
    n = 0
    for key in keys:
        node = node.get(key)  # type: ignore[union-attr]
        if node is None:
            break
        n += 1
    return n


def bench_radix(settings: CoreSettings) -> list[Row]:
    """Commit throughput, then probe / match / create ops/s over the committed 100-block prefixes."""
    rng = np.random.default_rng(7)
    n = settings.radix_sequences
    seqs = [rng.integers(0, VOCAB, PREFIX_BLOCKS * 16, dtype=np.int32) for _ in range(n + settings.warmup)]
    with _radix_manager(settings) as mgr:
        for tokens in seqs[n:]:
            _commit_sequence(mgr, tokens)  # warmup: committed but not timed
        commit_s = _median_commit(mgr, seqs[:n])
        rows = [Row("commit lifecycle 100 blocks", PREFIX_BLOCKS / commit_s, None, "blocks/s")]
        rows += _match_rows(mgr, seqs[:n], settings)
    return rows


def _median_commit(mgr: CacheManager, seqs: list[npt.NDArray[np.int32]]) -> float:
    """Median seconds of one commit lifecycle over ``seqs`` (one sample per sequence)."""
    samples = iter(seqs)
    return median_seconds(lambda: _commit_sequence(mgr, next(samples)), len(seqs), 0)


def _match_rows(mgr: CacheManager, seqs: list[npt.NDArray[np.int32]], settings: CoreSettings) -> list[Row]:
    """probe(keys) and tree.match vs the dict walk; create+close; all over committed prefixes."""
    key_lists = [block_keys(tokens, mgr.tokens_per_block) for tokens in seqs]
    trie = dict_trie(key_lists)
    root = DEFAULT_SCOPE.root_key()
    n, reps, warm = len(seqs), settings.radix_repeats, settings.warmup
    if any(mgr.probe(keys=k).num_blocks != PREFIX_BLOCKS for k in key_lists):
        raise AssertionError("a committed prefix does not fully match")
    if any(dict_walk(trie, k) != PREFIX_BLOCKS for k in key_lists):
        raise AssertionError("the dict trie does not hold every prefix")

    def probe_all() -> None:
        for keys in key_lists:
            mgr.probe(keys=keys)

    def match_all() -> None:
        for keys in key_lists:
            mgr.tree.match(root, keys)

    def walk_all() -> None:
        for keys in key_lists:
            dict_walk(trie, keys)

    def create_all() -> None:
        for tokens in seqs:
            mgr.create(tokens).close()

    t_probe, t_walk = paired_seconds(timed(probe_all), timed(walk_all), reps, warm)
    t_match, t_walk2 = paired_seconds(timed(match_all), timed(walk_all), reps, warm)
    with mgr.create(seqs[0]) as cache:
        if cache.num_reused_tokens != PREFIX_BLOCKS * 16:
            raise AssertionError("create() did not reuse the committed prefix")
    t_create = median_seconds(timed(create_all), reps, warm)
    return [
        Row("probe(keys) 100-block prefix", n / t_probe, n / t_walk, "ops/s"),
        Row("tree.match 100-block prefix", n / t_match, n / t_walk2, "ops/s"),
        Row("create+close 100-block prefix", n / t_create, None, "ops/s"),
    ]


def suite(quick: bool) -> tuple[list[Benchmark], str]:
    """The suite's benchmarks and description line (``quick``: CI mode)."""

    settings = QUICK if quick else FULL
    mode = "quick" if quick else "full"
    desc = (
        f"{mode} mode, median of {settings.key_repeats} (keys) / {settings.radix_repeats} (tree) / "
        f"{settings.copy_repeats} (copies) / {settings.demote_repeats} (demotion) repeats "
        f"after {settings.warmup} warmup"
    )
    return core_benchmarks(settings), desc


if __name__ == "__main__":
    import sys

    from raykv.bench.harness import module_main

    sys.exit(module_main("core", suite))

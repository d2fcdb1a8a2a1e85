"""Replay inputs: Mooncake trace parsing, derived tokens/text, the built-in workload generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raykv.core.errors import InvalidArgumentError
from raykv.core.keys import ReuseScope, block_keys
from raykv.replay.trace import (
    BLOCK_TOKENS,
    MAX_HASH_ID,
    Request,
    TraceError,
    block_text,
    check_request,
    load_mooncake,
    tokens_for,
    unique_blocks,
)
from raykv.replay.workload import WorkloadSpec, generate


def write_trace(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 1500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [0]},
]


def test_load_sorts_by_arrival_stably_and_converts_ms(tmp_path: Path) -> None:
    reqs = load_mooncake(write_trace(tmp_path / "t.jsonl", [*ROWS, ""]))
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 1.5]
    assert [r.hash_ids for r in reqs] == [(0, 3), (0, 1, 2), (0,)]
    assert reqs[1] == Request(1.5, 1100, 7, (0, 1, 2))
    assert len(load_mooncake(tmp_path / "t.jsonl", limit=2)) == 2


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "missing field"),
        ({"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [0]}, "timestamp"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [0]}, "output_length"),
        ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0]}, "expected 2"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}, "hash_ids"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [MAX_HASH_ID + 1]}, "hash_ids"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "0"}, "must be a list"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: object, needle: str) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [ROWS[0], bad])
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    assert "bad.jsonl:2" in str(info.value) and needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_empty_trace_and_bad_limit(tmp_path: Path) -> None:
    with pytest.raises(TraceError):
        load_mooncake(write_trace(tmp_path / "e.jsonl", ["", "  "]))
    with pytest.raises(InvalidArgumentError):
        load_mooncake(write_trace(tmp_path / "t.jsonl", ROWS), limit=0)
    with pytest.raises(FileNotFoundError):
        load_mooncake(tmp_path / "missing.jsonl")


def test_tokens_chain_like_the_hash_ids() -> None:
    a = Request(0.0, 1100, 1, (0, 1, 2))
    b = Request(0.0, 1300, 1, (0, 1, 9))
    c = Request(0.0, 1024, 1, (5, 1))
    ta = tokens_for(a)
    assert len(ta) == 1100 and ta.dtype == np.uint32
    assert list(ta[:3]) == [0, 1, 2] and ta[BLOCK_TOKENS] == BLOCK_TOKENS
    ka, kb, kc = (block_keys(tokens_for(r), BLOCK_TOKENS) for r in (a, b, c))
    assert len(ka) == 2 and len(kb) == 2  # the partial last block gets no key
    assert ka == kb  # same ids -> same keys
    assert kc[1] != ka[1]  # same id 1, different prefix -> different key
    assert len(tokens_for(a, max_blocks=1)) == BLOCK_TOKENS
    salted = block_keys(ta, BLOCK_TOKENS, ReuseScope(salt=7))
    assert salted[0] != ka[0]


def test_unique_blocks_counts_salt_scopes() -> None:
    reqs = [Request(0, 600, 1, (0, 1)), Request(0, 600, 1, (0, 2)), Request(0, 600, 1, (0, 1), salt=3)]
    assert unique_blocks(reqs) == 5


def test_block_text_is_fixed_width_and_distinct() -> None:
    texts = {block_text(h) for h in range(2000)}
    assert len(texts) == 2000 and {len(t) for t in texts} == {16}
    assert block_text(42) == block_text(42)


def test_generator_is_deterministic_by_seed() -> None:
    a, b = generate(WorkloadSpec(requests=150, seed=3)), generate(WorkloadSpec(requests=150, seed=3))
    c = generate(WorkloadSpec(requests=150, seed=4))
    assert a == b and a != c
    assert len(a) == 150
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    for r in a:
        check_request(r)


def test_generator_shapes_sessions_fanout_and_tenants() -> None:
    spec = WorkloadSpec(requests=300, seed=1, tenants=3)
    reqs = generate(spec)
    assert len({r.salt for r in reqs}) == 3
    by_session: dict[int, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    grows = fans = 0
    for rs in by_session.values():
        rs.sort(key=lambda r: r.arrival_s)
        first, last = rs[0], rs[-1]
        full = first.input_length // BLOCK_TOKENS
        if last.hash_ids[:full] == first.hash_ids[:full] and last.input_length > first.input_length:
            grows += 1  # a later turn (or the reduce) re-sends the earlier prompt's full blocks
        if len(rs) >= 4 and rs[1].arrival_s - rs[0].arrival_s < 1.0:
            fans += 1
    assert grows > 10 and fans > 3
    # every tenant uses the shared system prompts: the first block id recurs across salts
    firsts = {(r.hash_ids[0], r.salt) for r in reqs}
    assert len({h for h, _ in firsts}) <= spec.system_prompts
    assert len(firsts) > spec.system_prompts


def test_generator_rejects_bad_specs() -> None:
    for bad in ({"requests": 0}, {"chat_share": 1.5}, {"turns": (3, 2)}, {"tenants": 0}):
        with pytest.raises(InvalidArgumentError):
            WorkloadSpec(**bad)  # type: ignore[arg-type]

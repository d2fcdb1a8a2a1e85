"""RaykvConnector in one engine: bit-exact outputs over loaded blocks, scopes, tiers, faults.

Every output is compared with the ``baseline`` engine (no connector): the generated tokens and
every step's top-5 logprobs must be equal floats. What the connector did comes back in the
request output's ``kv_transfer_params["raykv"]``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

import ray  # noqa: E402

from actors.cache.cluster import RayKVCluster  # noqa: E402
from raykv import TierKind  # noqa: E402
from raykv.integrations.vllm.link import open_link  # noqa: E402
from raykv.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from raykv.integrations.vllm.testing import generate, tiny_layout  # noqa: E402

from .helpers import TPB, held, prompt, usable_blocks, wait_held, worker  # noqa: E402


def _same(got: Any, want: Any) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs  # exact floats, every step, top 5


def test_outputs_exact_for_none_some_all_blocks(
    baseline: Any, engine_a: Any, deployment: RayKVCluster
) -> None:
    full = prompt(1, 200)
    some = full[:96] + prompt(2, 104)  # shares 3 blocks
    none = prompt(3, 200)
    first = generate(engine_a, full)
    _same(first, generate(baseline, full))
    assert first.raykv["hit_blocks"] == 0 and first.raykv["offered_blocks"] == len(full) // TPB
    wait_held(deployment, 0, full, len(full) // TPB)

    again = generate(engine_a, full)
    _same(again, first)
    assert again.raykv["hit_blocks"] == again.raykv["loaded_blocks_ok"] == usable_blocks(full) == 6
    assert "load_errors" not in again.raykv and "async_loads" not in again.raykv  # a sync load

    part = generate(engine_a, some)
    _same(part, generate(baseline, some))
    assert part.raykv["hit_blocks"] == part.raykv["loaded_blocks_ok"] == 3

    fresh = generate(engine_a, none)
    _same(fresh, generate(baseline, none))
    assert fresh.raykv["hit_blocks"] == 0 and "loaded_blocks" not in fresh.raykv


def test_other_cache_salt_loads_nothing(baseline: Any, engine_a: Any, deployment: RayKVCluster) -> None:
    tokens = prompt(11, 170)
    generate(engine_a, tokens)
    wait_held(deployment, 0, tokens, len(tokens) // TPB)
    other = generate(engine_a, tokens, cache_salt="tenant-b")
    assert other.raykv["hit_blocks"] == 0
    _same(other, generate(baseline, tokens, cache_salt="tenant-b"))
    # the salted run stored its blocks in its own scope, and they are reused only there
    wait_held(deployment, 0, tokens, len(tokens) // TPB, salt="tenant-b")
    again = generate(engine_a, tokens, cache_salt="tenant-b")
    assert again.raykv["hit_blocks"] == usable_blocks(tokens)
    _same(again, other)


def test_demoted_to_disk_and_loaded_back_exact(
    baseline: Any, engine_a: Any, deployment: RayKVCluster
) -> None:
    tokens = prompt(21, 160)
    blocks = len(tokens) // TPB
    generate(engine_a, tokens)
    wait_held(deployment, 0, tokens, blocks)
    # fill worker 0's host tier (64 pages) with other blocks: the prompt's blocks go to disk
    filler = [[100_000 + r * 10_000 + i for i in range(32 * TPB)] for r in range(3)]
    for tokens_r in filler:
        ray.get(worker(deployment, 0).run_request.remote(tokens_r), timeout=60)
    tiers = held(deployment, 0, tokens).tiers
    assert len(tiers) == blocks and TierKind.DISK in tiers, tiers
    back = generate(engine_a, tokens)
    assert back.raykv["hit_blocks"] == back.raykv["loaded_blocks_ok"] == usable_blocks(tokens)
    _same(back, generate(baseline, tokens))


def test_pages_gone_between_lookup_and_load_recomputed(
    baseline: Any, engine_a: Any, deployment: RayKVCluster
) -> None:
    tokens = prompt(31, 192)
    generate(engine_a, tokens)
    wait_held(deployment, 0, tokens, len(tokens) // TPB)
    faulty = {"raykv": {"faults": {"drop_after_lookup": True}}}
    got = generate(engine_a, tokens, params=faulty)
    n = usable_blocks(tokens)
    assert got.raykv["hit_blocks"] == got.raykv["loaded_blocks"] == n
    assert got.raykv["load_errors"] == n and got.raykv.get("loaded_blocks_ok", 0) == 0
    _same(got, generate(baseline, tokens))


def test_pages_replaced_between_lookup_and_load_recomputed(
    baseline: Any, engine_a: Any, deployment: RayKVCluster
) -> None:
    """The blocks are dropped and another prompt's blocks are committed before the load (into the
    freed slots when the free list hands them out first): every block is a load error, whether
    the one-sided read's re-check sees other keys or no block, and the output stays exact."""
    tokens = prompt(37, 192)
    generate(engine_a, tokens)
    wait_held(deployment, 0, tokens, len(tokens) // TPB)
    faulty = {"raykv": {"faults": {"replace_after_lookup": prompt(38, 192)}}}
    got = generate(engine_a, tokens, params=faulty)
    n = usable_blocks(tokens)
    assert got.raykv["hit_blocks"] == got.raykv["loaded_blocks"] == n
    assert got.raykv["load_errors"] == n and got.raykv.get("loaded_blocks_ok", 0) == 0
    _same(got, generate(baseline, tokens))


def test_no_deployment_one_warning_and_no_op(ray_address: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="raykv.integrations.vllm.link"):
        link = open_link({"namespace": "raykv-vllm-absent", "ray_address": ray_address})
    assert link is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no deployment reachable" in caplog.records[0].getMessage()
    side = SchedulerSide(tiny_layout(), None)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=list(range(1, 200)), cache_salt=None)
    assert side.lookup(request, 0) == (0, False)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", num_computed_tokens=0)],
        num_scheduled_tokens={"r1": 199},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )
    meta = side.build(out, lambda rid: [list(range(7))])
    assert meta.link is None and meta.loads == [] and meta.stores == []
    assert side.finished(request) is None


def test_generated_blocks_stored_for_the_next_turn(engine_a: Any, deployment: RayKVCluster) -> None:
    tokens = prompt(61, 200)
    first = generate(engine_a, tokens, max_tokens=40)  # KV of 239 tokens: 7 full blocks
    assert first.raykv["offered_blocks"] == 7
    turn = tokens + list(first.tokens) + prompt(62, 20)
    wait_held(deployment, 0, turn, 7)
    following = generate(engine_a, turn)
    assert following.raykv["hit_blocks"] == following.raykv["loaded_blocks_ok"] == 7

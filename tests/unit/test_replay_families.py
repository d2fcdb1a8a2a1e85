"""Workload families (raykv replay --workload NAME) and the replay command's goal lines."""

from __future__ import annotations

import collections
import io
import itertools
from pathlib import Path

import pytest

from actors.cli.main import build_parser
from raykv.core.errors import InvalidArgumentError
from raykv.replay.families import DEFAULT_REQUESTS, FAMILIES, FamilySpec, generate_family
from raykv.replay.trace import check_request, unique_blocks


@pytest.mark.parametrize("name", list(FAMILIES))
def test_families_are_valid_seeded_and_sized(name: str) -> None:
    reqs = generate_family(FamilySpec(name, 300, seed=4))
    assert len(reqs) == 300 and reqs == generate_family(FamilySpec(name, 300, seed=4))
    assert reqs != generate_family(FamilySpec(name, 300, seed=5))
    for r in reqs:
        check_request(r)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    blocks = sum(r.num_blocks for r in reqs)
    assert unique_blocks(reqs) < blocks  # every family shares prefixes
    assert set(DEFAULT_REQUESTS) == set(FAMILIES)


def test_agentic_has_tenants_growing_sessions_and_millisecond_fan_outs() -> None:
    reqs = generate_family(FamilySpec("agentic", 2000))
    assert len({r.salt for r in reqs}) == 6
    by_session = collections.defaultdict(list)
    for r in reqs:
        by_session[r.session].append(r)
    fanouts = grows = 0
    for turns in by_session.values():
        for a, b in itertools.pairwise(turns):
            shared = a.hash_ids[: len(a.hash_ids) - 1]
            if b.arrival_s - a.arrival_s <= 0.02 and b.hash_ids[: len(shared)] == shared:
                fanouts += 1  # a parallel branch on the whole context (all but its own tail)
            elif b.input_length > a.input_length and b.hash_ids[: len(shared)] == shared:
                grows += 1  # the next step re-sends the grown context
    assert fanouts > 300 and grows > 300
    ideal = 1 - unique_blocks(reqs) / sum(r.num_blocks for r in reqs)
    assert 0.8 < ideal < 0.95


def test_bad_family_specs_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        FamilySpec("nope")
    with pytest.raises(InvalidArgumentError):
        FamilySpec("chat", 0)


def test_replay_command_prints_goal_lines_per_workload_and_one_summary(tmp_path: Path) -> None:
    argv = ["replay", "--workload", "chat,rag", "--requests", "120", "--workers", "3"]
    argv += ["--capacity-pct", "20", "--routers", "pow2,raykv,raykv_pull,pooled", "--out", str(tmp_path)]
    args = build_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    assert args.func(args, out, err) == 0
    text = out.getvalue()
    assert text.count("== chat") == 1 and text.count("== rag") == 1
    assert text.count("goal: cap 20%: raykv block hit >= pooled - 1.5 pp") == 2
    assert text.count("raykv_pull TTFT p90 <= 1.15x pooled") == 2
    summary = [line for line in text.splitlines() if line.startswith("goals: ")]
    assert len(summary) == 1 and "over 2 workload(s)" in summary[0]
    assert (tmp_path / "chat.json").exists() and (tmp_path / "rag.json").exists()
    with pytest.raises(InvalidArgumentError):
        bad = build_parser().parse_args(["replay", "--workload", "nope"])
        bad.func(bad, io.StringIO(), io.StringIO())


def test_routing_overrides_change_only_the_named_fields() -> None:
    from dataclasses import replace

    from actors.cli.replay import routing_overrides
    from raykv.routing.policy import DEFAULT_ROUTING

    assert routing_overrides("") == DEFAULT_ROUTING
    cfg = routing_overrides("hot_price=2.5, recent_weight=0.35,allow_pulls=true,balance_window=100")
    assert cfg == replace(
        DEFAULT_ROUTING, hot_price=2.5, recent_weight=0.35, allow_pulls=True, balance_window=100
    )
    for bad in (
        "nope=1",
        "hot_price",
        "hot_price=fast",
        "allow_pulls=1",
        "balance_window=1.5",
        "hot_price=-1",
    ):
        with pytest.raises(InvalidArgumentError):
            routing_overrides(bad)


def test_replay_command_says_when_it_runs_an_override(tmp_path: Path) -> None:
    """--routing replays an experiment: stdout and the JSON say which fields differ, and a run
    without it prints no such line."""
    import json

    from raykv.routing.policy import DEFAULT_ROUTING

    base = ["replay", "--workload", "chat", "--requests", "60", "--workers", "2", "--capacity-pct", "20"]
    base += ["--routers", "raykv", "--out", str(tmp_path)]
    for extra, said in (([], False), (["--routing", "hot_price=2.5"], True)):
        args = build_parser().parse_args(base + extra)
        out = io.StringIO()
        assert args.func(args, out, io.StringIO()) == 0
        assert ("routing: DEFAULT_ROUTING with {'hot_price': 2.5}" in out.getvalue()) == said
        meta = json.loads((tmp_path / "chat.json").read_text())["meta"]
        assert meta["routing"]["hot_price"] == (2.5 if said else DEFAULT_ROUTING.hot_price)


def test_agentic_shapes_parse_change_the_workload_and_reject_bad_fields() -> None:
    """``--shape`` draws the agentic family with other fields: the default shape is the family
    itself, a named field changes only what it names, and bad input is a typed error."""
    from raykv.replay.families import AgenticShape

    assert AgenticShape.parse("") == AgenticShape()
    shape = AgenticShape.parse("tenants=12, fanout_p=0.6,step_gap_s=0.2:1.5,fanout=4")
    assert (shape.tenants, shape.fanout_p, shape.step_gap_s, shape.fanout) == (12, 0.6, (0.2, 1.5), (4, 4))
    base = generate_family(FamilySpec("agentic", 500, 3))
    assert generate_family(FamilySpec("agentic", 500, 3, AgenticShape())) == base
    many = generate_family(FamilySpec("agentic", 2000, 3, AgenticShape.parse("tenants=12")))
    assert many[:500] != base and len({r.salt for r in many}) == 12
    wide = generate_family(FamilySpec("agentic", 2000, 3, AgenticShape.parse("fanout_p=1,fanout=8")))
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(wide) if a.session == b.session]
    assert sum(g <= 0.02 for g in gaps) > 0.8 * len(gaps)  # nearly every step is an 8-way fan-out
    bad_shapes = ("nope=1", "tenants", "tenants=x", "tenants=0", "fanout=3:2", "fanout_p=2", "step_gap_s=2:1")
    for bad in bad_shapes:
        with pytest.raises(InvalidArgumentError):
            AgenticShape.parse(bad)
    with pytest.raises(InvalidArgumentError):
        FamilySpec("chat", 100, 0, AgenticShape())


def test_replay_command_shapes_only_the_agentic_family(tmp_path: Path) -> None:
    base = ["replay", "--requests", "60", "--workers", "2", "--capacity-pct", "20", "--routers", "raykv"]
    base += ["--out", str(tmp_path), "--shape", "tenants=2"]
    args = build_parser().parse_args([*base, "--workload", "agentic"])
    assert args.func(args, io.StringIO(), io.StringIO()) == 0
    args = build_parser().parse_args([*base, "--workload", "chat"])
    with pytest.raises(InvalidArgumentError):
        args.func(args, io.StringIO(), io.StringIO())

"""The cache-aware router's logic (CacheRanker) on fake replicas and a real in-process index:
which replica is ranked first, load accounting, the index credit, and the fallback to power of
two choices when the index is slow, failing or unreachable."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from deps import require

require("ray.serve")

from import_support import toks  # noqa: E402

from actors.serve.fields import CAPACITY_FIELD, PULLS_FIELD, TIMING_FIELD, worker_of  # noqa: E402
from actors.serve.ranking import CacheRanker, IndexView  # noqa: E402
from actors.serve.routed import RoutedRequest, parse_request, scope_of  # noqa: E402
from raykv.core.errors import ConfigError  # noqa: E402
from raykv.core.keys import ReuseScope, block_keys, lora_id_from_name  # noqa: E402
from raykv.core.types import WorkerId  # noqa: E402
from raykv.index.prefix_index import OP_STORE, EventBatch, PrefixIndex, RouteMatch  # noqa: E402

TPB = 4
A, B, C = WorkerId("w-a"), WorkerId("w-b"), WorkerId("w-c")


@dataclass
class FakeReplica:
    replica_id: str
    worker: str | None
    queued: int = 0
    decodes: int = 0
    ts: float = 0.0
    replica_metadata: dict[str, Any] = field(default_factory=dict)
    capacity: int | None = None
    timing: list[int] | None = None

    @property
    def routing_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"queued_prefill_tokens": self.queued, "running_decodes": self.decodes}
        stats["ts"] = self.ts
        if self.capacity is not None:
            stats[CAPACITY_FIELD] = self.capacity
        if self.worker:
            stats["raykv_worker"] = self.worker
        if self.timing is not None:
            stats[TIMING_FIELD] = self.timing
        return stats


class FakeIndex:
    """A real PrefixIndex behind the async route/predict calls the router makes."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.index = PrefixIndex()
        for lane, w in enumerate((A, B, C)):
            self.index.register_worker(w, lane, 1)
        self.delay_s, self.fail = delay_s, fail
        self.queries = 0
        self.connects = 0
        self.next_id = {A: 1, B: 1, C: 1}

    def hold(self, worker: WorkerId, tokens: list[int], scope: ReuseScope | None = None) -> None:
        keys = block_keys(tokens, TPB, scope)
        first = self.next_id[worker]
        ops = tuple((OP_STORE, k, 0) for k in keys)
        self.index.apply_batch(EventBatch(worker, 1, first, first + len(ops) - 1, ops))
        self.next_id[worker] += len(ops)

    async def route_async(
        self, keys: list[bytes], budget_ms: float | None = None
    ) -> dict[WorkerId, RouteMatch]:
        self.queries += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("index shard died")
        return self.index.route(keys)

    def predict(self, worker: WorkerId, keys: list[bytes]) -> None:
        self.index.predict(worker, keys)


def ranker(index: FakeIndex, budget: float = 0.5, retry_after: float = 30.0, **routing: Any) -> CacheRanker:
    async def connect() -> IndexView:
        index.connects += 1
        return IndexView(index, TPB)

    return CacheRanker(connect, routing, time_budget_s=budget, retry_after_s=retry_after, seed=1)


def replicas(*loads: int) -> list[FakeReplica]:
    workers = ("w-a", "w-b", "w-c")
    return [FakeReplica(f"r{i}", workers[i], q) for i, q in enumerate(loads)]


def req(tokens: list[int], scope: ReuseScope | None = None) -> RoutedRequest:
    return RoutedRequest(tuple(tokens), scope or ReuseScope())


def first(ranks: list[list[Any]]) -> list[str]:
    return [r.replica_id for r in ranks[0]]


def flat(ranks: list[list[Any]]) -> list[str]:
    return sorted(r.replica_id for rank in ranks for r in rank)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_replica_holding_the_prefix_ranks_first() -> None:
    index = FakeIndex()
    index.hold(B, toks(1, 24))
    reps = replicas(0, 0, 0)
    ranks = run(ranker(index).rank(reps, req(toks(1, 30))))
    assert first(ranks) == ["r1"]
    assert flat(ranks) == ["r0", "r1", "r2"]  # every replica stays reachable, best first


def test_a_longer_prefix_beats_a_shorter_one_and_scopes_do_not_mix() -> None:
    index = FakeIndex()
    salt = scope_of(cache_salt="tenant-x")
    index.hold(A, toks(2, 8))
    index.hold(C, toks(2, 20))
    index.hold(B, toks(2, 40), salt)
    r = ranker(index)
    assert first(run(r.rank(replicas(0, 0, 0), req(toks(2, 40))))) == ["r2"]
    assert first(run(r.rank(replicas(0, 0, 0), req(toks(2, 40), salt)))) == ["r1"]


def test_reported_load_outweighs_a_cached_prefix() -> None:
    index = FakeIndex()
    index.hold(A, toks(3, 8))
    reps = replicas(5000, 0, 0)
    ranks = run(ranker(index).rank(reps, req(toks(3, 12))))
    assert first(ranks) != ["r0"]
    assert ["r0"] in [[r.replica_id for r in rank] for rank in ranks]


def test_in_flight_requests_count_until_completed_or_reported() -> None:
    index = FakeIndex()
    index.hold(A, toks(4, 8))
    r = ranker(index, imbalance_slack=100.0, recent_weight=0.0)  # the reported loads alone
    reps = replicas(0, 0, 0)
    assert first(run(r.rank(reps, req(toks(4, 12)), "q1"))) == ["r0"]
    r.routed("q1", "r0", A)
    for i in range(3):  # big uncached requests the router itself sent to r0
        r.routed(f"big{i}", "r0", A)
        r._sent[f"big{i}"].tokens = 4000
    assert first(run(r.rank(reps, req(toks(4, 12))))) != ["r0"]
    reps[0].ts = time.time() + 1  # r0 reported after those were sent: its stats include them
    assert first(run(r.rank(reps, req(toks(4, 12))))) == ["r0"]
    reps[0].ts = 0.0
    for i in range(3):
        r.completed(f"big{i}")
    assert first(run(r.rank(reps, req(toks(4, 12))))) == ["r0"]


def test_work_just_ranked_first_counts_against_its_replica() -> None:
    """The deployed policy charges recent work on the wall clock, as the replay does on its
    simulated one: requests on a prefix nobody holds, reported loads all equal, do not all go to
    the same replica; with ``recent_weight`` 0 the seeded tie-break alone picks."""
    index = FakeIndex()
    reps = replicas(0, 0, 0)
    r = ranker(index)
    firsts = {first(run(r.rank(reps, req(toks(5 + i, 8)))))[0] for i in range(3)}
    assert firsts == {"r0", "r1", "r2"}
    plain = ranker(index, recent_weight=0.0)
    assert len({first(run(plain.rank(reps, req(toks(5 + i, 8)))))[0] for i in range(3)}) < 3


def test_a_completed_request_leaves_a_report_taken_while_it_ran() -> None:
    index = FakeIndex()
    index.hold(A, toks(4, 8))
    r = ranker(index)
    reps = replicas(0, 0, 0)
    r.routed("big", "r0", A)
    r._sent["big"].tokens = 5000
    r._sent["big"].at = time.time() - 1.0
    reps[0].ts = time.time() - 0.5  # r0 reported while "big" ran: the report counts it
    reps[0].queued = 5000
    assert first(run(r.rank(reps, req(toks(4, 12))))) != ["r0"]
    r.completed("big")  # ... and it completed after that report: r0 is idle, the holder wins
    assert first(run(r.rank(reps, req(toks(4, 12))))) == ["r0"]
    reps[0].ts = time.time() + 2  # a later report is believed as it is
    assert first(run(r.rank(reps, req(toks(4, 12))))) != ["r0"]


def test_a_completed_request_stops_counting_as_a_running_decode() -> None:
    index = FakeIndex()
    index.hold(A, toks(4, 8))
    r = ranker(index, decode_weight=500.0)
    reps = replicas(0, 0, 0)
    r.routed("chat", "r0", A)
    r._sent["chat"].at = time.time() - 1.0
    reps[0].ts, reps[0].decodes = time.time() - 0.5, 3  # reported while "chat" (and 2 more) ran
    r.completed("chat")
    ranker_load = r._load(WorkerId("c"), reps[0])
    assert ranker_load.running_decodes == 2 and ranker_load.queued_prefill_tokens == 0


def test_routing_credits_the_chosen_worker_in_the_index() -> None:
    index = FakeIndex()
    r = ranker(index, recent_weight=0.0)  # the credit alone (recent work would spread a burst)
    tokens = toks(5, 16)
    ranks = run(r.rank(replicas(0, 0, 0), req(tokens), "q1"))
    chosen = ranks[0][0]
    r.routed("q1", chosen.replica_id, WorkerId(chosen.worker))
    match = index.index.route(block_keys(tokens, TPB))[WorkerId(chosen.worker)]
    assert match.predicted == 4
    r.completed("q1")
    for _ in range(5):  # the next requests with this prefix follow it before any event arrives
        assert first(run(r.rank(replicas(0, 0, 0), req([*tokens, 1])))) == [chosen.replica_id]


def test_ties_break_by_seed_and_replay_identically() -> None:
    reps = replicas(0, 0, 0)
    picks = [first(run(ranker(FakeIndex()).rank(reps, req(toks(6, 8)))))[0] for _ in range(3)]
    assert len(set(picks)) == 1


def test_slow_index_falls_back_within_the_time_budget_then_recovers() -> None:
    index = FakeIndex(delay_s=2.0)
    r = ranker(index, budget=0.05, retry_after=0.3)
    reps = replicas(30, 0, 10)

    async def scenario() -> None:
        t0 = time.monotonic()
        ranks = await r.rank(reps, req(toks(7, 12)))
        assert time.monotonic() - t0 < 0.5
        assert len(ranks) == 1 and len(ranks[0]) == 2  # power of two choices
        assert ranks[0][0].queued <= ranks[0][1].queued  # less loaded first
        assert r.counters["index_timeouts"] == 1 and r.counters["fallback"] == 1
        await r.rank(reps, req(toks(7, 12)))  # backing off: the index is not asked again
        assert index.queries == 1 and r.counters["fallback"] == 2
        index.delay_s = 0.0
        await asyncio.sleep(0.35)  # after retry_after_s: reconnect, and route with the index
        index.hold(B, toks(7, 8))
        assert first(await r.rank(reps, req(toks(7, 12)))) == ["r1"]
        assert index.queries == 2 and index.connects == 2 and r.counters["cache_routed"] == 1

    run(scenario())


def test_failing_or_unreachable_index_never_fails_routing() -> None:
    r = ranker(FakeIndex(fail=True))
    assert len(run(r.rank(replicas(0, 0, 0), req(toks(8, 12))))[0]) == 2
    assert r.counters["index_errors"] == 1

    async def refuse() -> IndexView:
        raise ConnectionError("no raykv deployment")

    down = CacheRanker(refuse, time_budget_s=0.2, retry_after_s=30.0)
    assert len(run(down.rank(replicas(0, 0), req(toks(8, 12))))[0]) == 2
    assert down.link.view is None and down.counters["fallback"] == 1


def test_target_worker_and_unpaired_replicas() -> None:
    index = FakeIndex()
    index.hold(A, toks(9, 16))
    reps = [*replicas(0, 0), FakeReplica("r9", None)]
    r = ranker(index)
    target = RoutedRequest(tuple(toks(9, 16)), ReuseScope(), B)
    assert first(run(r.rank(reps, target))) == ["r1"] and index.queries == 0
    ranks = run(r.rank(reps, req(toks(9, 16))))
    assert first(ranks) == ["r0"] and flat(ranks) == ["r0", "r1", "r9"]
    assert run(r.rank(reps, None))[0][0].replica_id in {"r0", "r1", "r9"}
    assert len(run(r.rank(reps, req([2**40, 1, 2, 3])))[0]) == 2  # bad token ids: fallback
    assert run(r.rank([], req(toks(9, 16)))) == []


def test_worker_id_comes_from_metadata_or_stats() -> None:
    rep = FakeReplica("r0", "w-b")
    assert worker_of(rep) == B
    rep.replica_metadata = {"raykv_worker": "w-c"}
    assert worker_of(rep) == C
    assert worker_of(FakeReplica("r1", None)) is None
    assert worker_of(object()) is None


SQL = lora_id_from_name("sql-adapter")


class LoraReq:
    """A vLLM-style LoRARequest known only by name."""

    lora_name = "sql-adapter"
    lora_int_id = None


class Req:
    prompt_token_ids = (5, 6, 7)
    lora_id = 2
    cache_salt = 99


@pytest.mark.parametrize(
    "args,kwargs,want",
    [
        (({"tokens": [1, 2, 3]},), {}, RoutedRequest((1, 2, 3), ReuseScope())),
        ((), {"token_ids": [4], "cache_salt": "s"}, RoutedRequest((4,), ReuseScope.from_cache_salt("s"))),
        ((Req(),), {}, RoutedRequest((5, 6, 7), ReuseScope(2, 99))),
        (({"tokens": [1], "target_worker": "w-a"},), {}, RoutedRequest((1,), ReuseScope(), A)),
        (({"tokens": [1], "session_id": 12},), {}, RoutedRequest((1,), ReuseScope(), None, "12")),
        (("just text",), {}, None),
        (({"tokens": ["x"]},), {}, None),
        (({"tokens": [1], "lora_id": -1},), {}, None),
        (({"tokens": [1], "lora_id": ""},), {}, None),
        (({"tokens": [1], "lora_id": "sql-adapter"},), {}, RoutedRequest((1,), ReuseScope(SQL))),
        (({"tokens": [1], "lora_request": {"lora_int_id": 7}},), {}, RoutedRequest((1,), ReuseScope(7))),
        (({"tokens": [1], "lora_request": LoraReq()},), {}, RoutedRequest((1,), ReuseScope(SQL))),
        ((), {}, None),
    ],
)
def test_parse_request(args: tuple[Any, ...], kwargs: dict[str, Any], want: RoutedRequest | None) -> None:
    assert parse_request(args, kwargs) == want


def test_a_session_hashes_only_its_new_blocks() -> None:
    index = FakeIndex()
    index.hold(B, toks(4, 24))
    r = ranker(index)
    turn1 = RoutedRequest(tuple(toks(4, 24)), ReuseScope(), None, "chat-1")
    turn2 = RoutedRequest(tuple(toks(4, 40)), ReuseScope(), None, "chat-1")
    assert first(run(r.rank(replicas(0, 0, 0), turn1))) == ["r1"]
    assert first(run(r.rank(replicas(0, 0, 0), turn2))) == ["r1"]
    assert r.sessions(TPB).reused_blocks == len(toks(4, 24)) // TPB
    assert r.keys(turn2, TPB) == block_keys(toks(4, 40), TPB)


def test_routing_overrides_are_validated() -> None:
    """Bad values and unknown names (a retired ``load_cost``) are ConfigErrors naming them."""
    with pytest.raises(ValueError):
        ranker(FakeIndex(), w_host=2.0)
    for bogus in ({"bogus": 1}, {"load_cost": 0.12}):
        with pytest.raises(ConfigError) as info:
            ranker(FakeIndex(), decode_weight=8.0, **bogus)
        assert next(iter(bogus)) in str(info.value)
    assert ranker(FakeIndex(), decode_weight=8.0).config(TPB).decode_weight == 8.0


def test_adapter_names_map_to_a_stable_lora_id_distinct_from_text_scopes() -> None:
    sql = lora_id_from_name("sql-adapter")
    assert sql == lora_id_from_name("sql-adapter") != lora_id_from_name("chat-adapter")
    assert 0 <= sql < 2**64
    assert scope_of("sql-adapter", "tenant") == ReuseScope.from_cache_salt("tenant", sql)
    named = block_keys([1, 2, 3, 4], TPB, scope_of("sql-adapter"))
    assert named == block_keys([1, 2, 3, 4], TPB, ReuseScope(sql))
    assert named != block_keys([1, 2, 3, 4], TPB, ReuseScope())  # not the base model's blocks
    with pytest.raises(ValueError):
        lora_id_from_name("")


def test_decisions_are_exported_by_outcome_with_time_and_learned_prices() -> None:
    """Each decision's outcome counts in the router's Prometheus series (tag ``deployment``);
    a cache-aware one also records its time and the policy's prices after it."""
    from metrics_support import Recorder

    from actors.cache.metrics import RouterMetrics

    rec = Recorder()
    index = FakeIndex()
    index.hold(A, toks(7, 8))

    async def connect() -> IndexView:
        return IndexView(index, TPB)

    r = CacheRanker(connect, None, 0.5, 30.0, 1, RouterMetrics("app", backend=rec))
    reps = replicas(0, 0, 0)
    assert first(run(r.rank(reps, req(toks(7, 12))))) == ["r0"]  # cache-routed
    run(r.rank(reps, None))  # no request: power of two choices
    index.fail = True
    run(r.rank(reps, req(toks(7, 12))))  # the index fails: counted, then a fallback
    got = {dict(tags)["outcome"]: v for tags, v in rec.named("raykv_router_decisions").items()}
    assert got == {"cache_routed": 1.0, "fallback": 2.0, "index_errors": 1.0}
    assert got == {k: v for k, v in r.counters.items() if k in got}  # the same as the counters
    seconds = [v for name, tags, v in rec.observed if name == "raykv_router_decision_seconds"]
    assert len(seconds) == 1 and 0 < seconds[0] < 0.5
    policy = r.policy(TPB)
    assert rec.get("raykv_router_duplicate_price", deployment="app") == policy.duplicate_price > 0
    assert rec.get("raykv_router_pull_price", deployment="app") == policy.pull_price
    with pytest.raises(ValueError):
        RouterMetrics("app", backend=Recorder()).count("made_up")


def test_reported_capacities_reach_the_policy_and_turn_on_cold_placement() -> None:
    """Replicas report their worker's capacity in blocks; the ranker hands it to its policy
    (once per change), which then places cold requests away from a full worker."""
    index = FakeIndex()
    r = ranker(index, recent_weight=0.0)
    reps = replicas(0, 0, 0)
    for rep in reps:
        rep.capacity = 4
    reps[2].replica_metadata = {CAPACITY_FIELD: 9}  # metadata first, as for the worker name
    run(r.rank(reps, req(toks(5, 40))))
    policy = r.policy(TPB)
    assert policy.placement.capacity == {"replica-0": 4, "replica-1": 4, "replica-2": 9}
    moved = policy.placement.moved
    for i in range(6):  # cold requests of 10 blocks each: every worker fills, then the rule acts
        run(r.rank(reps, req(toks(100 + i, 40))))
    assert policy.placement.moved > moved
    assert r.counters["cold_placed"] == policy.placement.moved


def test_cold_placements_are_exported() -> None:
    from metrics_support import Recorder

    from actors.cache.metrics import RouterMetrics

    rec = Recorder()
    index = FakeIndex()

    async def connect() -> IndexView:
        return IndexView(index, TPB)

    r = CacheRanker(connect, {"recent_weight": 0.0}, 0.5, 30.0, 1, RouterMetrics("app", backend=rec))
    reps = replicas(0, 0, 0)
    for rep in reps:
        rep.capacity = 4
    for i in range(7):
        run(r.rank(reps, req(toks(200 + i, 40))))
    placed = r.policy(TPB).placement.moved
    assert placed > 0 and rec.get("raykv_router_cold_placed", deployment="app") == placed


def test_a_prefix_in_flight_on_its_holder_is_hot_as_in_the_replay() -> None:
    """The deployed ranker applies the policy's hot-prefix rule on its own records: while the
    request that brought a prefix to its holder is still in flight there, a request on that
    prefix is re-decided at ``hot_price`` (a burst spreads to a second copy); once it completed,
    the same request stays with the holder. The holder's queue (150 tokens) is set between the
    two prices: a second copy of the 40 cached tokens costs 44 + 40 x price."""
    index = FakeIndex()
    prefix = toks(7, 40)  # 10 blocks, held by w-a
    index.hold(A, prefix)
    r = ranker(index, recent_weight=0.0)
    reps = replicas(0, 0, 0)
    assert first(run(r.rank(reps, req([*prefix, 1, 2, 3, 4]), "lead"))) == ["r0"]
    r.routed("lead", "r0", A)
    reps[0].queued = 150
    branch = run(r.rank(reps, req([*prefix, 5, 6, 7, 8]), "branch"))
    assert first(branch) != ["r0"]  # hot: 44 + 40 x 2.25 = 134 < 150 + 4 + 4
    r.completed("lead")
    assert first(run(r.rank(reps, req([*prefix, 9, 10, 11, 12])))) == ["r0"]  # 44 + 40 x ~4 > 154
    assert not r._brought  # the completed request's keys are forgotten


def test_keys_of_requests_no_longer_in_flight_are_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot-prefix records stay bounded: past ``MAX_KEYS`` keys, those of requests the
    ranker no longer tracks (their replica died, or their completion never came) are dropped."""
    monkeypatch.setattr(CacheRanker, "MAX_KEYS", 20)
    r = ranker(FakeIndex(), recent_weight=0.0)
    reps = replicas(0, 0, 0)
    for i, replica in enumerate(["r0"] * 3 + ["r1"] * 5):
        run(r.rank(reps, req(toks(300 + i, 40)), f"q{i}"))  # 10 blocks each, nothing cached
        r.routed(f"q{i}", replica, A if replica == "r0" else B)
        if i == 2:
            assert len(r._brought) == 30  # all three in flight: kept past the limit
            r.forget_replica("r0")  # ... until their replica died
    assert len(r._brought) == 50 and set(r._brought.values()) == {f"q{i}" for i in range(3, 8)}


def pulling(holder_load: int) -> tuple[FakeIndex, list[int], list[FakeReplica]]:
    """An index where w-a holds a 40-token prefix, and three replicas that announce pulls, the
    holder's with ``holder_load`` queued tokens."""
    index = FakeIndex()
    prefix = toks(9, 40)
    index.hold(A, prefix)
    reps = replicas(holder_load, 0, 0)
    for rep in reps:
        rep.replica_metadata = {PULLS_FIELD: True}
    return index, prefix, reps


def test_replicas_whose_engines_pull_remote_hits_are_routed_with_pull_prices() -> None:
    """When every candidate announces ``raykv_pulls`` (the vLLM connector fetches a hit another
    worker holds), a block held elsewhere costs its pull (0.5 x 40 tokens here, before any pull
    is observed), not a recompute plus the duplicate price: a request leaves its busy holder.
    One replica without the announcement, or an ``allow_pulls`` override, keeps recompute
    pricing, and the request stays."""
    index, prefix, reps = pulling(150)
    r = ranker(index)
    assert first(run(r.rank(reps, req([*prefix, 1, 2, 3, 4]), "p"))) != ["r0"]  # 24 < 154
    assert r.policy(TPB, True).cfg.allow_pulls and r.policy(TPB, True).decisions == 1
    assert first(run(ranker(index, allow_pulls=False).rank(reps, req([*prefix, 1, 2, 3, 4])))) == ["r0"]
    reps[2].replica_metadata = {PULLS_FIELD: False}
    mixed = ranker(index)
    assert first(run(mixed.rank(reps, req([*prefix, 1, 2, 3, 4])))) == ["r0"]  # 44 + 40 x 4 > 154
    assert not mixed.policy(TPB).cfg.allow_pulls and mixed.policy(TPB).decisions == 1
    r.routed("p", "r1", B)  # last: the index credit makes w-b a holder too
    assert not r._brought  # no hot-prefix records: with pulls the policy never asks


def test_the_pull_price_is_learned_from_the_pulls_and_prefills_replicas_report() -> None:
    """Replicas report their engines' pull and prefill totals (``raykv_timing``); the router
    feeds the policy what changed since each replica's last report, so its pull price is the
    deployment's own: 100 us per pulled token against 1000 per prefilled one is 0.1, and a
    40-token pull then beats a 15-token queue. Unchanged totals add nothing; totals that went
    down (a restarted replica) count from zero."""
    index, prefix, reps = pulling(15)
    r = ranker(index)
    assert first(run(r.rank(reps, req([*prefix, 1, 2, 3, 4])))) == ["r0"]  # 0.5 x 40 + 4 > 4 + 15
    policy = r.policy(TPB, True)
    assert policy.pull_price == pytest.approx(0.5)
    reps[1].timing = [400, 40_000, 1000, 1_000_000]
    assert first(run(r.rank(reps, req([*prefix, 5, 6, 7, 8])))) != ["r0"]  # 0.1 x 40 + 4 < 4 + 15
    assert policy.pull_price == pytest.approx(0.1)
    run(r.rank(reps, req([*prefix, 5, 6, 7, 8])))  # the same totals again: no new observation
    assert policy.pull_price == pytest.approx(0.1)
    reps[1].timing = [400 + 100, 40_000 + 30_000, 1000, 1_000_000]  # one slow pull: 300 us/token
    run(r.rank(reps, req([*prefix, 5, 6, 7, 8])))
    assert policy.pull_price == pytest.approx((100 + 0.02 * 200) / 1000)
    reps[1].timing = [10, 1_000_000, 10, 1_000_000]  # restarted: its totals are new observations
    run(r.rank(reps, req([*prefix, 5, 6, 7, 8])))
    pull_s, prefill_s = 104e-6 + 0.02 * (0.1 - 104e-6), 1e-3 + 0.02 * (0.1 - 1e-3)
    assert policy.pull_price == pytest.approx(pull_s / prefill_s)
    reps[2].timing = [1, 2]  # malformed: ignored
    run(r.rank(reps, req([*prefix, 5, 6, 7, 8])))
    assert policy.pull_price == pytest.approx(pull_s / prefill_s)

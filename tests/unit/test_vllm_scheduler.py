"""The vLLM connector's scheduler side without vLLM: sync and async loads with a fake link.

Requests, scheduler outputs and the deployment link are stand-ins; what is checked is the
protocol of vLLM's V1 connector API as raykv's SchedulerSide and WorkerSide speak it:
``get_num_new_matched_tokens`` answers ``(tokens, False)`` when the paired worker holds the
blocks and ``(tokens, True)`` while a fetch from another worker runs; the fetch is polled in each
step's plan and its load goes out once, asynchronous, with the blocks it did not bring as lost
blocks; a request that finishes while it waits is released, never loaded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from raykv import InvalidArgumentError, KVLayout, ReuseScope
from raykv.integrations.vllm.link import Match
from raykv.integrations.vllm.plan import LoadOp, RaykvMetadata, WorkerReport, rank_scope
from raykv.integrations.vllm.scheduler import SchedulerSide
from raykv.integrations.vllm.timing import TIMING_EVERY_S
from raykv.integrations.vllm.worker import WorkerSide
from raykv.transfer.inbox import InboxCommit

TPB = 4
LAYOUT = KVLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=TPB, dtype="float32")
PROMPT = list(range(1, 6 * TPB + 2))  # 6 full blocks and 1 token: 6 usable blocks
BLOCKS = [10, 11, 12, 13, 14, 15, 16]  # engine blocks vLLM allocates


class FakeFetch:
    def __init__(self, match: Match) -> None:
        self.match = match
        self.result: int | None = None
        self.cancelled = False


class FakeLink:
    """A DeploymentLink whose lookups answer ``self.match`` and whose fetches the test resolves."""

    worker = "w0"
    layout = LAYOUT
    timeout_s = 10.0

    def __init__(self, match: Match) -> None:
        self.match = match
        self.fetches: list[FakeFetch] = []
        self.lookups = 0
        self.timings: list[list[int]] = []
        self.stored: list[Any] = []

    def engine_link(self, inbox_bytes: int, listen_host: str) -> Any:
        return None

    def lookup(
        self,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        hint: Mapping[str, Any],
        mm_items: tuple[Any, ...] = (),
    ) -> Match:
        self.lookups += 1
        return self.match

    def start_fetch(
        self,
        match: Match,
        tokens: Sequence[int],
        scope: ReuseScope,
        keys: Sequence[bytes],
        mm_items: tuple[Any, ...] = (),
    ) -> FakeFetch:
        self.fetches.append(FakeFetch(match))
        return self.fetches[-1]

    def poll_fetch(self, fetch: Any, wait_s: float = 0.0) -> int | None:
        return None if fetch.cancelled else fetch.result

    def cancel_fetch(self, fetch: Any) -> None:
        fetch.cancelled = True

    def store(self, commits: Sequence[Any]) -> None:
        self.stored.extend(commits)

    def report_timing(self, totals: Sequence[int]) -> None:
        self.timings.append(list(totals))

    def poll(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def _request(req_id: str = "r1") -> Any:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=PROMPT, cache_salt=None, kv_transfer_params=None
    )


def _idle_step() -> Any:
    """A scheduler output with nothing scheduled (the request waits for its KV)."""
    cached = SimpleNamespace(req_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        scheduled_cached_reqs=cached,
        total_num_scheduled_tokens=0,
    )


def _build(side: SchedulerSide) -> RaykvMetadata:
    return side.build(_idle_step(), lambda rid: [list(BLOCKS)])


def _side(match: Match, **extra: Any) -> tuple[SchedulerSide, FakeLink]:
    link = FakeLink(match)
    return SchedulerSide(LAYOUT, link, extra=extra), link  # type: ignore[arg-type]


def test_paired_worker_hit_is_a_synchronous_load() -> None:
    side, link = _side(Match(4))
    request = _request()
    assert side.lookup(request, 0) == (4 * TPB, False)
    assert link.fetches == []
    side.after_alloc(request, [BLOCKS], 4 * TPB)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", num_computed_tokens=4 * TPB)],
        num_scheduled_tokens={"r1": TPB},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        total_num_scheduled_tokens=TPB,
    )
    (load,) = side.build(out, lambda rid: [list(BLOCKS)]).loads
    assert not load.is_async and load.block_ids == tuple(BLOCKS[:4]) and len(load.keys) == 4
    assert load.lost_block_ids == ()


def test_peer_hit_loads_asynchronously_once_the_fetch_is_done() -> None:
    side, link = _side(Match(1, "w1", 6))
    request = _request()
    assert side.lookup(request, 0) == (6 * TPB, True)
    assert side.lookup(request, 0) == (6 * TPB, True)  # asked again before admission
    assert len(link.fetches) == 1 and link.lookups == 1
    side.after_alloc(request, [BLOCKS], 6 * TPB)
    assert _build(side).loads == []  # still in flight: nothing, the step does not wait
    link.fetches[0].result = 6
    (load,) = _build(side).loads
    assert load.is_async and load.first_block == 0 and load.block_ids == tuple(BLOCKS[:6])
    assert len(load.keys) == 6 and load.lost_block_ids == ()
    assert _build(side).loads == []  # once
    side.after_alloc(request, [BLOCKS], 0)  # vLLM's second call, after the load: nothing to plan
    params = side.finished(request)
    assert params is not None
    counts = params["raykv"]
    assert counts["async_loads"] == 1 and counts["hit_blocks"] == counts["loaded_blocks"] == 6
    assert counts["blocks"] == 6 and counts["fetch_us"] >= 0


def _fetched(held: int, result: int) -> tuple[SchedulerSide, FakeLink, Any]:
    """A request whose lookup found 6 blocks on w1 (``held`` on the paired worker), allocated,
    whose fetch then left the paired worker holding ``result``."""
    side, link = _side(Match(held, "w1", 6))
    request = _request()
    side.lookup(request, 0)
    side.after_alloc(request, [BLOCKS], 6 * TPB)
    link.fetches[0].result = result
    return side, link, request


def test_blocks_the_fetch_did_not_bring_are_lost() -> None:
    side, _, _ = _fetched(1, 3)  # the peer had only 3, or the pull failed after the first 3
    (load,) = _build(side).loads
    assert load.block_ids == tuple(BLOCKS[:3]) and len(load.keys) == 3
    assert load.lost_block_ids == tuple(BLOCKS[3:6])


def test_fetch_out_of_time_falls_back_to_the_blocks_held() -> None:
    side, link = _side(Match(2, "w1", 6), timeout_s=0.05)  # fetches end after 2 x 0.05 s
    request = _request()
    side.lookup(request, 0)
    side.after_alloc(request, [BLOCKS], 6 * TPB)
    assert _build(side).loads == []
    time.sleep(0.15)
    (load,) = _build(side).loads
    assert link.fetches[0].cancelled
    assert load.block_ids == tuple(BLOCKS[:2]) and load.lost_block_ids == tuple(BLOCKS[2:6])
    assert side.counters["fetch_timeouts"] == 1


def test_request_finished_while_waiting_is_released_not_loaded() -> None:
    side, link = _side(Match(0, "w1", 6))
    request = _request()
    side.lookup(request, 0)
    side.after_alloc(request, [BLOCKS], 6 * TPB)
    assert side.finished(request) is not None  # aborted in WAITING_FOR_REMOTE_KVS
    assert link.fetches[0].cancelled
    link.fetches[0].result = 6  # a late result changes nothing
    (release,) = _build(side).loads
    assert release == LoadOp("r1", 0, (), (), is_async=True)
    assert _build(side).loads == []


def test_request_finished_before_admission_needs_no_release() -> None:
    side, link = _side(Match(0, "w1", 6))
    request = _request()
    side.lookup(request, 0)  # vLLM could not allocate, then the request was aborted
    side.finished(request)
    assert link.fetches[0].cancelled
    assert _build(side).loads == []


def test_fetch_done_before_admission_turns_synchronous() -> None:
    side, link = _side(Match(1, "w1", 6))
    request = _request()
    side.lookup(request, 0)
    link.fetches[0].result = 5
    assert side.lookup(request, 0) == (5 * TPB, False)
    side.after_alloc(request, [BLOCKS], 5 * TPB)
    assert side._requests["r1"].load is not None and not side._requests["r1"].load.is_async
    counts = side._requests["r1"].counts  # the pull brought blocks 1..4: priced as a pull
    assert counts["pulled_tokens"] == 4 * TPB and counts["fetch_us"] > 0


def test_no_second_fetch_after_a_failed_one() -> None:
    """After a failed async load vLLM recomputes from 0 and asks again: the paired worker only."""
    side, link, request = _fetched(0, 0)
    (load,) = _build(side).loads
    assert load.lost_block_ids == tuple(BLOCKS[:6])
    assert side.lookup(request, 0) == (0, False)
    assert len(link.fetches) == 1


def test_worker_side_reports_async_loads_received_with_their_lost_blocks() -> None:
    worker = WorkerSide(LAYOUT, ["layer.0"])
    lost = LoadOp("r1", 0, (), (), is_async=True, lost_block_ids=(3, 4))
    release = LoadOp("r2", 0, (), (), is_async=True)
    unreachable = LoadOp("r3", 0, (b"k" * 16,), (7,), is_async=True)  # no CacheWorker connection
    worker.start_load(RaykvMetadata(loads=[lost, release, unreachable]))
    assert worker.take_failed() == {3, 4, 7}
    assert worker.take_received() == {"r1", "r2", "r3"}
    assert worker.take_received() == set()
    report = worker.take_report()
    assert report is not None and report.per_request["r1"]["load_errors"] == 2
    assert "r2" not in report.per_request


def _step(req_id: str, before: int, scheduled: int, new: bool) -> Any:
    """A scheduler output running ``scheduled`` tokens of one request from ``before``."""
    if new:
        reqs = [SimpleNamespace(req_id=req_id, num_computed_tokens=before)]
        cached = SimpleNamespace(req_ids=[], num_computed_tokens=[])
    else:
        reqs, cached = [], SimpleNamespace(req_ids=[req_id], num_computed_tokens=[before])
    return SimpleNamespace(
        scheduled_new_reqs=reqs,
        num_scheduled_tokens={req_id: scheduled},
        scheduled_cached_reqs=cached,
        total_num_scheduled_tokens=scheduled,
    )


def test_prefill_is_timed_from_its_first_step_to_the_step_after_its_last() -> None:
    """A prompt of 25 tokens with 4 blocks loaded: the engine computes the other 9 in two chunked
    steps; the prefill's time runs from planning the first to planning the step after the
    second (decode steps do not extend it)."""
    side, _ = _side(Match(4), store_generated=False)
    request = _request()
    side.lookup(request, 0)
    side.after_alloc(request, [BLOCKS], 4 * TPB)
    blocks = lambda rid: [list(BLOCKS)]  # noqa: E731
    start = time.monotonic()
    side.build(_step("r1", 4 * TPB, 5, new=True), blocks)
    time.sleep(0.02)
    side.build(_step("r1", 4 * TPB + 5, 4, new=False), blocks)  # computes the prompt's last token
    time.sleep(0.03)
    side.build(_step("r1", len(PROMPT), 1, new=False), blocks)  # a decode step: the prefill ended
    elapsed_us = (time.monotonic() - start) * 1e6
    time.sleep(0.02)
    side.build(_step("r1", len(PROMPT) + 1, 1, new=False), blocks)
    params = side.finished(request)
    assert params is not None
    counts = params["raykv"]
    assert counts["prefilled_tokens"] == len(PROMPT) - 4 * TPB == 9
    assert 50_000 <= counts["prefill_us"] <= elapsed_us
    assert "pulled_tokens" not in counts  # a synchronous load from the paired worker pulls nothing


def test_a_request_ending_in_its_prefill_step_is_timed_at_its_finish() -> None:
    side, _ = _side(Match(0))
    params = _prefilled_whole(side, "r1")  # max_tokens=1: finished before another step was planned
    assert params is not None
    assert params["raykv"]["prefilled_tokens"] == len(PROMPT)
    assert params["raykv"]["prefill_us"] >= 10_000


def _pulled_and_finished() -> tuple[SchedulerSide, FakeLink, dict[str, Any]]:
    """The request of ``_fetched(1, 6)`` (5 blocks pulled), loaded, its last prompt token
    computed in one step, then finished: the side, its link and the request's results."""
    side, link, request = _fetched(1, 6)
    _build(side)
    side.build(_step("r1", 6 * TPB, 1, new=True), lambda rid: [list(BLOCKS)])
    params = side.finished(request)
    assert params is not None
    return side, link, params["raykv"]


def _prefilled_whole(side: SchedulerSide, req_id: str) -> dict[str, Any] | None:
    """Look up ``req_id``'s prompt, compute all of it in one step and finish it 10 ms later
    (before another step was planned): its ``kv_transfer_params``."""
    request = _request(req_id)
    side.lookup(request, 0)
    side.build(_step(req_id, 0, len(PROMPT), new=True), lambda rid: [list(BLOCKS)])
    time.sleep(0.01)
    return side.finished(request)


def test_an_async_load_counts_the_tokens_its_fetch_pulled() -> None:
    """The paired worker held 1 of the 6 blocks at lookup and all 6 after the fetch: 5 pulled."""
    _, _, counts = _pulled_and_finished()
    assert counts["pulled_tokens"] == 5 * TPB and counts["fetch_us"] >= 0
    assert counts["prefilled_tokens"] == 1 and counts["prefill_us"] > 0


def test_finished_requests_add_up_to_timing_totals_reported_at_most_twice_a_second() -> None:
    """Every finished request's pull and prefill join the engine's totals (streamed responses
    carry no results, so routers learn from these); the link gets them at once, then no more
    often than every ``TIMING_EVERY_S``: what is due goes once that much time passed."""
    side, link, counts = _pulled_and_finished()
    expected = [5 * TPB, counts["fetch_us"], 1, counts["prefill_us"]]
    assert side.timing == expected and link.timings == [expected]
    link.match = Match(0)
    done = _prefilled_whole(side, "r2")
    assert done is not None
    prefill_us = counts["prefill_us"] + done["raykv"]["prefill_us"]
    expected = [5 * TPB, counts["fetch_us"], 1 + len(PROMPT), prefill_us]
    assert side.timing == expected
    assert len(link.timings) == 1  # due, not yet reported
    for _ in range(300):  # an idle engine plans no step: a timer reports it
        if len(link.timings) == 2:
            break
        time.sleep(0.01)
    assert link.timings[-1] == expected
    side.close()
    assert len(link.timings) == 2  # nothing was due any more


def test_closing_reports_what_is_due_at_once() -> None:
    side, link = _side(Match(0))
    for rid in ("r1", "r2"):
        _prefilled_whole(side, rid)
    assert len(link.timings) == 1
    side.close()
    assert len(link.timings) == 2 and link.timings[-1][2] == 2 * len(PROMPT)
    time.sleep(TIMING_EVERY_S + 0.1)
    assert len(link.timings) == 2  # the timer was cancelled


def test_a_request_with_no_figures_reports_nothing() -> None:
    side, link = _side(Match(0))
    request = _request()
    side.lookup(request, 0)
    assert side.finished(request) is not None  # never scheduled: no prefill, no pull
    assert side.timing == [0, 0, 0, 0] and link.timings == []
    side.close()
    assert link.timings == []


def test_rank_scopes_are_deterministic_distinct_and_rank_zero_is_the_requests_own() -> None:
    salted = ReuseScope(lora_id=3, salt=2**63 + 5)
    for scope in (ReuseScope(), salted):
        assert rank_scope(scope, 0, 4) == scope and rank_scope(scope, 0, 1) == scope
        others = [rank_scope(scope, r, 4) for r in range(1, 4)]
        assert len({scope, *others}) == 4  # each rank its own keys
        assert others == [rank_scope(scope, r, 4) for r in range(1, 4)]  # in every process
        assert all(o.lora_id == scope.lora_id for o in others)
    assert rank_scope(salted, 1, 2) != rank_scope(ReuseScope(lora_id=3), 1, 2)  # salts stay apart
    assert rank_scope(ReuseScope(), 1, 2) != rank_scope(ReuseScope(), 1, 4)
    for rank, ranks in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(InvalidArgumentError):
            rank_scope(ReuseScope(), rank, ranks)


def _commit(lease: int, slot: int) -> InboxCommit:
    return InboxCommit(lease, (slot,), tuple(PROMPT[:TPB]), ReuseScope(), 0)


def test_reports_of_several_ranks_keep_each_ranks_commits_in_order() -> None:
    one = WorkerReport([_commit(1, 0)])
    one.count("r1", "staged_blocks", 1)
    two = WorkerReport([_commit(2, 5)])
    two.counters["staged_blocks"] += 1  # a rank above 0 counts overall only
    both = one.aggregate(two)
    assert both.commits == [_commit(1, 0), _commit(2, 5)]
    assert both.counters["staged_blocks"] == 2 and both.per_request["r1"]["staged_blocks"] == 1
    side, link = _side(Match(0))
    side.on_report(both)
    assert link.stored == both.commits  # each rank's blocks go to its own inbox's commit


def test_blocks_a_store_could_not_write_are_offered_again() -> None:
    """Backpressure: the worker side reports the first block it could not write (no free inbox
    slots); the next step's store offers it again, and the figures say so."""
    side, _ = _side(Match(0))
    request = _request()
    assert side.lookup(request, 0) == (0, False)
    (store,) = side.build(_step("r1", 0, 3 * TPB, new=True), lambda rid: [list(BLOCKS)]).stores
    assert (store.first_block, store.end_block) == (0, 3)
    report = WorkerReport(unstored={"r1": 1})
    report.count("r1", "store_backpressure_blocks", 2)
    side.on_report(report)
    (again,) = side.build(_step("r1", 3 * TPB, TPB, new=False), lambda rid: [list(BLOCKS)]).stores
    assert (again.first_block, again.end_block) == (1, 4)
    result = side.finished(request)
    assert result is not None
    assert result["raykv"]["store_backpressure_blocks"] == 2 and result["raykv"]["offered_blocks"] == 4


def test_a_tensor_parallel_engines_loads_carry_the_tokens_its_ranks_key_from() -> None:
    """Ranks above 0 key their pages from the prompt: loads of a TP engine carry it (and the
    scope); an engine of one rank sends keys only."""
    for ranks, expected in ((1, ()), (2, PROMPT[: 4 * TPB])):
        side, _ = _side(Match(4), tensor_parallel_size=ranks)
        request = _request()
        side.lookup(request, 0)
        side.after_alloc(request, [BLOCKS], 4 * TPB)
        (load,) = side.build(_step("r1", 4 * TPB, TPB, new=True), lambda rid: [list(BLOCKS)]).loads
        assert load.tokens == tuple(expected) and len(load.keys) == 4
        assert load.scope == (ReuseScope() if ranks > 1 else None)


# ---- engines with block ids per KV cache group (vLLM's hybrid manager, sliding windows) --------
SWA = [0, 0, 21, 22, 23, 24, 25]  # group 1: null blocks before the window


def test_a_grouped_engine_loads_a_held_hit_asynchronously_into_every_group() -> None:
    """vLLM takes no block-level load errors when blocks are per group, so even a hit the paired
    worker holds waits one step (WAITING_FOR_REMOTE_KVS) and loads asynchronously, with each
    group's blocks (the window's nulls included, for the worker side to skip)."""
    side, link = _side(Match(4), grouped=True)
    request = _request()
    assert side.lookup(request, 0) == (4 * TPB, True)
    assert link.fetches == []  # nothing to fetch: the paired worker holds them
    assert side.lookup(request, 0) == (4 * TPB, True)  # asked again before admission: the same
    side.after_alloc(request, [BLOCKS, SWA], 4 * TPB)
    (load,) = _build(side).loads
    assert load.is_async and load.block_ids == tuple(BLOCKS[:4]) and load.group_ids == (tuple(SWA[:4]),)
    assert load.lost_block_ids == () and len(load.keys) == 4
    assert load.blocks() == list(zip(BLOCKS[:4], SWA[:4]))
    assert _build(side).loads == []  # once


def test_a_grouped_engine_whose_load_failed_gets_no_more_hits() -> None:
    """A failed load comes back as the request's ``load_errors``; vLLM then recomputes the whole
    prompt and asks again: no hit, so a worker whose pages keep failing cannot make it loop."""
    side, _ = _side(Match(4), grouped=True)
    request = _request()
    side.lookup(request, 0)
    side.after_alloc(request, [BLOCKS, SWA], 4 * TPB)
    _build(side)
    report = WorkerReport()
    report.count("r1", "load_errors", 4)
    side.on_report(report)
    assert side.lookup(request, 0) == (0, False)


def test_a_grouped_engine_stores_every_groups_blocks() -> None:
    side, _ = _side(Match(0), grouped=True)
    request = _request()
    assert side.lookup(request, 0) == (0, False)
    meta = side.build(_step("r1", 0, 3 * TPB, new=True), lambda rid: [list(BLOCKS), list(SWA)])
    (store,) = meta.stores
    assert store.block_ids == tuple(BLOCKS[:3]) and store.group_ids == (tuple(SWA[:3]),)
    assert store.first_block == 0 and store.end_block == 3


def test_a_grouped_worker_side_fails_requests_not_blocks() -> None:
    """On an engine with per-group block ids a failed or lost load fails its request (vLLM's
    failed receiving), never a block id; a save that needs a null block stores nothing."""
    worker = WorkerSide(LAYOUT, ["layer.0"], groups=(0,))
    lost = LoadOp("r1", 0, (), (), is_async=True, lost_block_ids=(3, 4))
    fine = LoadOp("r2", 0, (), (), is_async=True)
    worker.start_load(RaykvMetadata(loads=[lost, fine]))
    assert worker.take_failed() == set()
    assert worker.take_failed_requests() == {"r1"}
    assert worker.take_received() == {"r1", "r2"}
    report = worker.take_report()
    assert report is not None and report.per_request["r1"]["load_errors"] == 2


def test_group_ids_must_align_with_the_block_ids() -> None:
    with pytest.raises(InvalidArgumentError):
        LoadOp("r1", 0, (b"k" * 16,), (1, 2), group_ids=((3,),)).blocks()
    assert LoadOp("r1", 0, (), (1, 2)).blocks() == [1, 2]


class LaterLink(FakeLink):
    """A FakeLink whose lookups answer with a Future the test resolves (as the Ray link's
    lookup thread does)."""

    def __init__(self) -> None:
        super().__init__(Match(0))
        self.asked: list[Any] = []

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        from concurrent.futures import Future

        self.lookups += 1
        self.asked.append(Future())
        return self.asked[-1]


def test_a_lookup_on_its_way_defers_the_request_and_never_blocks_the_step() -> None:
    """Until the link's answer arrives, vLLM gets (None, False) (the request waits a step; the
    link is asked once); the answer then counts as usual; a step with nothing scheduled waits a
    few ms for it rather than spin."""
    link = LaterLink()
    side = SchedulerSide(LAYOUT, link)  # type: ignore[arg-type]
    request = _request()
    assert side.lookup(request, 0) == (None, False)
    assert side.lookup(request, 0) == (None, False) and link.lookups == 1
    start = time.monotonic()
    _build(side)  # idle: waits for the answer at most 5 ms
    assert time.monotonic() - start < 1.0
    link.asked[0].set_result(Match(4))
    assert side.lookup(request, 0) == (4 * TPB, False)
    assert side.counters["lookups_deferred"] == 2 and side.counters["lookups"] == 1
    side.after_alloc(request, [BLOCKS], 4 * TPB)
    meta = side.build(_scheduled_new("r1", 4 * TPB), lambda rid: [list(BLOCKS)])
    assert [op.block_ids for op in meta.loads] == [tuple(BLOCKS[:4])]


def _scheduled_new(req_id: str, computed: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=computed)],
        num_scheduled_tokens={req_id: 1},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        total_num_scheduled_tokens=1,
    )


def test_a_lookup_past_its_budget_or_failed_is_a_miss_and_an_aborted_one_is_cancelled() -> None:
    """Past its budget a lookup is a miss and becomes the link's liveness probe: until it is
    answered new requests are not asked about (a stalled worker costs one budget, not one per
    request); then lookups resume."""
    link = LaterLink()
    side = SchedulerSide(LAYOUT, link, extra={"lookup_budget_ms": 20})  # type: ignore[arg-type]
    late, failed, aborted = _request("late"), _request("failed"), _request("aborted")
    for request in (late, failed, aborted):
        assert side.lookup(request, 0) == (None, False)
    time.sleep(0.05)
    assert side.lookup(late, 0) == (0, False) and not link.asked[0].cancelled()  # the probe
    link.asked[1].set_exception(RuntimeError("worker gone"))
    assert side.lookup(failed, 0) == (0, False)
    side.finished(aborted)
    assert link.asked[2].cancelled()
    assert side.counters["lookup_timeouts"] == 1 and link.lookups == 3
    assert side.lookup(_request("fresh"), 0) == (0, False)  # not asked: the probe is pending
    assert side.counters["lookups_skipped"] == 1 and link.lookups == 3
    link.asked[0].set_result(Match(0))  # the link answers again
    assert side.lookup(_request("next"), 0) == (None, False) and link.lookups == 4
    side.close()
    assert link.asked[3].cancelled()


def test_a_deferred_request_whose_prompt_vllm_now_holds_drops_its_lookup() -> None:
    link = LaterLink()
    side = SchedulerSide(LAYOUT, link)  # type: ignore[arg-type]
    request = _request()
    assert side.lookup(request, 0) == (None, False)
    assert side.lookup(request, 6 * TPB) == (0, False)  # another request computed it meanwhile
    assert link.asked[0].cancelled()

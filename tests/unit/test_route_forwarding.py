"""The Serve router's match travels with the request to its engine, without Ray.

The router (CacheRanker over a real in-process index) keeps its index answer per request, and
``forward_route`` writes it into a copy of the forwarded request's ``kv_transfer_params``; the
engine's link (``RayDeploymentLink._answer``, the lookup thread's answer, on a fake cluster)
takes the best other worker from it and does not ask the index, and asks the index when the
match is missing, malformed, names an unknown worker or covers other keys. Checked on outcomes
and counters: which worker a Match names, what the index was asked, what the link counted.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from deps import require

require("ray.serve")

from pydantic import BaseModel  # noqa: E402

from actors.serve.fields import KEYS_FIELD, PULLS_FIELD  # noqa: E402
from actors.serve.match import engine_route, forward_route  # noqa: E402
from actors.serve.ranking import CacheRanker, IndexView  # noqa: E402
from actors.serve.routed import RoutedRequest  # noqa: E402
from actors.serve.router import CacheAwareRouter  # noqa: E402
from actors.vllm.link import RayDeploymentLink  # noqa: E402
from actors.vllm.lookups import Query  # noqa: E402
from raykv.core.keys import ReuseScope, block_keys  # noqa: E402
from raykv.core.types import WorkerId  # noqa: E402
from raykv.index.prefix_index import OP_STORE, EventBatch, PrefixIndex, RouteMatch  # noqa: E402
from raykv.integrations.vllm.link import Match  # noqa: E402
from raykv.integrations.vllm.route import Route  # noqa: E402

TPB = 4
MODEL = bytes(range(32))  # the engines' model fingerprint, as their replicas announce it
SCOPE = ReuseScope(model=MODEL)
W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
PROMPT = list(range(1, 6 * TPB + 3))  # 6 full blocks and 2 tokens: the engine looks up 6


def engine_keys(prompt: Sequence[int], scope: ReuseScope = SCOPE) -> list[bytes]:
    """The keys the connector's scheduler side looks up: full blocks before the last token."""
    usable = (len(prompt) - 1) // TPB
    return [bytes(k) for k in block_keys(list(prompt[: usable * TPB]), TPB, scope)]


# ---- the router's side -----------------------------------------------------------------------------
class Index:
    """A real PrefixIndex behind the router's async route call; counts the calls."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        for lane, w in enumerate((W0, W1, W2)):
            self.index.register_worker(w, lane, 1)
        self.calls = 0

    def hold(self, worker: WorkerId, tokens: list[int]) -> None:
        ops = tuple((OP_STORE, k, 0) for k in block_keys(tokens, TPB, SCOPE))
        self.index.apply_batch(EventBatch(worker, 1, 1, len(ops), ops))

    async def route_async(self, keys: list[bytes], budget_ms: float | None = None) -> dict[WorkerId, Any]:
        self.calls += 1
        return self.index.route(keys)

    def predict(self, worker: WorkerId, keys: list[bytes]) -> None:
        pass


@dataclass
class Replica:
    replica_id: str
    worker: str
    pulls: bool = True
    keys: bool = True
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"raykv_worker": self.worker, PULLS_FIELD: self.pulls}
        if self.keys:
            meta[KEYS_FIELD] = [TPB, MODEL.hex()]
        return meta


class Completion(BaseModel):
    """A stand-in for vLLM's OpenAI CompletionRequest (a pydantic model)."""

    prompt: list[int]
    kv_transfer_params: dict[str, Any] | None = None


def routed(index: Index, replicas: list[Replica], rid: str = "r1") -> tuple[CacheRanker, Any]:
    """Rank ``PROMPT`` as CacheAwareRouter does; the ranker and the route it kept for ``rid``."""

    async def connect() -> IndexView:
        return IndexView(index, TPB)

    ranker = CacheRanker(connect, time_budget_s=1.0, seed=1)
    asyncio.run(ranker.rank(replicas, RoutedRequest(tuple(PROMPT), ReuseScope()), rid))
    return ranker, ranker.routes.pop(rid, None)


def pending(*args: Any, **kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(args=list(args), kwargs=dict(kwargs))


def test_the_router_keeps_its_index_answer_for_the_blocks_the_engine_looks_up() -> None:
    index = Index()
    index.hold(W1, PROMPT[: 5 * TPB])
    index.hold(W2, PROMPT[: 2 * TPB])
    _, route = routed(index, [Replica("a", "w0"), Replica("b", "w1")])
    assert index.calls == 1
    assert route == {"keys": 6, "key": engine_keys(PROMPT)[-1][:8].hex(), "workers": {"w1": 5, "w2": 2}}
    assert Route.parse(route).covers(engine_keys(PROMPT))  # the router keyed as the engine does
    assert not Route.parse(route).covers(engine_keys(PROMPT, ReuseScope.from_cache_salt("other")))


def test_no_route_is_kept_unless_every_engine_pulls_and_announced_its_keys() -> None:
    index = Index()
    index.hold(W1, PROMPT[: 5 * TPB])
    assert routed(index, [Replica("a", "w0"), Replica("b", "w1", pulls=False)])[1] is None
    assert routed(index, [Replica("a", "w0", keys=False), Replica("b", "w1", keys=False)])[1] is None


def test_the_route_names_the_best_few_workers_capped_at_the_blocks_looked_up() -> None:
    keys = engine_keys(PROMPT)
    matches = {WorkerId(f"w{i}"): RouteMatch(WorkerId(f"w{i}"), i) for i in range(1, 9)}
    route = engine_route([*keys, b"\x01" * 32], matches, len(PROMPT), TPB)
    assert route is not None and route["workers"] == {"w8": 6, "w7": 6, "w6": 6, "w5": 5}
    assert route["keys"] == 6
    assert engine_route(keys, {}, TPB, TPB) is None  # one block and no more: nothing is looked up


def test_forwarding_copies_the_request_and_keeps_its_other_params() -> None:
    route = {"keys": 1, "key": "00" * 8, "workers": {}}
    plain = Completion(prompt=PROMPT)
    call = pending(plain, None)
    counters: collections.Counter[str] = collections.Counter()
    assert forward_route(call, route, counters) and counters["routes_forwarded"] == 1
    assert call.args[0].kv_transfer_params == {"raykv": {"route": route}} and call.args[1] is None
    assert plain.kv_transfer_params is None  # the caller's object is not changed
    producer = {"do_remote_decode": True, "raykv": {"worker": "w1", "blocks": 3}}
    call = pending(Completion(prompt=PROMPT, kv_transfer_params=producer))
    assert forward_route(call, route)
    assert call.args[0].kv_transfer_params == {
        "do_remote_decode": True,
        "raykv": {"worker": "w1", "blocks": 3, "route": route},
    }
    assert producer == {"do_remote_decode": True, "raykv": {"worker": "w1", "blocks": 3}}
    call = pending({"tokens": PROMPT, "kv_transfer_params": None})
    assert forward_route(call, route) and call.args[0]["kv_transfer_params"]["raykv"]["route"] == route


@pytest.mark.parametrize("forwarding", [True, False])
def test_the_serve_router_forwards_the_match_it_ranked_by_unless_told_not_to(forwarding: bool) -> None:
    index = Index()
    index.hold(W1, PROMPT[: 5 * TPB])
    ranker, _ = routed(index, [Replica("a", "w0")], rid="warm-up")
    router = object.__new__(CacheAwareRouter)  # its Serve state is not used by choose_replicas
    router.ranker, router.forwarding, router.prompts = ranker, forwarding, None
    request = Completion(prompt=PROMPT)
    call = pending(request, None)
    call.metadata = SimpleNamespace(internal_request_id="r2")
    ranks = asyncio.run(router.choose_replicas([Replica("a", "w0"), Replica("b", "w1")], call))  # type: ignore[list-item]
    assert [r.worker for r in ranks[0]] == ["w1"] and index.calls == 2  # one more decision, one more call
    sent = call.args[0].kv_transfer_params
    if forwarding:
        assert Route.parse(sent["raykv"]["route"]).workers == {"w1": 5}
        assert ranker.counters["routes_forwarded"] == 1
    else:
        assert sent is None and ranker.counters["routes_forwarded"] == 0
    assert request.kv_transfer_params is None and not ranker.routes  # kept for no request


def test_requests_that_cannot_carry_it_are_left_alone() -> None:
    route = {"keys": 1, "key": "00" * 8, "workers": {}}
    for call in (
        pending({"tokens": PROMPT}),  # a deployment's own request type, without the field
        pending(Completion(prompt=PROMPT, kv_transfer_params={"raykv": "not ours"})),
        pending(SimpleNamespace(prompt=PROMPT)),
    ):
        before = list(call.args)
        assert not forward_route(call, route)
        assert call.args == before
    assert not forward_route(pending(Completion(prompt=PROMPT)), None)


# ---- the engine's side -----------------------------------------------------------------------------
class Cluster:
    """What ``_answer`` reads of a deployment: its workers and the index (which records what it
    was asked and answers ``answer`` to every query)."""

    def __init__(self, answer: Mapping[WorkerId, RouteMatch]) -> None:
        self.workers = {w: object() for w in (W0, W1, W2)}
        self.answer = dict(answer)
        self.asked: list[list[list[bytes]]] = []

    def route_many(self, queries: Sequence[Sequence[bytes]]) -> list[dict[WorkerId, RouteMatch]]:
        self.asked.append([list(q) for q in queries])
        return [dict(self.answer) for _ in queries]


class Link(RayDeploymentLink):
    """The Ray link without Ray: only what ``_answer``, ``_count`` and ``poll`` read."""

    def __init__(self, cluster: Cluster, use_index: bool = True) -> None:
        self.cluster = cluster  # type: ignore[assignment]
        self.worker = W0
        self.use_index = use_index
        self._lock = threading.Lock()
        self._done = collections.Counter()


INDEX_SAYS = {W2: RouteMatch(W2, 4)}  # the index's answer, when asked: w2 holds 4 blocks


def answer(hints: Sequence[Mapping[str, Any]], held: Sequence[int], use_index: bool = True) -> tuple:
    """The link's Matches for PROMPT with each hint (the paired worker holding ``held``), what
    the index was asked and the link's counters."""
    cluster = Cluster(INDEX_SAYS)
    link = Link(cluster, use_index)
    keys = engine_keys(PROMPT)
    matches = link._answer([Query(keys, dict(h)) for h in hints], list(held))
    return matches, cluster.asked, link.poll()


def route_of(workers: Mapping[str, Any], prompt: Sequence[int] = PROMPT, **changes: Any) -> dict[str, Any]:
    return {"route": {**Route.of(engine_keys(prompt), {}).field(), "workers": dict(workers), **changes}}


def test_a_routed_lookup_takes_the_routers_best_other_worker_and_asks_no_index() -> None:
    matches, asked, counts = answer([route_of({"w0": 6, "w1": 5, "w2": 3})], [2])
    assert matches == [Match(2, "w1", 5)]  # w0 is the paired worker: its own count is held's
    assert asked == [] and counts == {"lookups_routed": 1}
    matches, asked, counts = answer([route_of({"w1": 2}), route_of({})], [3, 1])
    assert matches == [Match(3), Match(1)]  # nobody holds more than the paired worker
    assert asked == [] and counts == {"lookups_routed": 2}


def test_without_a_route_the_index_is_asked_once_for_the_batch() -> None:
    keys = engine_keys(PROMPT)
    matches, asked, counts = answer([{}, route_of({"w1": 5}), {}], [1, 1, 6])
    assert matches == [Match(1, "w2", 4), Match(1, "w1", 5), Match(6)]  # the last: held whole
    assert asked == [[keys]] and counts == {"lookups_indexed": 1, "lookups_routed": 1}


@pytest.mark.parametrize(
    ("hint", "counted"),
    [
        ({"route": "w1"}, "route_malformed"),
        ({"route": {"keys": 6, "key": "00" * 8}}, "route_malformed"),
        (route_of({"w1": -1}), "route_malformed"),
        (route_of({"w1": 2.5}), "route_malformed"),
        (route_of({"w1": True}), "route_malformed"),
        (route_of({"w1": 7}), "route_malformed"),  # more blocks than it covers
        (route_of({"w1": 5}, keys="6"), "route_malformed"),
        (route_of({"w1": 5}, key="zz" * 8), "route_malformed"),
        (route_of({"nobody": 5}), "route_malformed"),  # not a worker of this deployment
        (route_of({"w1": 5}, prompt=[7, *PROMPT[1:]]), "route_mismatched"),  # another prompt
        (route_of({"w1": 5}, keys=5), "route_mismatched"),  # fewer blocks than looked up
    ],
)
def test_a_bad_route_is_ignored_counted_and_the_index_asked(hint: dict[str, Any], counted: str) -> None:
    matches, asked, counts = answer([hint], [1])
    assert matches == [Match(1, "w2", 4)]  # the index's answer, as if no route came
    assert asked == [[engine_keys(PROMPT)]]
    assert counts == {counted: 1, "lookups_indexed": 1}


def test_a_producers_hint_comes_first_and_use_index_off_ignores_routes() -> None:
    hint = {"worker": "w2", "blocks": 6, **route_of({"w1": 5})}
    matches, asked, counts = answer([hint], [1])
    assert matches == [Match(1, "w2", 6, wait=True)] and asked == [] and counts == {}
    matches, asked, counts = answer([route_of({"w1": 5})], [1], use_index=False)
    assert matches == [Match(1)] and asked == [] and counts == {}


def test_the_routers_field_reaches_the_engines_link_intact() -> None:
    index = Index()
    index.hold(W1, PROMPT[: 5 * TPB])
    _, route = routed(index, [Replica("a", "w0"), Replica("b", "w1")])
    call = pending(Completion(prompt=PROMPT), None)
    assert forward_route(call, route)
    hint = call.args[0].model_dump()["kv_transfer_params"]["raykv"]  # as vLLM hands it over
    matches, asked, counts = answer([hint], [0])
    assert matches == [Match(0, "w1", 5)] and asked == [] and counts == {"lookups_routed": 1}
    assert index.calls == 1  # one routing decision, one index call

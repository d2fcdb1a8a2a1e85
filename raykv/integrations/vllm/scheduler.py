"""The connector's scheduler side (runs in vLLM's EngineCore process): lookups and step plans.

Per request it keeps the prompt's block keys (``raykv.block_keys`` over the full prompt blocks,
in the request's scope: ``cache_salt`` hashed by ``ReuseScope.from_cache_salt``, the LoRA's
``lora_int_id``; blocks overlapping an image or another multimodal input are keyed by its
content, :func:`~raykv.integrations.vllm.multimodal.mm_items`), how many blocks the deployment
holds (``hit``) and how many are stored or offered (``stored``).

Lookups never block the scheduler: a link that asks another process (the Ray link asks the
paired CacheWorker and, unless the request carries the router's match
(``kv_transfer_params["raykv"]["route"]``, :mod:`raykv.integrations.vllm.route`), the index, from
a background thread, batched) answers with a Future, and
until it is answered ``get_num_new_matched_tokens`` returns ``(None, False)``, so vLLM leaves
the request waiting for that step and schedules the others. Past ``lookup_budget_ms`` the
request is admitted without a hit (``lookup_timeouts``). An idle engine waits up to 5 ms for an
answer instead of spinning. Each step it plans:

- loads: after vLLM allocated blocks for an external hit, copy those blocks' pages in
  (``LoadOp``), once. When the paired CacheWorker holds the blocks, the load is synchronous
  (``get_num_new_matched_tokens`` returns ``(tokens, False)``; the load runs before the step's
  forward pass). When another worker holds more (by the index, or a prefill/decode producer's
  hint naming blocks still on their way), the lookup starts a fetch in the background
  (:meth:`DeploymentLink.start_fetch`: the paired worker pulls them from that worker) and returns
  ``(tokens, True)``; vLLM parks the request in WAITING_FOR_REMOTE_KVS with blocks allocated.
  Each step's plan polls the fetch without blocking; once it is done (or after ``2 * timeout_s``:
  the wait for a hint's blocks, then the pull) the plan carries an asynchronous ``LoadOp`` of the
  blocks the paired worker now holds, the rest as lost blocks (vLLM recomputes them), and the
  worker side reports the request finished receiving in that step. A request that finishes or is
  aborted while its fetch is pending gets a release op instead (vLLM holds its blocks until the
  worker side reports it), so nothing leaks and nothing is loaded into freed blocks;
- stores: every block that becomes fully computed this step (prompt blocks, and with
  ``store_generated``, the default, blocks of generated tokens too) and that the deployment does
  not hold yet (``StoreOp``). Blocks of generated tokens hold KV from one-token decode steps,
  whose last bits differ from a prefill of the same tokens on CPU: a later request reusing them
  (a conversation's next turn) is exact up to those bits, as with vLLM's own prefix cache; set
  ``store_generated`` False to store prompt blocks only.

An engine that addresses blocks per KV cache group (vLLM's hybrid manager with sliding-window
layers beside full ones, or a sliding-window model; ``grouped``) gets block ids per group, and
vLLM takes load failures there per request only (``failed_recving``, after which it recomputes
the whole prompt), never per block. Every load of such an engine is therefore asynchronous: a hit
the paired worker holds waits one step in WAITING_FOR_REMOTE_KVS like a fetched one, and a
request whose load failed gets no more hits. Its stores carry every group's blocks
(``StoreOp.group_ids``).

A lookup never counts the prompt's last token (vLLM must compute at least one token for its
logits), so at most ``(len(prompt) - 1) // block_size`` blocks are loaded.

Per-request results (``hit_blocks``, ``loaded_blocks``, ``load_errors``, ``stored_blocks``; for
asynchronous loads ``async_loads``, ``fetch_us``, the fetch's wall time from lookup to plan, and
``pulled_tokens``, the tokens of the blocks it brought to the paired worker; ``prefilled_tokens``
and ``prefill_us``, the prompt tokens the engine computed and the wall time from the step that
scheduled the first of them to the step after the last) come back in the request output's
``kv_transfer_params["raykv"]``. The side also adds up the pulls and prefills of every finished
request (:attr:`SchedulerSide.timing`: ``[pulled tokens, pull us, prefilled tokens, prefill
us]``) and hands the totals to the paired CacheWorker (:meth:`DeploymentLink.report_timing`) at
most every ``timing.TIMING_EVERY_S`` seconds (what is due then goes from a timer thread, as an idle
engine plans no steps), streamed responses included (they carry no
``kv_transfer_params``): the engine's Serve replica reads them there and reports them to routers,
which price a pulled token against a recomputed one from them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raykv import ConfigError, InvalidArgumentError, KVLayout, MultimodalItem, ReuseScope, block_keys
from raykv.core.keys import clip_mm_items
from raykv.integrations.vllm.identity import lora_identity
from raykv.integrations.vllm.link import DeploymentLink, LazyKeys, Match
from raykv.integrations.vllm.plan import EngineLink, LoadOp, RaykvMetadata, StoreOp, WorkerReport
from raykv.integrations.vllm.timing import TimingTotals
from raykv.routing.session_keys import SessionKeys

log = logging.getLogger(__name__)

PARAMS_KEY = "raykv"
KEY_MEMO_BYTES = 16 << 20  # recently keyed blocks, reused by later prompts that share them
INBOX_BYTES = 256 << 20
"""Default ``inbox_bytes``: the store inbox the paired CacheWorker leases each rank."""
LOAD_BUDGET_MS = 2000.0
"""Default ``load_budget_ms``: the most a load's pull from the paired worker may take (its blocks
are recomputed past it, and pulls pause a while: ``worker.LATE_COOLDOWN_S``)."""
LOOKUP_BUDGET_MS = 250.0
"""Default ``lookup_budget_ms``: how long a new request may wait for its lookup's answer before
the engine computes its prompt instead."""


@dataclass
class _Request:
    """One request's state. ``hit``: blocks promised to vLLM; ``stored``: blocks the deployment
    holds or was offered. An async load: ``fetch`` (the link's, None once planned or dropped),
    ``fetch_held`` (blocks the paired worker held when it started, the fallback), ``fetch_since``
    (its start, time.monotonic()), ``target`` (first block, its engine blocks and, on a grouped
    engine, those of groups 1.., once vLLM allocated them). ``fetched``: a fetch ran for the
    request; later lookups (after a failed load, a preemption) use the paired worker only, so a
    peer that keeps failing cannot make it loop."""

    prompt: Sequence[int]  # vLLM's prompt_token_ids (not copied: vLLM never changes them)
    scope: ReuseScope
    keys: LazyKeys
    mm: tuple[MultimodalItem, ...] = ()  # the prompt's multimodal items (keys name their content)
    hit: int = 0
    stored: int = 0
    load: LoadOp | None = None
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    request: Any = None  # vLLM's Request (its all_token_ids, for generated blocks)
    fetch: Any = None
    fetch_held: int = 0
    fetch_since: float = 0.0
    target: tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...]] | None = None
    fetched: bool = False
    asking: Future[Match] | None = None  # the link's lookup on its way (None: none pending)
    asked_at: float = 0.0  # when it was asked (time.monotonic())
    prefill_from: int = -1  # prompt tokens computed before the engine's first step on it (-1: none yet)
    prefill_since: float = 0.0  # when that step was planned


def request_scope(request: Any, model: bytes | None = None) -> ReuseScope:
    """The ReuseScope of a vLLM request of the engine whose model fingerprint is ``model``
    (:mod:`~raykv.integrations.vllm.identity`): its ``cache_salt`` (str, hashed) and its LoRA
    adapter by identity (:func:`~raykv.integrations.vllm.identity.lora_identity`, never the
    engine-local ``lora_int_id``). InvalidArgumentError for a ``cache_salt`` that is not a str."""
    lora = getattr(request, "lora_request", None)
    lora_id = None if lora is None else lora_identity(lora)
    salt = getattr(request, "cache_salt", None)
    if salt is None:
        return ReuseScope(lora_id, None, model)
    if not isinstance(salt, str):
        raise InvalidArgumentError("cache_salt", f"must be a str, got {type(salt).__name__}")
    return ReuseScope.from_cache_salt(salt, lora_id, model)


class _Held:
    """The fetch of a grouped engine's hit the paired worker already holds: done at once."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks


class SchedulerSide:
    """Lookups, load and store plans, and per-request results. ``link`` None: does nothing.

    ``loads``/``stores``: whether this engine reads from / writes to the deployment (vLLM's
    kv_role: consumer reads, producer writes, both does both). ``extra["grouped"]`` (set by the
    connector): the engine's blocks are addressed per KV cache group (module docstring).
    """

    def __init__(
        self,
        layout: KVLayout,
        link: DeploymentLink | None,
        loads: bool = True,
        stores: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        extra = extra or {}
        self.tpb = layout.tokens_per_block
        self.link = link
        self.loads, self.stores = loads, stores
        self.store_generated = bool(extra.get("store_generated", True))
        self.ranks = int(extra.get("tensor_parallel_size", 1))  # set by the connector
        self.grouped = bool(extra.get("grouped", False))  # set by the connector
        self.model: bytes | None = extra.get("model_fingerprint")  # set by the connector
        self._engine_link: EngineLink | None = None
        self.fetch_limit_s = 2 * float(extra.get("timeout_s", 10.0))
        self.lookup_budget_s = float(extra.get("lookup_budget_ms", LOOKUP_BUDGET_MS)) / 1e3
        if link is not None:
            if "staging_bytes" in extra:
                raise ConfigError("staging_bytes", "was renamed inbox_bytes (the inbox size per rank)")
            inbox = int(extra.get("inbox_bytes", INBOX_BYTES))
            engine_link = link.engine_link(inbox, str(extra.get("listen_host", "127.0.0.1")))
            budget = float(extra.get("load_budget_ms", LOAD_BUDGET_MS))
            if engine_link is not None:
                engine_link = dataclasses.replace(engine_link, load_budget_ms=budget)
            self._engine_link = engine_link
        self._requests: dict[str, _Request] = {}
        self._fetching: dict[str, _Request] = {}  # allocated, waiting for their fetch
        self._asking: dict[str, _Request] = {}  # waiting for their lookup's answer
        self._late: Future[Match] | None = None  # a lookup past its budget, not answered yet
        self._keys = SessionKeys(self.tpb, memo_bytes=KEY_MEMO_BYTES)
        self._keys_lock = threading.Lock()
        self._releases: list[LoadOp] = []  # of requests that finished while waiting
        self._prefilled: dict[str, _Request] = {}  # prompt computed by the last step: timed next step
        self.counters: collections.Counter[str] = collections.Counter()
        self._timing = TimingTotals(None if link is None else lambda totals: link.report_timing(totals))

    @property
    def timing(self) -> list[int]:
        """Pulled tokens, pull us, prefilled tokens, prefill us of the finished requests."""
        return self._timing.totals

    # ---- lookups ---------------------------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens beyond ``num_computed_tokens`` the
        deployment can supply (a multiple of the block size; 0 when it holds no more, or when
        disabled) and whether they come asynchronously (a fetch from another worker runs; see
        the module docstring). Asked again before the request is admitted, a pending fetch is
        not started twice: its answer is repeated, or, once it is done, turned synchronous.
        ``(None, False)`` while the link's answer is on its way (vLLM skips the request this step
        and asks again next step: the step never waits on the deployment), at most
        ``lookup_budget_ms`` (default :data:`LOOKUP_BUDGET_MS`), after which the prompt is
        computed."""
        state = self._state(request)
        if self.link is None or not self.loads or not state.keys:
            return 0, False
        if self.grouped and state.counts["load_errors"]:  # vLLM recomputes it whole: no more hits
            return 0, False
        usable = (len(state.prompt) - 1) // self.tpb
        if state.fetch is not None:
            return self._lookup_again(state, num_computed_tokens)
        if usable <= num_computed_tokens // self.tpb:  # vLLM's own cache has it all
            self._drop_lookup(request.request_id, state)
            return 0, False
        match = self._match(request, state, usable)
        if match is None:
            return None, False  # vLLM asks again next step; the request waits, the step does not
        held = max(0, min(usable, match.held))
        fetch = min(usable, match.blocks) if match.fetchable else 0
        if fetch > held and fetch * self.tpb > num_computed_tokens and not state.fetched:
            tokens, items = self._usable(state, usable)
            state.fetch = self.link.start_fetch(match, tokens, state.scope, state.keys[:usable], items)
            state.fetch_held, state.fetch_since, state.fetched = held, time.monotonic(), True
            self.counters["fetches"] += 1
            return self._hit(state, fetch, held, num_computed_tokens), True
        new = self._hit(state, held, held, num_computed_tokens)
        if self.grouped and new > 0:  # loaded asynchronously, as if fetched (module docstring)
            state.fetch, state.fetch_held, state.fetch_since = _Held(held), held, time.monotonic()
            return new, True
        return new, False

    def _usable(self, state: _Request, usable: int) -> tuple[tuple[int, ...], tuple[MultimodalItem, ...]]:
        """The tokens of the request's first ``usable`` blocks and their multimodal items."""
        tokens = tuple(state.prompt[: usable * self.tpb])
        return tokens, clip_mm_items(state.mm, len(tokens))

    def _match(self, request: Any, state: _Request, usable: int) -> Match | None:
        """The link's answer for the request's first ``usable`` blocks: asked once, then polled
        (None while it is on its way, up to ``lookup_budget_s``; past it ``Match(0)``, counted in
        ``lookup_timeouts``: the engine computes the prompt rather than wait). A lookup past its
        budget is kept as the link's liveness probe: until it is answered, new requests are not
        asked about at all (``Match(0)`` at once, counted in ``lookups_skipped``), so a stalled
        worker costs one budget, not one per request. Never blocks."""
        assert self.link is not None
        if state.asking is None:
            if self._late is not None:
                if not self._late.done():
                    self.counters["lookups_skipped"] += 1
                    return Match(0)
                self._late = None  # the link answers again
            params = (getattr(request, "kv_transfer_params", None) or {}).get(PARAMS_KEY) or {}
            tokens, items = self._usable(state, usable)
            answer = self.link.lookup(tokens, state.scope, state.keys.head(usable), params, items)
            self.counters["lookups"] += 1
            if isinstance(answer, Match):
                return answer
            state.asking, state.asked_at = answer, time.monotonic()
            self._asking[request.request_id] = state
        future = state.asking
        if not future.done():
            if time.monotonic() - state.asked_at <= self.lookup_budget_s:
                self.counters["lookups_deferred"] += 1
                return None
            self.counters["lookup_timeouts"] += 1
            state.asking, self._late = None, future  # the probe: not cancelled
            self._asking.pop(request.request_id, None)
            return Match(0)
        self._drop_lookup(request.request_id, state)
        if future.cancelled() or future.exception(timeout=0) is not None:
            return Match(0)
        return future.result(timeout=0)

    def _drop_lookup(self, req_id: str, state: _Request) -> None:
        """Forget the request's pending lookup (cancelled when still on its way)."""
        if state.asking is not None:
            state.asking.cancel()
            state.asking = None
        self._asking.pop(req_id, None)

    def _hit(self, state: _Request, hit: int, held: int, num_computed_tokens: int) -> int:
        """Record a lookup's ``hit`` (``held`` of them on the paired worker); new tokens. The
        request's ``hit_blocks`` is its best lookup's (vLLM asks again after a preemption, or
        after an async load whose every block failed)."""
        state.hit = hit
        state.stored = max(state.stored, held)
        state.counts["hit_blocks"] = max(hit, state.counts["hit_blocks"])
        self.counters["hit_blocks"] += hit
        return max(0, hit * self.tpb - num_computed_tokens)

    def _lookup_again(self, state: _Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A lookup of a request whose fetch started before it was admitted (once the fetch is
        done, the load is synchronous; what the pull brought still counts as pulled)."""
        done = self._poll(state.fetch)
        if done is None and time.monotonic() - state.fetch_since <= self.fetch_limit_s:
            new = max(0, state.hit * self.tpb - num_computed_tokens)
            if new > 0:
                return new, True
        self._cancel(state.fetch)
        fetched, state.fetch = not isinstance(state.fetch, _Held), None
        held = state.fetch_held if done is None else max(0, min(state.hit, done))
        if done is not None and fetched:  # what the pull brought, for the engine's timing totals
            pulled = max(0, held - max(state.stored, state.fetch_held))
            state.counts["pulled_tokens"] += pulled * self.tpb
            state.counts["fetch_us"] += int((time.monotonic() - state.fetch_since) * 1e6)
        state.stored = max(state.stored, held)
        state.hit = held
        state.counts["hit_blocks"] = held
        new = max(0, held * self.tpb - num_computed_tokens)
        if self.grouped and new > 0:
            state.fetch = _Held(held)
            return new, True
        return new, False

    def _poll(self, fetch: Any, wait_s: float = 0.0) -> int | None:
        """Blocks the paired worker holds once ``fetch`` is done, None while it runs."""
        if isinstance(fetch, _Held):
            return fetch.blocks
        assert self.link is not None
        return self.link.poll_fetch(fetch, wait_s)

    def _cancel(self, fetch: Any) -> None:
        if not isinstance(fetch, _Held) and self.link is not None:
            self.link.cancel_fetch(fetch)

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            from raykv.integrations.vllm.multimodal import mm_items

            prompt: Sequence[int] = request.prompt_token_ids or ()
            scope = request_scope(request, self.model)
            items = mm_items(request, len(prompt))  # full blocks only are keyed: whole prompt
            keys = LazyKeys(lambda: self._key_chain(prompt, scope, items), len(prompt) // self.tpb)
            state = self._requests[request.request_id] = _Request(
                prompt, scope, keys, request=request, mm=items
            )
        return state

    def _key_chain(
        self, prompt: Sequence[int], scope: ReuseScope, items: tuple[MultimodalItem, ...]
    ) -> Sequence[bytes]:
        """The keys of ``prompt``'s full blocks (on whichever thread first reads a request's
        :class:`LazyKeys`): blocks keyed before, by any request, are not hashed again."""
        if items:
            return block_keys(prompt, self.tpb, scope, items)
        with self._keys_lock:  # SessionKeys is not thread-safe
            return self._keys.keys(prompt, scope)

    def after_alloc(self, request: Any, groups: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """Plan the load of the external hit into the blocks vLLM just allocated (``groups``: the
        request's block ids of each KV cache group; for an asynchronous hit: once its fetch is
        done)."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.load is not None:
            return
        block_ids = groups[0]
        count = num_external_tokens // self.tpb
        first = state.hit - count
        if state.fetch is not None and state.target is None:
            if first < 0 or any(len(g) < state.hit for g in groups):
                log.warning("raykv: %s: fewer blocks than the planned load", request.request_id)
            first = max(0, first)
            more = tuple(tuple(g[first : state.hit]) for g in groups[1:])
            state.target = (first, tuple(block_ids[first : state.hit]), more)
            self._fetching[request.request_id] = state
            return
        if first < 0 or len(block_ids) < state.hit:
            log.warning("raykv: %s: no blocks for the planned load; skipping it", request.request_id)
            return
        keys = tuple(state.keys[first : state.hit])
        state.load = self._load_op(
            request.request_id, state, first, keys, tuple(block_ids[first : state.hit])
        )

    # ---- steps -----------------------------------------------------------------------------------
    def build(
        self, scheduler_output: Any, block_ids_of: Callable[[str], Sequence[Sequence[int]]]
    ) -> RaykvMetadata:
        """This step's metadata: finished fetches' loads, pending synchronous loads and the stores
        of blocks computed this step (``block_ids_of(req_id)``: the request's block ids of each
        KV cache group)."""
        meta = RaykvMetadata(link=self._engine_link)
        if self.link is None:
            return meta
        self._end_prefills()
        self._timing.report()
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        self._async_loads(meta, 0.01 if idle and not self._asking else 0.0)
        if idle and self._asking:  # nothing else to do: wait a little for an answer, not spin
            first = next(iter(self._asking.values()))
            if first.asking is not None:
                concurrent.futures.wait([first.asking], timeout=0.005)
        for req_id, before, computed in _scheduled(scheduler_output):
            state = self._requests.get(req_id)
            if state is None:
                continue
            self._time_prefill(req_id, state, before, computed)
            if state.load is not None:
                meta.loads.append(state.load)
                state.counts["loaded_blocks"] += len(state.load.keys)
                state.load = None
            op = self._store_op(req_id, state, computed, block_ids_of)
            if op is not None:
                meta.stores.append(op)
        return meta

    def _time_prefill(self, req_id: str, state: _Request, before: int, computed: int) -> None:
        """Start timing the request's prefill at its first scheduled step; once this step
        computes the prompt's last token, the next step's plan (or its finish) stops it."""
        if state.prefill_from < 0:
            state.prefill_from, state.prefill_since = before, time.monotonic()
        if before < len(state.prompt) <= computed:
            self._prefilled[req_id] = state

    def _end_prefills(self) -> None:
        """Record the prefill time and tokens of the requests whose prompt the last step
        finished computing."""
        now = time.monotonic()
        for state in self._prefilled.values():
            tokens = len(state.prompt) - state.prefill_from
            if tokens > 0 and not state.counts["prefill_us"]:
                state.counts["prefilled_tokens"] = tokens
                state.counts["prefill_us"] = max(1, int((now - state.prefill_since) * 1e6))
        self._prefilled.clear()

    def _async_loads(self, meta: RaykvMetadata, wait_s: float) -> None:
        """Add the releases and the loads of every fetch that is done or out of time. ``wait_s``:
        how long the first pending fetch may be waited for (when the engine has nothing else to
        do, so that it does not spin)."""
        assert self.link is not None
        meta.loads.extend(self._releases)
        self._releases.clear()
        now = time.monotonic()
        for req_id, state in list(self._fetching.items()):
            done = self._poll(state.fetch, wait_s)
            wait_s = 0.0
            if done is None and now - state.fetch_since <= self.fetch_limit_s:
                continue
            if done is None:
                self._cancel(state.fetch)
                self.counters["fetch_timeouts"] += 1
            del self._fetching[req_id]
            meta.loads.append(self._async_load(req_id, state, state.fetch_held if done is None else done))

    def _async_load(self, req_id: str, state: _Request, held: int) -> LoadOp:
        """The async LoadOp of a finished fetch after which the paired worker holds ``held``
        leading blocks: those blocks of the target are loaded, the others are lost."""
        assert state.target is not None
        first, blocks, more = state.target
        ok = max(0, min(held, state.hit, first + len(blocks)) - first)
        op = self._load_op(
            req_id,
            state,
            first,
            tuple(state.keys[first : first + ok]),
            blocks[:ok],
            blocks[ok:],
            tuple(g[:ok] for g in more),
        )
        pulled = max(0, min(held, state.hit) - max(state.stored, state.fetch_held))
        state.stored = max(state.stored, min(held, state.hit))
        state.counts["pulled_tokens"] += pulled * self.tpb
        state.counts["async_loads"] += 1
        state.counts["loaded_blocks"] += len(blocks)
        state.counts["fetch_us"] += int((time.monotonic() - state.fetch_since) * 1e6)
        self.counters["async_loads"] += 1
        state.fetch = state.target = None
        return op

    def _load_op(
        self,
        req_id: str,
        state: _Request,
        first: int,
        keys: tuple[bytes, ...],
        block_ids: tuple[int, ...],
        lost: tuple[int, ...] | None = None,
        more: tuple[tuple[int, ...], ...] = (),
    ) -> LoadOp:
        """A LoadOp (asynchronous when ``lost`` is given; ``more``: its blocks in groups 1..),
        with the tokens and scope from which the ranks of a tensor-parallel engine key their own
        pages."""
        tokens: tuple[int, ...] = ()
        scope: ReuseScope | None = None
        items: tuple[MultimodalItem, ...] = ()
        if self.ranks > 1:
            tokens, scope = tuple(state.prompt[: (first + len(keys)) * self.tpb]), state.scope
            items = clip_mm_items(state.mm, len(tokens))
        if lost is None:
            return LoadOp(req_id, first, keys, block_ids, False, (), tokens, scope, more, items)
        return LoadOp(req_id, first, keys, block_ids, True, lost, tokens, scope, more, items)

    def _store_op(
        self,
        req_id: str,
        state: _Request,
        computed: int,
        block_ids_of: Callable[[str], Sequence[Sequence[int]]],
    ) -> StoreOp | None:
        generated = self.store_generated and computed > len(state.prompt) and state.request is not None
        known = len(state.request.all_token_ids) if generated else len(state.prompt)
        end = min(computed, known) // self.tpb
        if not self.stores or end <= state.stored:
            return None
        groups = block_ids_of(req_id)
        if any(len(g) < end for g in groups):
            return None
        first, state.stored = state.stored, end
        state.counts["offered_blocks"] += end - first
        source = state.request.all_token_ids if generated else state.prompt
        tokens = tuple(source[: end * self.tpb])
        scope = state.scope
        more = tuple(tuple(g[:end]) for g in groups[1:])
        items = clip_mm_items(state.mm, len(tokens))
        return StoreOp(req_id, tokens, scope, tuple(groups[0][:end]), first, more, items)

    def on_report(self, report: Any, invalid_block_ids: set[int] | None = None) -> None:
        """Fold a step's worker report: hand the inbox commits to the CacheWorker, and offer the
        blocks a store could not write (no free slots) again from the next step on."""
        if isinstance(report, WorkerReport):
            self.counters.update(report.counters)
            for req_id, counts in report.per_request.items():
                state = self._requests.get(req_id)
                if state is not None:
                    state.counts.update(counts)
            for req_id, first in report.unstored.items():
                state = self._requests.get(req_id)
                if state is not None and first < state.stored:
                    state.counts["offered_blocks"] -= state.stored - first
                    state.stored = first
            if self.link is not None and report.commits:
                self.link.store(report.commits)
        if self.link is not None:
            self.counters.update(self.link.poll())

    def finished(self, request: Any) -> dict[str, Any] | None:
        """vLLM's ``request_finished`` (the caller returns False with it: blocks are never held
        after a request, stores copy them in the step that computed them). The request's results
        for its output's ``kv_transfer_params`` (None when unknown): its counters, the paired
        ``worker`` and ``blocks``, the leading blocks the deployment holds or was offered (the
        prompt's, and with ``store_generated`` generated ones; a PD
        proxy passes these to the decode engine's request, whose lookup then fetches those blocks
        from that worker). A pending fetch is dropped; if vLLM already allocated blocks for it
        (the request waits in WAITING_FOR_REMOTE_KVS, and vLLM frees them only once the worker
        side reports it finished receiving), the next step carries a release op."""
        if request.request_id in self._prefilled:  # finished in the step that ended its prefill
            self._end_prefills()
        state = self._requests.pop(request.request_id, None)
        if state is None or self.link is None:
            return None
        self._drop_lookup(request.request_id, state)  # finished or aborted before an answer
        if state.fetch is not None:
            self._cancel(state.fetch)
            if self._fetching.pop(request.request_id, None) is not None:
                self._releases.append(LoadOp(request.request_id, 0, (), (), is_async=True))
                self.counters["released_loads"] += 1
            state.fetch = state.target = None
        result: dict[str, Any] = {k: int(v) for k, v in state.counts.items()}
        self._timing.add(result)
        result["worker"] = self.link.worker
        result["blocks"] = state.stored
        if self.model is not None:
            result["model"] = self.model.hex()  # the fingerprint in its keys' scope
        return {PARAMS_KEY: result}

    def close(self) -> None:
        if self.link is not None:
            self._timing.close()  # what is due goes now
            for req_id, state in self._requests.items():
                self._drop_lookup(req_id, state)
                if state.fetch is not None:
                    self._cancel(state.fetch)
            if self._late is not None:
                self._late.cancel()
            self.link.close()


def _scheduled(scheduler_output: Any) -> list[tuple[str, int, int]]:
    """(request id, tokens computed before this step, once it ran) of every scheduled request."""
    counts = scheduler_output.num_scheduled_tokens
    out = [
        (r.req_id, r.num_computed_tokens, r.num_computed_tokens + counts.get(r.req_id, 0))
        for r in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        before = cached.num_computed_tokens[i]
        out.append((req_id, before, before + counts.get(req_id, 0)))
    return out

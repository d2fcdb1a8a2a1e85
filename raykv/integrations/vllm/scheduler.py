"""The connector's scheduler side (runs in vLLM's EngineCore process): lookups and step plans.

Per request it keeps the prompt's block keys (``raykv.block_keys`` over the full prompt blocks,
in the request's scope: ``cache_salt`` hashed by ``ReuseScope.from_cache_salt``, the LoRA's
``lora_int_id``), how many blocks the deployment holds (``hit``) and how many are stored or
offered (``stored``). Each step it plans:

- loads: after vLLM allocated blocks for an external hit, copy those blocks' pages in
  (``LoadOp``), once;
- stores: every block that becomes fully computed this step (prompt blocks, and with
  ``store_generated``, the default, blocks of generated tokens too) and that the deployment does
  not hold yet (``StoreOp``). Blocks of generated tokens hold KV from one-token decode steps,
  whose last bits differ from a prefill of the same tokens on CPU: a later request reusing them
  (a conversation's next turn) is exact up to those bits, as with vLLM's own prefix cache; set
  ``store_generated`` False to store prompt blocks only.

A lookup never counts the prompt's last token (vLLM must compute at least one token for its
logits), so at most ``(len(prompt) - 1) // block_size`` blocks are loaded.

Per-request results (``hit_blocks``, ``loaded_blocks``, ``load_errors``, ``stored_blocks``) come
back in the request output's ``kv_transfer_params["raykv"]``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raykv import InvalidArgumentError, KVLayout, ReuseScope, block_keys, lora_id_from_name
from raykv.integrations.vllm.link import DeploymentLink
from raykv.integrations.vllm.plan import EngineLink, LoadOp, RaykvMetadata, StoreOp, WorkerReport

log = logging.getLogger(__name__)

PARAMS_KEY = "raykv"


@dataclass
class _Request:
    prompt: tuple[int, ...]
    scope: ReuseScope
    keys: list[bytes]
    hit: int = 0
    stored: int = 0
    load: LoadOp | None = None
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    request: Any = None  # vLLM's Request (its all_token_ids, for generated blocks)


def request_scope(request: Any) -> ReuseScope:
    """The ReuseScope of a vLLM request: its ``cache_salt`` (str, hashed) and its LoRA adapter
    (``lora_int_id``, else the name through ``lora_id_from_name``)."""
    lora = getattr(request, "lora_request", None)
    lora_id = None
    if lora is not None:
        number = getattr(lora, "lora_int_id", None)
        lora_id = int(number) if number is not None else lora_id_from_name(str(lora.lora_name))
    salt = getattr(request, "cache_salt", None)
    if salt is None:
        return ReuseScope(lora_id, None)
    if not isinstance(salt, str):
        raise InvalidArgumentError("cache_salt", f"must be a str, got {type(salt).__name__}")
    return ReuseScope.from_cache_salt(salt, lora_id)


class SchedulerSide:
    """Lookups, load and store plans, and per-request results. ``link`` None: does nothing.

    ``loads``/``stores``: whether this engine reads from / writes to the deployment (vLLM's
    kv_role: consumer reads, producer writes, both does both).
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
        self._engine_link: EngineLink | None = None
        if link is not None:
            staging = int(extra.get("staging_bytes", 256 << 20))
            self._engine_link = link.engine_link(staging, str(extra.get("listen_host", "127.0.0.1")))
        self._requests: dict[str, _Request] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    # ---- lookups ---------------------------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` the deployment can supply (a multiple of the
        block size; 0 when it holds no more, or when disabled); None while a producer's blocks
        named in the request's ``kv_transfer_params`` are still on their way (ask again)."""
        state = self._state(request)
        if self.link is None or not self.loads or not state.keys:
            return 0
        usable = (len(state.prompt) - 1) // self.tpb
        if usable <= num_computed_tokens // self.tpb:
            return 0
        tokens = state.prompt[: usable * self.tpb]
        params = (getattr(request, "kv_transfer_params", None) or {}).get(PARAMS_KEY) or {}
        held = self.link.lookup(tokens, state.scope, state.keys[:usable], params)
        if held is None:
            return None
        state.hit = min(usable, held)
        state.stored = max(state.stored, state.hit)
        state.counts["hit_blocks"] = state.hit
        self.counters["lookups"] += 1
        self.counters["hit_blocks"] += state.hit
        return max(0, state.hit * self.tpb - num_computed_tokens)

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = tuple(request.prompt_token_ids or ())
            scope = request_scope(request)
            full = len(prompt) // self.tpb
            keys = [bytes(k) for k in block_keys(prompt[: full * self.tpb], self.tpb, scope)]
            state = self._requests[request.request_id] = _Request(prompt, scope, keys, request=request)
        return state

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of the external hit into the blocks vLLM just allocated."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.load is not None:
            return
        count = num_external_tokens // self.tpb
        first = state.hit - count
        if first < 0 or len(block_ids) < state.hit:
            log.warning("raykv: %s: no blocks for the planned load; skipping it", request.request_id)
            return
        keys = tuple(state.keys[first : state.hit])
        state.load = LoadOp(request.request_id, first, keys, tuple(block_ids[first : state.hit]))

    # ---- steps -----------------------------------------------------------------------------------
    def build(self, scheduler_output: Any, block_ids_of: Callable[[str], list[int]]) -> RaykvMetadata:
        """This step's metadata: pending loads and the stores of blocks computed this step."""
        meta = RaykvMetadata(link=self._engine_link)
        if self.link is None:
            return meta
        for req_id, computed in _scheduled(scheduler_output):
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.load is not None:
                meta.loads.append(state.load)
                state.counts["loaded_blocks"] += len(state.load.keys)
                state.load = None
            op = self._store_op(req_id, state, computed, block_ids_of)
            if op is not None:
                meta.stores.append(op)
        return meta

    def _store_op(
        self, req_id: str, state: _Request, computed: int, block_ids_of: Callable[[str], list[int]]
    ) -> StoreOp | None:
        tokens = state.prompt
        if self.store_generated and computed > len(tokens) and state.request is not None:
            tokens = tuple(state.request.all_token_ids[:computed])
        end = min(computed, len(tokens)) // self.tpb
        if not self.stores or end <= state.stored:
            return None
        blocks = block_ids_of(req_id)
        if len(blocks) < end:
            return None
        first, state.stored = state.stored, end
        state.counts["offered_blocks"] += end - first
        tokens = tokens[: end * self.tpb]
        scope = state.scope
        return StoreOp(req_id, tokens, scope.lora_id, scope.salt, tuple(blocks[:end]), first)

    def on_report(self, report: Any, invalid_block_ids: set[int] | None = None) -> None:
        """Fold a step's worker report: ask the CacheWorker to pull what was staged."""
        if isinstance(report, WorkerReport):
            self.counters.update(report.counters)
            for req_id, counts in report.per_request.items():
                state = self._requests.get(req_id)
                if state is not None:
                    state.counts.update(counts)
            if self.link is not None and report.staging is not None:
                for keys in report.staged:
                    self.link.store(report.staging, keys)
        if self.link is not None:
            self.counters.update(self.link.poll())

    def finished(self, request: Any) -> dict[str, Any] | None:
        """The request's results for its output's ``kv_transfer_params`` (None when unknown):
        its counters, the paired ``worker`` and ``blocks``, the prompt blocks the deployment holds
        or was offered (a PD proxy passes these to the decode engine's request, whose lookup then
        waits for those blocks on that worker and pulls them)."""
        state = self._requests.pop(request.request_id, None)
        if state is None or self.link is None:
            return None
        result: dict[str, Any] = {k: int(v) for k, v in state.counts.items()}
        result["worker"] = self.link.worker
        result["blocks"] = state.stored
        return {PARAMS_KEY: result}

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


def _scheduled(scheduler_output: Any) -> list[tuple[str, int]]:
    """(request id, tokens computed once this step ran) of every scheduled request."""
    counts = scheduler_output.num_scheduled_tokens
    out = [
        (r.req_id, r.num_computed_tokens + counts.get(r.req_id, 0))
        for r in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        out.append((req_id, cached.num_computed_tokens[i] + counts.get(req_id, 0)))
    return out

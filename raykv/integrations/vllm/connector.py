"""RaykvConnector: the vLLM (0.32, V1) KV connector class, built on first use.

vLLM loads it by name: ``KVTransferConfig(kv_connector="RaykvConnector",
kv_connector_module_path="raykv.integrations.vllm", ...)``; the package's ``__getattr__`` calls
:func:`connector_class`, which imports vllm and subclasses ``KVConnectorBase_V1`` (so importing
raykv never imports vllm or torch). The scheduler-side instance delegates to
:class:`~raykv.integrations.vllm.scheduler.SchedulerSide`, the worker-side one to
:class:`~raykv.integrations.vllm.worker.WorkerSide`.

Loads run in ``start_load_kv`` and are whole when it returns (layers never wait in
``wait_for_layer_load``). A hit the paired CacheWorker holds is a synchronous load
(``get_num_new_matched_tokens`` returns ``(tokens, False)``), copied before the forward pass of the
step that computes the rest of the prompt. A hit another worker holds, or a prefill/decode
producer's blocks still on their way, is an asynchronous load (``(tokens, True)``): the scheduler
side starts a fetch to the paired CacheWorker in the background, the request waits in vLLM's
WAITING_FOR_REMOTE_KVS with its blocks allocated, and once the fetch is done (polled each step,
bounded by ``2 * timeout_s``) the worker side loads those blocks in the next step (with or
without a forward pass) and reports the request through ``get_finished`` as finished receiving;
blocks the fetch did not bring are load errors, recomputed by vLLM. A request that finishes or
is aborted while its fetch is pending is released the same way without a load.

Stores are copies: ``wait_for_save`` copies the blocks computed in the step into the inbox the
paired CacheWorker leased the worker side, synchronously, after the forward pass; the CacheWorker
commits them from there later. Engine blocks are therefore never needed after the step that
computed them, and ``request_finished`` always returns False: vLLM frees a finished request's
blocks at once (but those of a request aborted while it waits for an asynchronous load, which vLLM
frees once the release above is reported), and ``get_finished`` reports no finished sending.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from raykv.integrations.vllm.identity import model_fingerprint, model_name
from raykv.integrations.vllm.kv_blocks import check_page_layout, resolve_layout
from raykv.integrations.vllm.layout import (
    check_parallel,
    engine_layout,
    is_grouped,
    is_latent,
    layer_groups,
    paired_worker,
)
from raykv.integrations.vllm.link import open_link
from raykv.integrations.vllm.plan import RaykvMetadata, WorkerReport
from raykv.integrations.vllm.scheduler import SchedulerSide
from raykv.integrations.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


class _ConnectorImpl:
    """The connector's behavior, mixed into the vLLM base class by :func:`connector_class`."""

    _scheduler: SchedulerSide | None
    _worker: WorkerSide | None
    _kv_cache_layout: str | None
    _raykv_vllm_config: Any

    def _setup(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        ranks = check_parallel(vllm_config)  # before anything opens: a split engine fails to start
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        extra["worker"] = paired_worker(extra.get("worker", 0), vllm_config)  # one per data-parallel rank
        page_layout = str(extra.get("page_layout", "token_major"))
        cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
        layout, names = engine_layout(kv_cache_config, page_layout, cache_dtype)
        replicated = is_latent(layout)  # every rank holds the same latents: one set of pages
        extra["tensor_parallel_size"] = 1 if replicated else ranks
        grouped = is_grouped(kv_cache_config)  # block ids per KV cache group: async loads only
        extra["grouped"] = grouped
        self._kv_cache_layout = resolve_layout(extra.get("kv_cache_layout"), None)
        check_page_layout(self._kv_cache_layout, page_layout)
        self._raykv_vllm_config = vllm_config
        self._scheduler = self._worker = None
        if role.name == "SCHEDULER":
            model = model_fingerprint(vllm_config, layout, extra["tensor_parallel_size"], extra)
            extra["model_fingerprint"] = model  # in every key's scope: no match across models
            link = open_link(extra)
            if link is not None:
                try:
                    link.bind(layout, model_name(vllm_config, extra), model)
                except BaseException:
                    link.close()
                    raise
            loads, stores = transfer.is_kv_consumer, transfer.is_kv_producer
            self._scheduler = SchedulerSide(layout, link, loads, stores, extra)
        else:
            rank = tensor_parallel_rank() if ranks > 1 else 0
            groups = layer_groups(kv_cache_config, names) if grouped else None
            self._worker = WorkerSide(layout, names, rank, ranks, replicated, groups)

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """The scheduler-side state (None in a worker process): its ``counters`` and ``model``."""
        return self._scheduler

    # ---- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        backend = attention_backend(self._raykv_vllm_config, self._worker.names)
        kv_cache_layout = resolve_layout(self._kv_cache_layout, backend)
        self._worker.register(kv_caches, kv_cache_layout)
        log.info("raykv: attention backend %s, kv_cache_layout %s", backend, kv_cache_layout)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()  # type: ignore[attr-defined]
        if self._worker is not None and isinstance(meta, RaykvMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # stores run once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()  # type: ignore[attr-defined]
        if self._worker is not None and isinstance(meta, RaykvMetadata):
            self._worker.save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed() if self._worker is not None else set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: no save ever holds blocks, requests of this step's asynchronous loads): the
        finished part of :meth:`get_transfer_results`, which vLLM 0.32 calls instead."""
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's ``KVConnectorTransferResults``: no finished sends, this step's asynchronous
        loads as finished receiving, and, on an engine with block ids per KV cache group, those
        whose load failed as failed receiving (vLLM recomputes such a request whole)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        if self._worker is None:
            return KVConnectorTransferResults()
        received, failed = self._worker.take_received(), self._worker.take_failed_requests()
        return KVConnectorTransferResults(finished_recving=received | failed, failed_recving=failed)

    def build_connector_worker_meta(self) -> Any:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        groups = [list(g) for g in blocks.get_block_ids()]
        self._scheduler.after_alloc(request, groups, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> RaykvMetadata:
        assert self._scheduler is not None
        manager = self._kv_cache_manager  # type: ignore[attr-defined]
        return self._scheduler.build(
            scheduler_output, lambda rid: [list(g) for g in manager.get_block_ids(rid)]
        )

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            self._scheduler.on_report(report if isinstance(report, WorkerReport) else None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Never holds the blocks (False): stores were copied in the steps that computed them."""
        if self._scheduler is None:
            return False, None
        return False, self._scheduler.finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid-manager form of :meth:`request_finished` (the same answer)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])


def tensor_parallel_rank() -> int:
    """This worker process's tensor-parallel rank (vLLM's model-parallel groups exist by the
    time the worker-side connector is built)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def attention_backend(vllm_config: Any, names: Sequence[str]) -> str | None:
    """vLLM's name of the attention backend of layers ``names`` (e.g. ``FLASH_ATTN``), or None
    when vLLM cannot say (the connector then goes by the tensors and its ``kv_cache_layout``)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(vllm_config, list(names))
    except Exception as exc:  # vLLM internals: a missing helper must not stop the engine
        log.warning("raykv: cannot tell the attention backend (%s: %s)", type(exc).__name__, exc)
        return None
    found = {str(b.get_name()) for b in backends}
    return found.pop() if len(found) == 1 else None


@functools.cache
def connector_class() -> type:
    """The ``RaykvConnector`` class (imports vllm; ImportError without it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
        SupportsHMA,
    )

    class RaykvConnector(_ConnectorImpl, KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, valid-type]
        """raykv as vLLM's KV connector (see :mod:`raykv.integrations.vllm`); it supports vLLM's
        hybrid KV cache manager (``SupportsHMA``), so sliding-window layers keep only their
        window's blocks."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            self._setup(vllm_config, role, kv_cache_config)

    RaykvConnector.__module__ = "raykv.integrations.vllm"
    return RaykvConnector

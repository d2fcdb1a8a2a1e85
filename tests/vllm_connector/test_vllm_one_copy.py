"""One-copy stores in a real engine (raykv.transfer.kv_share): a CPU engine with ``engine_native``
pages shares its KV memory with its paired worker, which copies stored blocks straight out of it.

The engine's outputs are compared bit for bit with the ``baseline`` engine (no connector): a
block committed with wrong bytes would change the tokens or logprobs of the repeat that loads it.
A stopped worker (SIGSTOP) must not stall the engine: the shared store is abandoned after
``STORE_WAIT_S``, its blocks go through the inbox a step later, and the worker holds them all once
it runs again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from deps import require

require("vllm", reason="vllm is not installed (pip install -e '.[vllm]', see README)")

import ray  # noqa: E402

from raykv.integrations.vllm import testing  # noqa: E402
from raykv.integrations.vllm.testing import generate  # noqa: E402
from raykv.integrations.vllm.worker import STORE_WAIT_S  # noqa: E402
from raykv.transfer.kv_share import memory  # noqa: E402

from .helpers import TPB, engine_on, prompt, wait_held, worker  # noqa: E402

# An engine start and six requests (~60 s on 2 cores): run by CI with `pytest -m ci_only`.
pytestmark = [
    pytest.mark.ci_only,
    pytest.mark.skipif(not memory.supported(), reason="engine memory is shared on Linux x86-64 only"),
]


def _same(got: Any, want: Any) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs


@pytest.mark.timeout(600)
def test_one_copy_stores_are_exact_and_a_stopped_worker_does_not_stall_them(
    baseline: Any, model_dir: str, ray_address: str
) -> None:
    tokens, other = prompt(61, 6 * TPB + 3), prompt(67, 6 * TPB + 3)
    layout = testing.tiny_layout(page_layout="engine_native")
    native = {"page_layout": "engine_native"}
    with engine_on(layout, 1, model_dir, ray_address, 0, connector=native) as (dep, llm):
        first = generate(llm, tokens, max_tokens=4)
        assert first.raykv["shared_store_blocks"] == first.raykv["stored_blocks"] == 6
        assert "store_abandoned_blocks" not in first.raykv
        wait_held(dep, 0, tokens, 6)
        again = generate(llm, tokens, max_tokens=4)
        assert again.raykv["loaded_blocks_ok"] == 6 and again.raykv.get("load_errors", 0) == 0
        pid = int(ray.get(worker(dep, 0).status.remote(), timeout=30)["pid"])
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            stalled = generate(llm, other, max_tokens=4)
            took = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"a request while the worker was stopped: {took:.2f} s", stalled.raykv)
        # the first store waited STORE_WAIT_S and was abandoned; the inbox took every block then
        assert stalled.raykv["store_abandoned_blocks"] >= 1 and stalled.raykv["staged_blocks"] == 6
        assert stalled.raykv["store_us"] >= STORE_WAIT_S * 1e6 and "shared_store_blocks" not in stalled.raykv
        assert took < 10 * STORE_WAIT_S + 1.0  # bounded: no wait on the 10 s call timeout
        wait_held(dep, 0, other, 6, timeout=60)
        loaded = generate(llm, other, max_tokens=4)
        assert loaded.raykv["loaded_blocks_ok"] == 6 and loaded.raykv.get("load_errors", 0) == 0
    want, want_other = generate(baseline, tokens, max_tokens=4), generate(baseline, other, max_tokens=4)
    for got, ref in ((first, want), (again, want), (stalled, want_other), (loaded, want_other)):
        _same(got, ref)

"""raykv bench index --scale, at a size a unit test affords: its figures are the index's own.

The run's memberships, keys and holders follow from its arguments; the table's bytes per
membership come from the table (compiled: under the issue's 64 B goal at one holder); routes ran
while batches were applied, and the chain keys are the same on every call (no key list is kept).
"""

from __future__ import annotations

import numpy as np

from raykv import native
from raykv.bench.index_scale import CHAIN, chain_keys, format_results, measure


def test_chain_keys_are_stable_and_distinct():
    a, b = chain_keys(5, 3), chain_keys(6, 1)
    assert a.shape == (3, CHAIN, 32) and np.array_equal(a[1], b[0])
    flat = {bytes(k) for k in chain_keys(0, 50).reshape(-1, 32)}
    assert len(flat) == 50 * CHAIN


def test_a_small_scale_run_reports_the_index_figures():
    result = measure(200_000, 4, paced_s=0.3)
    assert result.memberships == 200_000 and result.keys == 50_000 and result.holders == 4
    assert result.routes > 0 and result.route_p50_us > 0 and result.paced_events_per_s > 0
    assert result.ingest_events_per_s > 0 and result.longest_pause_ms > 0
    if native.load("_holders") is not None:
        assert result.table == "compiled" and result.bytes_per_membership < 64
    assert "| 0.2M | 4 |" in format_results([result])

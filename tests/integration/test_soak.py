"""The fault soak (``raykv bench soak``) on a short run: every fault kind is injected, no page
served is wrong and no request fails because of the cache."""

from __future__ import annotations

from actors.bench.soak import FAULT_KINDS, SoakArgs, report, run_soak


def test_short_soak_serves_only_right_pages(ray_local: None) -> None:
    args = SoakArgs(minutes=0.75, workers=3, seed=0, fault_interval_s=1.5, every_kind=True)
    tally = run_soak(args, progress=False)
    text = report(tally, args)
    assert tally.mismatches == 0, text
    assert tally.failed == 0, text
    assert all(tally.faults[kind] >= 1 for kind in FAULT_KINDS), text
    assert tally.served > 0 and tally.verified_pages > 0, text
    assert tally.pulls > 0, text
    assert len(tally.windows) >= 4, text
    assert text.splitlines()[-1].startswith("soak 0.75 min, 3 workers, seed 0: ")

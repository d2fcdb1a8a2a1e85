"""The replay's timing model on hand-built cases."""

from __future__ import annotations

import pytest

from raykv.core.errors import InvalidArgumentError
from raykv.replay.timing import ServerQueues, TimingConfig
from raykv.replay.trace import Request


def test_fifo_server_ttft_and_finish() -> None:
    q = ServerQueues(1, speed=100.0)
    q.advance(0.0)
    a = q.dispatch(0, pre_s=0.0, uncached=100, work=150)  # 100 prefill + 10 tokens x 5
    assert (a.start, a.ttft, a.finish) == pytest.approx((0.0, 1.0, 1.5))
    q.advance(0.5)
    assert q.queue_lengths() == [1] and q.outstanding() == pytest.approx([100.0])
    b = q.dispatch(0, pre_s=0.25, uncached=50, work=50)
    assert b.start == pytest.approx(1.5)
    assert b.ttft == pytest.approx(1.0 + 0.25 + 0.5)  # waited 1 s, pulled 0.25 s, prefilled 0.5 s
    assert b.finish == pytest.approx(1.5 + 0.25 + 0.5)
    q.advance(1.6)
    assert q.queue_lengths() == [1]
    q.advance(10.0)
    assert q.queue_lengths() == [0] and q.outstanding() == [0.0]


def test_clock_never_goes_back_and_idle_servers_start_at_arrival() -> None:
    q = ServerQueues(2, speed=10.0)
    q.advance(5.0)
    q.advance(1.0)
    assert q.now == 5.0
    s = q.dispatch(1, 0.0, 10, 10)
    assert s.start == 5.0 and s.ttft == pytest.approx(1.0)
    assert q.imbalance() == pytest.approx(2.0)  # all work on one of two servers


def test_reported_load_is_prefill_left_in_flight_and_learned_decode() -> None:
    q = ServerQueues(2, speed=100.0)
    q.advance(0.0)
    q.dispatch(0, pre_s=0.0, uncached=100, work=150)  # prefill until 1.0, decode until 1.5
    q.dispatch(0, pre_s=0.0, uncached=200, work=300)  # starts 1.5, prefill until 3.5, done 4.5
    assert q.queued_prefill == [300.0, 0.0] and q.in_flight == [2, 0] and q.mean_decode_units == 0.0
    q.advance(0.5)
    assert q.queued_prefill[0] == pytest.approx(250.0)  # half of the first prefill is done
    q.advance(2.0)  # the first finished (50 decode units); the second is 0.5 s into its prefill
    assert q.queued_prefill[0] == pytest.approx(150.0)
    assert q.in_flight == [1, 0] and q.mean_decode_units == pytest.approx(50.0)
    assert q.reported_loads() == pytest.approx([150.0 + 50.0 * 1, 0.0])  # prefill left + decode estimate
    q.advance(4.0)  # decoding: no prefill left, still in flight
    assert q.queued_prefill == [0.0, 0.0] and q.in_flight == [1, 0] and q.busy_since == [0.0, 0.0]
    q.advance(9.0)
    q.dispatch(0, 0.0, 10, 10)
    assert q.in_flight == [1, 0] and q.busy_since[0] == 9.0 and q.mean_decode_units == pytest.approx(75.0)


def test_calibration_puts_no_cache_work_at_target_load() -> None:
    reqs = [Request(0.0, 1000, 100, (0, 1)), Request(10.0, 500, 0, (2,))]
    t = TimingConfig(target_load=0.5, decode_units_per_token=2.0)
    speed = t.calibrate(reqs, servers=4)
    assert speed == pytest.approx((1200 + 500) / (0.5 * 4 * 10.0))
    assert TimingConfig(speed=7.0).calibrate(reqs, 4) == 7.0


def test_transfer_and_tier_costs() -> None:
    t = TimingConfig(
        kv_bytes_per_token=1000, link_bytes_per_s=1e6, link_latency_s=0.01, lower_tier_bytes_per_s=(2e6, 1e6)
    )
    assert t.pull_s(0) == 0.0
    assert t.pull_s(1000) == pytest.approx(0.01 + 1.0)
    assert t.lower_tier_s([5000, 0, 0]) == 0.0  # the top tier is free
    assert t.lower_tier_s([0, 2000, 1000]) == pytest.approx(1.0 + 1.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"target_load": 0},
        {"link_bytes_per_s": 0},
        {"speed": -1.0},
        {"lower_tier_bytes_per_s": (0.0,)},
        {"decode_units_per_token": -1},
    ],
)
def test_bad_timing_config(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        TimingConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ServerQueues(0, 1.0)

"""The token bucket and delay line behind emulated links (timing-free, with a fake clock where possible)."""

from __future__ import annotations

import threading
import time

import pytest

from edgeswarm.bus.shaping import DelayLine, TokenBucket


def test_token_bucket_paces_at_the_rate_with_bounded_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(rate_bps=1000.0, burst_bytes=100, clock=lambda: now[0])
    assert bucket.reserve(500) == pytest.approx(0.5 - 0.1)  # 100 bytes of credit after a long idle
    assert bucket.reserve(500) == pytest.approx(0.9)
    now[0] = 5.0
    assert bucket.reserve(1000) == pytest.approx(5.9)


def test_token_bucket_shares_the_rate_between_concurrent_senders() -> None:
    now = [0.0]
    bucket = TokenBucket(rate_bps=100.0, burst_bytes=0, clock=lambda: now[0])
    ends = sorted(bucket.reserve(100) for _ in range(4))
    assert ends == pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_token_bucket_rejects_a_zero_rate() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate_bps=0, burst_bytes=0)


def test_delay_line_runs_in_time_order() -> None:
    line = DelayLine("test")
    seen: list[int] = []
    done = threading.Event()
    start = time.monotonic()
    line.at(start + 0.06, lambda: seen.append(3) or done.set())
    line.at(start + 0.02, lambda: seen.append(1))
    line.at(start + 0.02, lambda: seen.append(2))  # same time: first in, first out
    assert done.wait(2.0)
    line.stop()
    assert seen == [1, 2, 3]


def test_delay_line_survives_a_failing_callable() -> None:
    line = DelayLine("test")
    done = threading.Event()
    line.at(time.monotonic(), lambda: 1 / 0)
    line.at(time.monotonic(), done.set)
    assert done.wait(2.0)
    line.stop()


def test_delay_line_stopped_with_a_drain_runs_what_is_in_the_air_first() -> None:
    """A message still within its latency when the bus stops is delivered (within the drain), not dropped; without
    a drain, or past it, what is left is dropped."""
    line = DelayLine("test")
    seen: list[str] = []
    line.at(time.monotonic() + 0.1, lambda: seen.append("in the air"))
    line.stop(drain_s=5.0)
    assert seen == ["in the air"]

    line = DelayLine("test")
    line.at(time.monotonic() + 60.0, lambda: seen.append("an hour late"))
    line.stop(drain_s=0.2)
    assert seen == ["in the air"]

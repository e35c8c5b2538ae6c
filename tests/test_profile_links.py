"""Link measurement over the real MQTT data path between two profiler services, one link shaped."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import bus_settings
from edgeswarm.errors import LinkMeasurementError
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.services.profiler.service import ProfilerService
from edgeswarm.settings import LinkSpec
from helpers import running, wait_until

SHAPED_BPS = 12.5e6  # 100 Mbps
SHAPED_LATENCY_S = 0.002


def online(service: ProfilerService, peer: str) -> bool:
    status = service.bus.peers.get(peer, "profiler")
    return status is not None and status.state == "online"


@pytest.mark.alone
def test_a_shaped_100_mbps_link_measures_near_12_5_mb_per_s(broker: BrokerProcess, tmp_path: Path) -> None:
    shaped = {"b": LinkSpec(bandwidth_bps=SHAPED_BPS, latency_s=SHAPED_LATENCY_S)}
    a = ProfilerService(bus_settings(broker.url, node_id="a", links=shaped, profile_dir=tmp_path / "a"))
    b = ProfilerService(bus_settings(broker.url, node_id="b", profile_dir=tmp_path / "b"))
    with running(b), running(a):
        wait_until(lambda: online(a, "b") and online(b, "a"), 15, message="both profilers online")
        link = a.links.measure("b")
        back = b.links.measure("a")  # the other direction is not shaped
        with pytest.raises(LinkMeasurementError, match="nobody"):
            a.links.measure("nobody", timeout_s=1)

    assert (link.src, link.dst) == ("a", "b")
    # The shaped link cannot measure faster than its rate (the token bucket holds the sender back); how much
    # slower a loaded machine measures it is not asserted (tests never assert on wall-clock speed).
    assert 0 < link.bandwidth_bps < 1.15 * SHAPED_BPS, link
    # Round trips are real; the shaped direction's 2 ms delay is not asserted here: ShapedLink schedules
    # a message that fits in the bucket's burst credit at a time in the past, so small pings skip it.
    assert link.latency_s > 0 and back.latency_s > 0 and back.bandwidth_bps > 0
    assert a.metrics.counter("handler_errors") == 0 and b.metrics.counter("handler_errors") == 0


def test_a_link_measures_its_cost_per_message_and_per_request(broker: BrokerProcess, tmp_path: Path) -> None:
    a = ProfilerService(bus_settings(broker.url, node_id="a", profile_dir=tmp_path / "a"))
    b = ProfilerService(bus_settings(broker.url, node_id="b", profile_dir=tmp_path / "b"))
    with running(b), running(a):
        wait_until(lambda: online(a, "b") and online(b, "a"), 15, message="both profilers online")
        link = a.links.measure("b", pings=5, requests=3, min_bulk_bytes=64 * 1024, max_bulk_bytes=256 * 1024,
                               target_s=0.05)
        quick = a.links.measure("b", pings=3, requests=0, min_bulk_bytes=64 * 1024, max_bulk_bytes=64 * 1024)

    # Measured on the real broker: a message and a request through it take time, and the figures are finite
    # (LinkProfile refuses anything else). A one-way message is half a ping's round trip, less its bytes.
    assert 0 < link.message_s <= link.latency_s / 2
    assert 0 < link.request_s < 60
    assert quick.request_s == 0 and quick.message_s > 0
    assert a.metrics.counter("handler_errors") == 0 and b.metrics.counter("handler_errors") == 0

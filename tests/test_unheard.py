"""A QoS 1 message to an inbox that the broker heard no one for (MQTT 5 "no matching subscribers": the subscriber is
between connections, as after a broker restart) is held and sent again once the subscriber is back; a message to a
topic that is not an inbox is not; one whose receiver never comes back is given up (edgeswarm.bus.unheard)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from edgeswarm.bus import unheard
from edgeswarm.bus.mqtt import MqttConnection
from edgeswarm.bus.unheard import Unheard, UnheardResender
from edgeswarm.local.broker import BrokerProcess, start_broker
from helpers import wait_until


def _message(topic: str, payload: bytes, give_up_in_s: float = 30.0) -> Unheard:
    return Unheard(topic, payload, False, None, time.monotonic() + give_up_in_s)


def test_the_resender_probes_one_message_then_sends_the_rest_in_order_once_one_is_heard() -> None:
    sent: list[Unheard] = []
    arrived = threading.Condition()

    def send(msg: Unheard) -> None:
        with arrived:
            sent.append(msg)
            arrived.notify_all()

    resender = UnheardResender(send, label="test")
    try:
        for i in range(3):
            resender.unheard(_message("t/a", bytes([i])))
        with arrived:
            assert arrived.wait_for(lambda: len(sent) == 1, 5)
        assert sent[0].payload == b"\x00" and sent[0].probe  # one at a time while no one hears
        time.sleep(3 * unheard.PROBE_FIRST_S)
        assert len(sent) == 1 and resender.held == 2
        resender.unheard(sent[0])  # the probe, heard by no one again: back to the front, a longer pause
        with arrived:
            assert arrived.wait_for(lambda: len(sent) == 2, 5)
        assert sent[1].payload == b"\x00" and sent[1].probe
        resender.heard("t/a")
        with arrived:
            assert arrived.wait_for(lambda: len(sent) == 4, 5)
        assert [m.payload for m in sent[2:]] == [b"\x01", b"\x02"] and not any(m.probe for m in sent[2:])
        assert resender.held == 0
    finally:
        resender.close()


def test_a_message_held_past_its_give_up_time_is_dropped() -> None:
    sent: list[Unheard] = []
    resender = UnheardResender(sent.append, label="test")
    try:
        resender.unheard(_message("t/b", b"late", give_up_in_s=0.0))
        wait_until(lambda: resender.dropped == 1, 5, message="the message given up")
        assert not sent and resender.held == 0
    finally:
        resender.close()


@pytest.fixture
def restartable(tmp_path: Path):  # type: ignore[no-untyped-def]
    brokers = [start_broker("mosquitto", workdir=tmp_path / "broker-1")]
    yield brokers
    for b in brokers:
        b.stop()


def _subscriber(broker: BrokerProcess, topic: str, got: list[bytes]) -> MqttConnection:
    def on_message(msg) -> None:  # type: ignore[no-untyped-def]
        got.append(bytes(msg.payload))
        msg.ack()

    conn = MqttConnection(broker.url, f"sub-{time.monotonic_ns()}", on_message=on_message)
    conn.connect(10)
    conn.subscribe(topic)
    return conn


def test_an_inbox_message_published_before_its_subscriber_is_back_arrives_once_it_is(restartable, tmp_path) -> None:
    """What a broker restart does: the publisher reconnects first and its messages are heard by no one; the inbox's
    subscriber subscribes again a moment later and gets them. A topic that is not an inbox is not held."""
    broker = restartable[0]
    publisher = MqttConnection(broker.url, "pub-unheard")
    publisher.connect(10)
    got: list[bytes] = []
    late: MqttConnection | None = None
    try:
        for i in range(3):
            publisher.publish("edgeswarm/node/b/svc/data/a", f"tensor {i}".encode(), inbox=True)
        publisher.publish("edgeswarm/node/b/svc/data/a", b"not an inbox", inbox=False)
        wait_until(lambda: publisher.unheard.held + publisher.unheard.resent >= 3, 10,
                   message="the three inbox messages heard by no one")
        time.sleep(0.3)
        late = _subscriber(broker, "edgeswarm/node/b/svc/data/+", got)
        wait_until(lambda: len(got) == 3, 15, message="the held messages once the subscriber is back")
        assert sorted(got) == [b"tensor 0", b"tensor 1", b"tensor 2"]
        time.sleep(0.3)
        assert len(got) == 3 and publisher.unheard.held == 0  # sent once each; "not an inbox" was dropped
        # The broker restarted: the subscriber's session is gone until it subscribes again after reconnecting.
        broker.stop()
        restartable.append(start_broker("mosquitto", port=broker.port, workdir=tmp_path / "broker-2"))
        wait_until(lambda: publisher.connected, 30, message="the publisher reconnected")
        publisher.publish("edgeswarm/node/b/svc/data/a", b"after the restart", inbox=True)
        wait_until(lambda: b"after the restart" in got, 30, message="the message after the restart")
        assert got.count(b"after the restart") == 1
    finally:
        publisher.close()
        if late is not None:
            late.close()

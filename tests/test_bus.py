"""The bus against a real Mosquitto: routing, request/response, big tensors, reconnects, limits, shaping."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.bus.shaping import LINK_BURST_BYTES
from edgeswarm.errors import (
    PayloadTooLargeError,
    PublishTimeoutError,
    RequestTimeoutError,
    UnknownNodeError,
    UnknownRouteError,
)
from edgeswarm.local.broker import BrokerProcess, start_broker
from edgeswarm.settings import LinkSpec
from edgeswarm.wire import encode
from helpers import announce, wait_until

MIB = 1024 * 1024



def collect(bus: Bus, topic: str, schemas: tuple[type[m.Message], ...] | None = None,
            plane: str = "hub") -> list[Inbound]:
    got: list[Inbound] = []
    bus.subscribe(topic, got.append, schemas=schemas, plane=plane)
    return got


def open_sink(bus: Bus, node: str, service: str, count: int) -> tuple[list[Inbound], threading.Event]:
    """A data-plane receiver on ``bus`` for ``count`` tensors."""
    got: list[Inbound] = []
    done = threading.Event()

    def on_data(msg: Inbound) -> None:
        got.append(msg)
        if len(got) >= count:
            done.set()

    bus.subscribe(topics.data(node, service), on_data, schemas=(m.BenchData,), plane="data")
    return got, done


def test_publish_subscribe_routes_by_schema_and_rejects_others(make_bus) -> None:
    a = make_bus("a")
    probes = collect(a, topics.request("a", "svc"), schemas=(m.Probe,))
    b = make_bus("b")
    b.publish(topics.request("a", "svc"), m.Probe())
    b.publish(topics.request("a", "svc"), m.BenchEcho(payload=b"no handler takes this"))
    wait_until(lambda: probes and a.metrics.counter("rejected.unexpected_schema"), 5, message="routing")
    assert probes[0].envelope.sender_node == "b" and isinstance(probes[0].body, m.Probe)
    assert len(probes) == 1


def test_request_reply_and_timeout(make_bus) -> None:
    server = make_bus("srv")
    server.subscribe(topics.request("srv", "svc"),
                     lambda msg: server.reply(msg, m.BenchEchoReply(payload=msg.body.payload)),
                     schemas=(m.BenchEcho,))
    client = make_bus("cli")
    reply = client.request(topics.request("srv", "svc"), m.BenchEcho(payload=b"ping"), timeout_s=5)
    assert isinstance(reply.body, m.BenchEchoReply) and reply.body.payload == b"ping"
    assert reply.envelope.sender_node == "srv"
    start = time.monotonic()
    with pytest.raises(RequestTimeoutError, match="no reply"):
        client.request(topics.request("nobody", "svc"), m.Probe(), timeout_s=0.5)
    assert time.monotonic() - start < 3


def test_a_64_mib_tensor_arrives_intact_in_chunks(make_bus) -> None:
    receiver = make_bus("rx", "sink")
    got, done = open_sink(receiver, "rx", "sink", 1)
    announce(receiver)
    sender = make_bus("tx")
    value = np.random.default_rng(7).standard_normal(16 * MIB, dtype=np.float32)  # 64 MiB
    sent = sender.send_tensor("rx", "sink", m.BenchData(run_id="big", seq=0), value)
    assert done.wait(60), "the tensor did not arrive"
    assert sent > 64 * MIB
    out = got[0].tensor
    assert out is not None and out.dtype == "float32" and np.array_equal(out.array, value)
    assert receiver.metrics.counter("tensors_in") == 1


def test_duplicate_deliveries_are_handled_once(make_bus) -> None:
    rx = make_bus("rx", "sink")
    probes = collect(rx, topics.request("rx", "sink"), schemas=(m.Probe,))
    got, done = open_sink(rx, "rx", "sink", 1)
    tx = make_bus("tx")
    body = m.Probe()
    frame = encode(tx.sender.envelope(body), body)
    for _ in range(3):  # what QoS 1 redelivery looks like to the receiver
        tx.hub.publish(topics.from_sender(topics.request("rx", "sink"), "tx"), frame)
    from edgeswarm.wire import tensor_frames

    data = m.BenchData(run_id="d", seq=0)
    chunks = list(tensor_frames(tx.sender.envelope(data), data, np.arange(1000, dtype=np.int32), 1000))
    # A whole tensor again (what a resumed session resends when the first copy's acknowledgements went to the ended
    # connection), then two of its chunks once more.
    for chunk in chunks + chunks + chunks[:2]:
        tx.hub.publish(topics.from_sender(topics.data("rx", "sink"), "tx"), chunk)
    assert done.wait(5)
    wait_until(lambda: rx.metrics.counter("duplicates") == 2, 5, message="duplicate control messages dropped")
    time.sleep(0.3)
    assert len(probes) == 1 and len(got) == 1


def test_bad_payloads_and_failing_handlers_do_not_stop_the_bus(make_bus) -> None:
    rx = make_bus("rx")
    calls: list[int] = []

    def flaky(msg: Inbound) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        if len(calls) == 2:
            raise UnknownRouteError("job 42 is not known here")

    rx.subscribe(topics.request("rx", "svc"), flaky, schemas=(m.Probe,))
    tx = make_bus("tx")
    for junk in (b"garbage", b"ES\x01\x00\xff\xff\xff\xff", b"\x00" * 100):
        tx.hub.publish(topics.from_sender(topics.request("rx", "svc"), "tx"), junk)
    for _ in range(3):
        tx.publish(topics.request("rx", "svc"), m.Probe())
    wait_until(lambda: len(calls) == 3, 5, message="all probes handled")
    assert rx.metrics.counter("handler_errors") == 1
    assert rx.metrics.counter("rejected.unknown_route") == 1
    assert rx.metrics.counter("rejected.malformed") == 3


def test_oversize_messages_are_refused_before_sending_and_tensors_fit_the_broker(tmp_path: Path, make_bus) -> None:
    small = start_broker("mosquitto", max_packet_bytes=100_000, workdir=tmp_path / "small")
    try:
        tx = make_bus("tx", hub_url=small.url)
        assert tx.hub.protocol == "5" and tx.hub.max_packet_bytes == 100_000
        with pytest.raises(PayloadTooLargeError, match="maximum packet size of 100000"):
            tx.publish(topics.request("x", "svc"), m.BenchEcho(payload=bytes(200_000)))
        assert tx.hub.connected, "nothing was sent, so the broker did not disconnect us"
        rx = make_bus("rx", "sink", hub_url=small.url)
        got, done = open_sink(rx, "rx", "sink", 1)
        announce(rx)
        value = np.arange(300_000, dtype=np.float32)  # 1.2 MB: needs chunks under 100 kB
        tx.send_tensor("rx", "sink", m.BenchData(run_id="s", seq=0), value)
        assert done.wait(20)
        assert np.array_equal(got[0].tensor.array, value)
    finally:
        small.stop()


def test_reconnects_and_resubscribes_after_a_broker_restart(tmp_path: Path, make_bus) -> None:
    hub = start_broker("mosquitto", workdir=tmp_path / "b1")
    port = hub.port
    try:
        server = make_bus("srv", hub_url=hub.url)
        server.subscribe(topics.request("srv", "svc"), lambda msg: server.reply(msg, m.BenchEchoReply(payload=b"ok")),
                         schemas=(m.BenchEcho,))
        client = make_bus("cli", hub_url=hub.url)
        assert client.request(topics.request("srv", "svc"), m.BenchEcho(payload=b""), timeout_s=5)
        hub.stop()
        wait_until(lambda: not server.hub.connected and not client.hub.connected, 10, message="disconnect")
        hub = start_broker("mosquitto", port=port, workdir=tmp_path / "b2")
        wait_until(lambda: server.hub.connected and client.hub.connected, 20, message="reconnect")
        time.sleep(0.3)  # resubscription happens right after CONNACK
        reply = client.request(topics.request("srv", "svc"), m.BenchEcho(payload=b""), timeout_s=5)
        assert reply.body.payload == b"ok"
        assert server.hub.connects == 2 and client.hub.connects == 2
    finally:
        hub.stop()


def test_publishing_into_a_dead_broker_applies_backpressure_then_times_out(tmp_path: Path, make_bus) -> None:
    hub = start_broker("mosquitto", workdir=tmp_path / "b")
    try:
        tx = make_bus("tx", hub_url=hub.url, outbound_window_messages=4)
    finally:
        hub.stop()
    wait_until(lambda: not tx.hub.connected, 10, message="disconnect")
    for _ in range(4):  # QoS 1 messages queue up for the reconnect, up to the window
        tx.publish("edgeswarm/test", m.Probe(), timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(PublishTimeoutError, match="in flight"):
        tx.publish("edgeswarm/test", m.Probe(), timeout_s=0.5)
    assert 0.4 < time.monotonic() - start < 3


def test_a_slow_handler_makes_the_inbox_drop_qos0_instead_of_growing(make_bus) -> None:
    rx = make_bus("rx", workers=1, inbox_capacity=16)
    release = threading.Event()
    handled: list[int] = []
    rx.subscribe("edgeswarm/flood", lambda msg: (release.wait(5), handled.append(1)), schemas=(m.Probe,), qos=0)
    tx = make_bus("tx")
    for _ in range(300):
        tx.publish("edgeswarm/flood", m.Probe(), qos=0)
    wait_until(lambda: rx.metrics.counter("inbox_dropped") > 0, 10, message="drops")
    assert rx.inbox_depth <= 32
    release.set()
    wait_until(lambda: rx.inbox_depth == 0, 10, message="drain")
    assert 0 < len(handled) < 300


def test_tensors_go_to_the_receivers_data_broker_not_the_hub(tmp_path: Path, make_bus, broker: BrokerProcess) -> None:
    node_broker = start_broker("mosquitto", workdir=tmp_path / "node")
    try:
        rx = make_bus("rx", "sink", data_url=node_broker.url)
        assert rx.data is not rx.hub and rx.data.url == node_broker.url
        got, done = open_sink(rx, "rx", "sink", 1)
        announce(rx, data_url=node_broker.url)
        spy = make_bus("spy")
        on_hub = collect(spy, "edgeswarm/node/+/+/data")
        tx = make_bus("tx")
        value = np.arange(3 * MIB // 4, dtype=np.float32)
        tx.send_tensor("rx", "sink", m.BenchData(run_id="dp", seq=0), value)
        assert done.wait(20)
        assert np.array_equal(got[0].tensor.array, value)
        assert node_broker.url in tx._pool, "the sender opened a pooled connection to the node's broker"
        time.sleep(0.3)
        assert on_hub == [], "no tensor byte crossed the hub broker"
    finally:
        node_broker.stop()


def test_a_node_reaches_its_broker_by_one_address_and_advertises_another(tmp_path: Path, make_bus,
                                                                        broker: BrokerProcess) -> None:
    # In a compose stack the node's services reach their broker as `broker`, while peers need its LAN address; here
    # 127.0.0.1 and localhost stand for the two names of one broker.
    node_broker = start_broker("mosquitto", workdir=tmp_path / "node")
    try:
        outside = node_broker.url.replace("127.0.0.1", "localhost")
        rx = make_bus("rx", "sink", data_url=outside, data_connect_url=node_broker.url)
        assert rx.data is not rx.hub and rx.data.url == node_broker.url
        got, done = open_sink(rx, "rx", "sink", 2)
        announce(rx, data_url=outside)
        value = np.arange(1000, dtype=np.float32)
        peer = make_bus("tx")  # another node dials the advertised address
        peer.send_tensor("rx", "sink", m.BenchData(run_id="peer", seq=0), value)
        assert outside in peer._pool
        neighbour = make_bus("rx", "other", data_url=outside, data_connect_url=node_broker.url)
        assert neighbour.connection_for(outside) is neighbour.data, "a service of the same node uses its own connection"
        neighbour.send_tensor("rx", "sink", m.BenchData(run_id="neighbour", seq=0), value)
        assert done.wait(20)
        assert sorted(msg.body.run_id for msg in got) == ["neighbour", "peer"]
        assert all(np.array_equal(msg.tensor.array, value) for msg in got)
        # A one-chunk tensor views the packet paho read, which nothing else holds: torch gets it without a copy.
        assert all(msg.tensor.array.flags.writeable for msg in got)
        as_torch = got[0].tensor.to_torch()
        assert as_torch.data_ptr() == got[0].tensor.array.__array_interface__["data"][0]
    finally:
        node_broker.stop()


def test_sending_to_an_unknown_node_fails_clearly(make_bus) -> None:
    tx = make_bus("tx", request_timeout_s=0.5)
    with pytest.raises(UnknownNodeError, match="ghost"):
        tx.send_tensor("ghost", "sink", m.BenchData(run_id="x", seq=0), np.zeros(3, dtype=np.float32))


def test_a_shaped_link_carries_every_byte_at_no_more_than_its_rate(make_bus) -> None:
    # The pacing itself is tested with a fake clock (test_shaping.py); here: every frame of a transfer goes
    # through the sender's emulated link, which cannot have let it out faster than its rate (a sleep is never
    # shorter than asked, so this lower bound holds however loaded the machine is).
    rate = 100e6 / 8
    rx = make_bus("rx", "sink")
    got, done = open_sink(rx, "rx", "sink", 1)
    announce(rx)
    shaped = make_bus("slow", links={"rx": LinkSpec(bandwidth_bps=rate, latency_s=0.002)})
    value = np.random.default_rng(1).integers(0, 255, 2 * MIB, dtype=np.uint8)
    start = time.monotonic()
    sent = shaped.send_tensor("rx", "sink", m.BenchData(run_id="link", seq=0), value)
    wait_until(lambda: got, 30, interval_s=0.002, message="tensor")
    assert time.monotonic() - start >= (sent - LINK_BURST_BYTES) / rate
    assert shaped._links["rx"].bytes_sent == sent  # noqa: SLF001 - the link the bus keeps for rx
    assert np.array_equal(got[0].tensor.array, value)
    # Two chunks of 1 MiB: the receiver says how the second came after the first (what a link is fitted from).
    arrival = got[0].tensor.arrival
    assert arrival is not None and (arrival.nbytes, arrival.chunks) == (MIB, 1) and arrival.seconds > 0


def test_envelope_fields_are_mirrored_into_mqtt5_properties(broker: BrokerProcess, make_bus) -> None:
    seen: list[paho.MQTTMessage] = []
    spy = paho.Client(CallbackAPIVersion.VERSION2, client_id="spy", protocol=paho.MQTTv5)
    spy.on_message = lambda c, u, msg: seen.append(msg)
    spy.connect(broker.host, broker.port)
    spy.loop_start()
    try:
        spy.subscribe("edgeswarm/node/srv/svc/request/cli", qos=1)
        time.sleep(0.3)
        client = make_bus("cli")
        with pytest.raises(RequestTimeoutError):
            client.request(topics.request("srv", "svc"), m.Probe(), timeout_s=1.2)
        wait_until(lambda: seen, 5, message="the spy's copy")
        props = seen[0].properties
        assert props.ResponseTopic == client.reply_topic
        assert len(props.CorrelationData) == 32
        assert props.MessageExpiryInterval in (1, 2)
    finally:
        spy.loop_stop()
        spy.disconnect()


def test_falls_back_to_mqtt_311_on_amqtt(tmp_path: Path, make_bus) -> None:
    amqtt = start_broker("amqtt", workdir=tmp_path / "amqtt")
    try:
        server = make_bus("srv", hub_url=amqtt.url)
        assert server.hub.protocol == "3.1.1"
        server.subscribe(topics.request("srv", "svc"), lambda msg: server.reply(msg, m.BenchEchoReply(payload=b"v3")),
                         schemas=(m.BenchEcho,))
        client = make_bus("cli", hub_url=amqtt.url)
        reply = client.request(topics.request("srv", "svc"), m.BenchEcho(payload=b""), timeout_s=5)
        assert reply.body.payload == b"v3" and reply.envelope.correlation_id
    finally:
        amqtt.stop()

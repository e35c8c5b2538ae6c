"""No acknowledged QoS 1 message is lost or reordered, whatever the broker sends and however slow the receiver.

Mosquitto 2.0 sends past the window a client asks for (ReceiveMaximum) after its first acknowledgement, and lets later
messages overtake those it queued past a window, so neither the broker's window nor its order can be relied on: the
bus's inbox holds the network thread when full (TCP backpressure) and, past the hold bound, hands the connection back
so the broker sends again what was left unacknowledged on the kept session (edgeswarm.bus.inbox). The senders here are
bare paho, as fast as they go; the brokers are the launcher's (edgeswarm.local.broker.QUEUE_OPTIONS).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

import edgeswarm.messages as m
from conftest import bus_settings
from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.messages import RequestRejected
from edgeswarm.wire import Sender, encode
from helpers import announce, wait_until

TOPICS = ("edgeswarm/test/flood/a", "edgeswarm/test/flood/b")
PADDING = "x" * 900  # with the envelope, about 1 KB a message


def frames(count: int) -> Iterator[tuple[str, str, bytes]]:
    """(topic, msg_id, payload) for ``count`` numbered messages, alternating between the two topics."""
    sender = Sender(node="tx", service="flood", instance="flood0")
    body = RequestRejected(reason="flood", detail=PADDING)
    for i in range(count):
        msg_id = f"{i:032x}"
        yield TOPICS[i % 2], msg_id, encode(sender.envelope(body, msg_id=msg_id), body)


class RawSender:
    """Bare paho publishing pre-encoded frames at QoS 1 as fast as the broker acknowledges them (1000 in flight)."""

    def __init__(self, broker: BrokerProcess) -> None:
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="flood-sender", protocol=paho.MQTTv5)
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def send(self, batch: list[tuple[str, str, bytes]]) -> None:
        infos = [self.client.publish(topic, payload, qos=1) for topic, _msg_id, payload in batch]
        for info in infos:
            info.wait_for_publish(60)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def assert_each_handled_once_in_order(handled: list[tuple[str, str]], sent: list[tuple[str, str, bytes]]) -> None:
    for topic in TOPICS:
        expected = [msg_id for t, msg_id, _ in sent if t == topic]
        got = [msg_id for t, msg_id in handled if t == topic]
        assert len(got) == len(set(got)), f"{len(got) - len(set(got))} handled twice on {topic}"
        missing = set(expected) - set(got)
        assert not missing, f"{len(missing)} of {len(expected)} never handled on {topic}"
        assert got == expected, f"out of order on {topic}"


def test_a_slow_receiver_handles_every_qos1_message_of_a_fast_sender_once_in_order(make_bus, broker) -> None:
    """20,000 messages on two topics into shards of 16 (the bus decodes and checks each, bare paho only sends); one
    handler stalls twice the hold bound once, so its connection is handed back mid-stream and the broker sends the
    rest again."""
    rx = make_bus("rx", "sink", workers=2, inbox_capacity=32, keepalive_s=2)  # hold bound 1 s
    handled: list[tuple[str, str]] = []
    lock = threading.Lock()

    def handle(msg: Inbound) -> None:
        if len(handled) == 3000:
            time.sleep(2.0)
        with lock:
            handled.append((msg.topic, msg.envelope.msg_id))

    rx.subscribe("edgeswarm/test/flood/+", handle, schemas=(RequestRejected,))
    sent = list(frames(20_000))
    sender = RawSender(broker)
    try:
        sender.send(sent)
        wait_until(lambda: len(handled) >= len(sent), 120, interval_s=0.2, message="every message handled")
        time.sleep(0.5)  # a duplicate would come now
    finally:
        sender.close()
    assert_each_handled_once_in_order(handled, sent)
    assert rx.metrics.counter("inbox_dropped") == 0
    assert rx.metrics.counter("inbox_held") > 0, "the shards were full: the network thread waited"
    assert rx.metrics.counter("inbox_redelivered") >= 1, "the stall outlasted the hold: the broker sent again"
    assert rx.hub.connects >= 2


def test_messages_handled_while_others_wait_are_acknowledged_together_and_none_before_its_handler(
        make_bus, broker, monkeypatch) -> None:
    """One worker stalls on the first of 50 messages while the rest queue behind it: each message is acknowledged to
    the broker only after its handler ran, those handled while more waited in batches of up to ACK_BATCH (one write
    each), and the last one as soon as the shard is empty."""
    from edgeswarm.bus import inbox, mqtt

    batches: list[list[int]] = []
    handled: list[str] = []
    early: list[int] = []  # acknowledgements counted before as many messages were handled
    ack_all = mqtt._Client.ack_all

    def recorded(client: mqtt._Client, mids: list[int]) -> None:
        batches.append(list(mids))
        if sum(len(b) for b in batches) > len(handled):
            early.extend(mids)
        ack_all(client, mids)

    monkeypatch.setattr(mqtt._Client, "ack_all", recorded)
    rx = make_bus("rx", "sink", workers=1, inbox_capacity=64)
    release = threading.Event()

    def handle(msg: Inbound) -> None:
        if not handled:
            release.wait(30)
        handled.append(msg.envelope.msg_id)

    rx.subscribe(TOPICS[0], handle, schemas=(RequestRejected,))
    sent = list(frames(50))
    sender = RawSender(broker)
    try:
        sender.send([(TOPICS[0], msg_id, payload) for _topic, msg_id, payload in sent])
        wait_until(lambda: rx._inbox.depth >= len(sent) - 1, 30, message="49 messages queued behind the first")
        assert batches == [], "nothing is acknowledged while its handler has not run"
        release.set()
        wait_until(lambda: sum(len(b) for b in batches) >= len(sent), 30, message="every message acknowledged")
    finally:
        release.set()
        sender.close()
    assert handled == [msg_id for _topic, msg_id, _payload in sent]
    assert not early, f"{len(early)} acknowledged before their handler ran"
    assert sum(len(b) for b in batches) == len(sent)
    assert max(len(b) for b in batches) == inbox.ACK_BATCH, batches


def test_a_receiver_paused_longer_than_the_hold_bound_loses_nothing(broker, tmp_path: Path) -> None:
    """SIGSTOP (`chaos pause`) for 5 s, beyond the hold bound (1 s) and the broker's keepalive (3 s): the broker drops
    the connection, keeps the session, and the resumed receiver gets every message, once and in order."""
    out = tmp_path / "handled.txt"
    sent = list(frames(12_000))
    receiver = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("qos1_receiver.py")), broker.url, "edgeswarm/test/flood/+",
         str(len(sent)), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    sender = None
    try:
        assert receiver.stdout is not None
        assert receiver.stdout.readline().strip() == b"ready"
        sender = RawSender(broker)
        sender.send(sent[:4000])
        wait_until(lambda: out.exists() and out.stat().st_size > 0, 30, message="the receiver handling")
        os.kill(receiver.pid, signal.SIGSTOP)
        try:
            sender.send(sent[4000:])  # the broker keeps these for the paused receiver's session
            time.sleep(5.0)
        finally:
            os.kill(receiver.pid, signal.SIGCONT)
        receiver.wait(90)
        log = receiver.stdout.read().decode(errors="replace")
        assert receiver.returncode == 0, log
    finally:
        if sender is not None:
            sender.close()
        if receiver.poll() is None:
            os.kill(receiver.pid, signal.SIGCONT)
            receiver.kill()
            receiver.wait(10)
    handled = [tuple(line.split()) for line in out.read_text().splitlines()]
    assert_each_handled_once_in_order(handled, sent)  # type: ignore[arg-type]
    assert "'inbox_dropped'" not in log


def test_what_a_bus_sent_just_before_it_stopped_still_arrives(make_bus, broker) -> None:
    """``Bus.stop`` at once after ``send_tensor`` and ``publish``. paho's loop_stop does not wait for queued packets
    to be written, so without a drain the tail of a 64 MiB tensor, and a message behind it, never left the client: a
    command that sends and exits lost what it sent (in CI, a contract test's stranger tensor was never seen)."""
    rx = make_bus("rx", "sink")
    got: list[str] = []
    rx.subscribe(topics.data("rx", "sink"), lambda msg: got.append(f"tensor {msg.tensor.array.size}"),
                 schemas=(m.BenchData,), plane="data")
    rx.subscribe("edgeswarm/test/last", lambda msg: got.append("last"), schemas=(RequestRejected,))
    announce(rx)
    value = np.arange(16 * 1024 * 1024, dtype=np.float32)  # 64 chunks of 1 MiB
    for attempt in range(3):
        tx = Bus(bus_settings(broker.url), Sender(node="tx", service="once", instance=f"once{attempt}"))
        tx.start(timeout_s=10)
        try:
            tx.send_tensor("rx", "sink", m.BenchData(run_id="last", seq=attempt), value)
            tx.publish("edgeswarm/test/last", RequestRejected(reason="last", detail="after the tensor"), qos=1)
        finally:
            tx.stop()
        expected = 2 * (attempt + 1)
        wait_until(lambda: len(got) >= expected, 30,  # noqa: B023 - used before the loop goes on
                   message=f"the tensor and the message sent just before stop (attempt {attempt}); got {got}")
        assert sorted(got[-2:]) == ["last", f"tensor {value.size}"]  # two topics: either may be handled first
    assert len(got) == 6

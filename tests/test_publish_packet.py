"""The bus's own reading of received PUBLISH packets (``bus.mqtt.split_publish``), against paho's decoder."""

from __future__ import annotations

import random
import struct

import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgeswarm.bus.mqtt import PublishOptions, publish_properties, split_publish


def _packet_of(topic: bytes, mid: int, qos: int, props: bytes, payload: bytes) -> bytearray:
    """A PUBLISH packet after its fixed header, as paho hands it over (a bytearray it read from the socket)."""
    out = bytearray(struct.pack("!H", len(topic)) + topic)
    if qos:
        out += struct.pack("!H", mid)
    return out + props + payload


def _properties(rng: random.Random) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return b"\x00"
    if choice == 1:
        return publish_properties(PublishOptions(expires_in_s=rng.uniform(0.1, 100), reply_to="edgeswarm/reply/x/y",
                                                 correlation_id="c" * rng.randrange(1, 40)))
    if choice == 2:  # a user property long enough that its length needs two varint bytes
        return publish_properties(PublishOptions(envelope="e" * rng.randrange(130, 400)))
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("k" * rng.randrange(1, 9), "v" * rng.randrange(0, 300))]
    return props.pack()


def test_split_publish_reads_what_pahos_decoder_reads() -> None:
    rng = random.Random(31)
    for _ in range(500):
        qos = rng.randrange(2)
        topic = "/".join(rng.choice(["edgeswarm", "node", "nano-1", "data", "ü"]) for _ in range(rng.randrange(1, 7)))
        mid = rng.randrange(1, 65536) if qos else 0
        payload = rng.randbytes(rng.choice([0, 1, 7, 1024, 70000]))
        packet = _packet_of(topic.encode(), mid, qos, _properties(rng), payload)
        header = 0x30 | (qos << 1)
        reference = _packet.decode_publish(header, bytes(packet), MQTTProtocolVersion.MQTTv5)
        got_topic, got_mid, got_payload = split_publish(packet, qos)
        assert (got_topic, got_mid, bytes(got_payload)) == (reference.topic, reference.mid, reference.payload)
        assert got_payload.obj is packet, "the payload views the received packet: no copy"


@pytest.mark.parametrize("packet, qos, why", [
    (b"", 0, "shorter than its topic length"),
    (b"\x00", 0, "shorter than its topic length"),
    (b"\x00\x00\x00", 0, "empty topic"),
    (b"\x00\x03ab", 0, "cut short before its properties"),
    (b"\x00\x01a\x00", 1, "cut short before its properties"),
    (b"\x00\x01a\x05\x01", 0, "run past its end"),
    (b"\x00\x01a\xff\xff\xff\xff\x01", 0, "longer than four bytes"),
])
def test_split_publish_refuses_a_packet_shorter_than_it_says(packet: bytes, qos: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        split_publish(bytearray(packet), qos)

"""Thousands of corrupted payloads against a running service: it rejects each, counts it and stays up."""

from __future__ import annotations

import random
import zlib

import msgpack
import numpy as np

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.wire import Sender, encode, tensor_frames
from edgeswarm.wire.codec import PREFIX
from helpers import wait_until

NODE, SERVICE = "fuzzed", "node-agent"


def corrupted_payloads(rng: random.Random, count: int) -> list[bytes]:
    """Random bytes, bit flips, truncations and lying headers, derived from valid frames."""
    sender = Sender(node="fuzzer", service="cli", instance="fz1")
    data = m.BenchData(run_id="never-opened", seq=0)
    valid = [
        encode(sender.envelope(m.Probe()), m.Probe()),
        encode(sender.envelope(m.BenchEcho(payload=b"x" * 64)), m.BenchEcho(payload=b"x" * 64)),
        *tensor_frames(sender.envelope(data), data, np.arange(256, dtype=np.float32), 300),
    ]
    out = []
    for i in range(count):
        base = bytearray(rng.choice(valid))
        kind = i % 8
        if kind == 0:
            out.append(rng.randbytes(rng.randint(1, 400)))
        elif kind == 1:
            for _ in range(rng.randint(1, 8)):
                base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
            out.append(bytes(base))
        elif kind == 2:
            out.append(bytes(base[: rng.randrange(1, len(base))]))
        elif kind == 3:  # a header length that lies
            base[4:8] = rng.randrange(2**32).to_bytes(4, "little")
            out.append(bytes(base))
        elif kind == 4:  # a tensor descriptor that lies about its size
            header = {"env": sender.envelope(data).model_dump(), "body": data.model_dump(),
                      "tensor": {"dtype": rng.choice(["float32", "float64", "int8", "bool"]),
                                 "shape": [rng.randrange(1, 1 << 30), rng.randrange(1, 1 << 30)],
                                 "nbytes": rng.randrange(1 << 40), "chunk_size": 1 << 20, "chunk": 0,
                                 "n_chunks": rng.randrange(1, 1 << 20), "crc32": zlib.crc32(b"")}}
            packed = msgpack.packb(header)
            out.append(PREFIX.pack(b"ES", 1, 0, len(packed)) + packed + rng.randbytes(64))
        elif kind == 5:  # a schema version nobody speaks
            header = {"env": {**sender.envelope(m.Probe()).model_dump(), "schema_version": rng.randrange(2, 99)},
                      "body": {}, "tensor": None}
            packed = msgpack.packb(header)
            out.append(PREFIX.pack(b"ES", 1, 0, len(packed)) + packed)
        elif kind == 6:  # valid msgpack of the wrong shape
            packed = msgpack.packb(rng.choice([[1, 2, 3], {"env": 1}, {"env": {}, "body": []}, "text", None]))
            out.append(PREFIX.pack(b"ES", 1, 0, len(packed)) + packed)
        else:  # a valid tensor for a bench run that was never opened (an unknown job)
            out.append(next(tensor_frames(sender.envelope(data), data, np.arange(16, dtype=np.float32), 1 << 20)))
    return out


def test_a_service_survives_thousands_of_corrupted_payloads(broker: BrokerProcess, services, make_bus) -> None:
    proc = services.start(SERVICE, NODE, broker.url)
    client = make_bus("fuzz-client", "cli")
    wait_until(lambda: _healthy(client), 20, message="service up")
    attacker = make_bus("fuzzer", "cli")
    payloads = corrupted_payloads(random.Random(1234), 3000)
    for i, payload in enumerate(payloads):
        address = topics.request(NODE, SERVICE) if (i // 8) % 2 else topics.data(NODE, SERVICE)
        attacker.hub.publish(topics.from_sender(address, "fuzzer"), payload, qos=1)

    def rejected() -> int:
        reply = client.request(topics.request(NODE, SERVICE), m.Probe(), timeout_s=5)
        return reply.body.rejected

    wait_until(lambda: rejected() >= 2000, 60, interval_s=0.5, message="most payloads rejected and counted")
    assert proc.poll() is None, "the service is still running"
    assert _healthy(client)
    # It still does real work afterwards: a bench run and an echo.
    done = client.expect()
    client.request(topics.request(NODE, SERVICE), m.BenchStart(run_id="after", count=1,
                                                               done_correlation_id=done.correlation_id))
    value = np.arange(1000, dtype=np.float32)
    client.send_tensor(NODE, SERVICE, m.BenchData(run_id="after", seq=0), value)
    ack = done.wait(10)
    assert ack is not None and ack.body.received == 1 and ack.body.bytes == value.nbytes
    metrics = []
    client.subscribe(topics.metrics(NODE, SERVICE), metrics.append, schemas=(m.MetricsReport,))
    wait_until(lambda: metrics, 10, message="a metrics report")
    counters = metrics[-1].body.counters
    reasons = {k for k in counters if k.startswith("rejected.")}
    assert {"rejected.malformed", "rejected.unsupported_version", "rejected.unknown_route"} <= reasons
    assert reasons & {"rejected.bad_tensor_header", "rejected.unsupported_dtype", "rejected.tensor_too_large"}


def _healthy(client) -> bool:
    try:
        return bool(client.request(topics.request(NODE, SERVICE), m.Probe(), timeout_s=1).body.healthy)
    except Exception:
        return False

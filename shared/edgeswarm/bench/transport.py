"""``edgeswarm bench transport``: the data path measured against raw TCP in the same run.

For each payload size it streams tensors through the MQTT data plane (chunked, QoS 1) to a node
agent's sink and the same bytes through a raw TCP socket to a sink process, and reports MB/s and the
MQTT/TCP ratio. It also measures the QoS 1 round trip of a 1 KB request/reply and the codec's
encode, decode (zero-copy) and reassembly speeds. Timings on a shared 2-core machine are noisy:
compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np
from pydantic import BaseModel

from edgeswarm import topics
from edgeswarm.bench.tcp_sink import LENGTH, RUN_HEADER
from edgeswarm.bus import Bus
from edgeswarm.errors import EdgeswarmError, RequestTimeoutError
from edgeswarm.messages import BenchAck, BenchData, BenchEcho, BenchEchoReply, BenchStart
from edgeswarm.wire import Reassembler, Sender, decode, tensor_frames

KB = 1024
MB = 1024 * 1024
# Payload size -> how many to send: enough volume per size for a stable figure in a few seconds.
DEFAULT_PLAN: dict[int, int] = {KB: 2000, 64 * KB: 400, MB: 100, 16 * MB: 16, 64 * MB: 6}


class ThroughputRow(BaseModel):
    """One payload size: MB/s (10^6 bytes per second) through MQTT and through raw TCP."""

    size_bytes: int
    count: int
    mqtt_mb_s: float
    tcp_mb_s: float

    @property
    def ratio(self) -> float:
        return self.mqtt_mb_s / self.tcp_mb_s if self.tcp_mb_s else 0.0


class CodecFigures(BaseModel):
    """Codec speeds on one tensor, GB/s (10^9 bytes per second)."""

    tensor_bytes: int
    chunk_bytes: int
    encode_gb_s: float
    decode_gb_s: float
    decode_zero_copy: bool
    reassemble_gb_s: float


class TransportReport(BaseModel):
    """Everything ``edgeswarm bench transport`` measured in one run."""

    broker_url: str
    broker_protocol: str
    target: str
    chunk_bytes: int
    rows: list[ThroughputRow]
    rtt_1kb_qos1_median_ms: float
    rtt_1kb_qos1_p90_ms: float
    rtt_samples: int
    codec: CodecFigures


def run_transport_bench(bus: Bus, node: str, *, plan: dict[int, int] | None = None, rtt_samples: int = 1000,
                        progress: Callable[[str], None] = lambda _msg: None) -> TransportReport:
    """Measure the transport against ``node``'s node-agent over ``bus``. Raises EdgeswarmError."""
    plan = plan or DEFAULT_PLAN
    progress(f"QoS 1 round trips of 1 KB x {rtt_samples}")
    rtts = _round_trips(bus, node, rtt_samples)
    rows = []
    sink = _TcpSink()
    try:
        for size, count in plan.items():
            # An untimed warm-up run per size first: the first transfer of a size pays for page faults
            # and buffer growth in every process on the path (3x slower for 64 MB here).
            warmup = max(1, count // 4)
            progress(f"{_human(size)} x {count} through MQTT")
            _mqtt_stream(bus, node, size, warmup)
            mqtt = _mqtt_stream(bus, node, size, count)
            progress(f"{_human(size)} x {count} through raw TCP")
            sink.stream(size, warmup)
            tcp = sink.stream(size, count)
            rows.append(ThroughputRow(size_bytes=size, count=count, mqtt_mb_s=mqtt, tcp_mb_s=tcp))
    finally:
        sink.close()
    progress("codec on a 64 MiB float32 tensor")
    codec = codec_figures(chunk_bytes=bus.settings.chunk_bytes)
    return TransportReport(
        broker_url=bus.hub.url, broker_protocol=bus.hub.protocol, target=f"{node}/node-agent",
        chunk_bytes=bus.settings.chunk_bytes, rows=rows,
        rtt_1kb_qos1_median_ms=statistics.median(rtts) * 1e3,
        rtt_1kb_qos1_p90_ms=statistics.quantiles(rtts, n=10)[-1] * 1e3, rtt_samples=len(rtts), codec=codec)


def _mqtt_stream(bus: Bus, node: str, size: int, count: int) -> float:
    payload = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    run_id = uuid.uuid4().hex
    done = bus.expect()
    bus.request(topics.request(node, "node-agent"),
                BenchStart(run_id=run_id, count=count, done_correlation_id=done.correlation_id))
    start = time.perf_counter()
    for seq in range(count):
        bus.send_tensor(node, "node-agent", BenchData(run_id=run_id, seq=seq), payload)
    reply = done.wait(timeout_s=60 + size * count / 10e6)
    elapsed = time.perf_counter() - start
    if reply is None or not isinstance(reply.body, BenchAck) or reply.body.received != count:
        raise RequestTimeoutError(f"the sink on {node} did not confirm {count} x {size} bytes")
    return size * count / elapsed / 1e6


def _round_trips(bus: Bus, node: str, samples: int) -> list[float]:
    topic = topics.request(node, "node-agent")
    echo = BenchEcho(payload=bytes(KB))
    for _ in range(100):
        bus.request(topic, echo)
    rtts = []
    for _ in range(samples):
        start = time.perf_counter()
        reply = bus.request(topic, echo)
        rtts.append(time.perf_counter() - start)
        if not isinstance(reply.body, BenchEchoReply) or len(reply.body.payload) != KB:
            raise EdgeswarmError("the echo came back wrong")
    return rtts


def codec_figures(tensor_bytes: int = 64 * MB, chunk_bytes: int = MB, repeats: int = 3) -> CodecFigures:
    """Encode (tensor -> chunk frames), zero-copy decode of one whole frame, and reassembly from chunks."""
    value = np.random.default_rng(0).standard_normal(tensor_bytes // 4, dtype=np.float32)
    sender = Sender(node="bench", service="codec", instance="bench")
    body = BenchData(run_id="codec", seq=0)
    encode_s, decode_s, reassemble_s = [], [], []
    zero_copy = True
    for _ in range(repeats):
        t0 = time.perf_counter()
        frames = list(tensor_frames(sender.envelope(body), body, value, chunk_bytes))
        encode_s.append(time.perf_counter() - t0)
        whole = next(tensor_frames(sender.envelope(body), body, value, tensor_bytes))
        t0 = time.perf_counter()
        arr = decode(whole).whole_tensor().array
        decode_s.append(time.perf_counter() - t0)
        zero_copy = zero_copy and np.shares_memory(arr, np.frombuffer(whole, dtype=np.uint8))
        reasm = Reassembler(max_pending_bytes=2 * tensor_bytes, timeout_s=60)
        t0 = time.perf_counter()
        out = None
        for frame in frames:
            out = reasm.add(decode(frame)) or out
        reassemble_s.append(time.perf_counter() - t0)
        if out is None or not np.array_equal(out.array, value):
            raise EdgeswarmError("codec round trip failed")
    return CodecFigures(tensor_bytes=tensor_bytes, chunk_bytes=chunk_bytes,
                        encode_gb_s=tensor_bytes / min(encode_s) / 1e9, decode_gb_s=tensor_bytes / min(decode_s) / 1e9,
                        decode_zero_copy=zero_copy, reassemble_gb_s=tensor_bytes / min(reassemble_s) / 1e9)


class _TcpSink:
    """The raw-TCP baseline: a sink process on loopback and a sender in this process."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "edgeswarm.bench.tcp_sink"], stdout=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL)
        assert self._proc.stdout is not None
        self._port = int(self._proc.stdout.readline())

    def stream(self, size: int, count: int) -> float:
        payload = memoryview(np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8))
        with socket.create_connection(("127.0.0.1", self._port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.perf_counter()
            conn.sendall(RUN_HEADER.pack(count, size))
            prefix = LENGTH.pack(size)
            # Small messages go out as one write, as the MQTT client does; large ones without a copy.
            parts = [prefix + payload.tobytes()] if size < MB else [prefix, payload]
            for _ in range(count):
                for part in parts:
                    conn.sendall(part)
            if conn.recv(1) != b"\x01":
                raise EdgeswarmError("the TCP sink did not confirm the run")
            return size * count / (time.perf_counter() - start) / 1e6

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(5)


def _human(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"

"""``edgeswarm watch``: a live service's traffic decoded over a real Mosquitto, tensors shown once with their shape,
undecodable payloads shown and survived; and the Observer it decodes with, message by message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.wire import Sender, encode, tensor_frames
from edgeswarm.wire.observe import Observer
from helpers import FAST_ENV, announce, wait_until

# PYTHONFAULTHANDLER: a watch that hangs prints every thread's stack when it is sent SIGABRT.
ENV = {**os.environ, **FAST_ENV, "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"}


def watch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeswarm", "watch", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def live_node(broker: BrokerProcess, services) -> str:  # type: ignore[no-untyped-def]
    """A node-agent running as node dev-0 on the test broker, its status already retained."""
    services.start("node-agent", "dev-0", broker.url)
    # Its retained status is what a watch started now sees first.
    wait_until(lambda: '"online"' in watch(f"{topics.ROOT}/node/dev-0/node-agent/status", "--hub", broker.url,
                                           "--json", "--count", "1", "--timeout", "5").stdout,
               60, interval_s=0.5, message="dev-0's node-agent online")
    return "dev-0"


def test_watch_json_prints_a_live_services_status_and_heartbeats_decoded(broker: BrokerProcess, live_node: str) -> None:
    result = watch(f"{topics.ROOT}/node/{live_node}/#", "--hub", broker.url, "--json", "--count", "4",
                   "--timeout", "30")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 4
    status = next(x for x in lines if x["schema"] == "edgeswarm.status")
    assert status["topic"] == f"{topics.ROOT}/node/{live_node}/node-agent/status" and status["retained"] is True
    assert status["fields"]["state"] == "online" and status["fields"]["node"] == live_node
    assert status["fields"]["service"] == "node-agent"
    assert status["fields"]["heartbeat_interval_s"] == float(FAST_ENV["EDGESWARM_HEARTBEAT_INTERVAL_S"])
    assert status["sender"] == f"{live_node}/node-agent" and status["error"] is None
    beats = [x for x in lines if x["schema"] == "edgeswarm.heartbeat"]
    assert len(beats) >= 2, lines
    seqs = [b["fields"]["seq"] for b in beats]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # in order, each once
    assert all(b["time"] > 0 and b["sent_at"] > 0 and b["tensor"] is None for b in beats)


def test_watch_readable_shows_schema_sender_and_fields(broker: BrokerProcess, live_node: str) -> None:
    result = watch(f"{topics.ROOT}/node/+/+/heartbeat", "--hub", broker.url, "--count", "2", "--timeout", "30")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert f"{topics.ROOT}/node/{live_node}/node-agent/heartbeat  edgeswarm.heartbeat v1  from " \
               f"{live_node}/node-agent" in line and "seq=" in line and f'node="{live_node}"' in line


class _Watching:
    """``edgeswarm watch --json`` in the background, its lines collected as they come."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "edgeswarm", "watch", "--hub", url, "--json"], env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict] = []  # type: ignore[type-arg]
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def stop(self) -> tuple[int, str]:
        """Ctrl-C it; its exit status and stderr. One that does not stop fails the test with every thread's stack
        (faulthandler, on SIGABRT), so a hang says where it hangs."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(5)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
            assert self.proc.stderr is not None
            raise AssertionError("edgeswarm watch did not stop within 15 s of Ctrl-C; its threads:\n"
                                 + self.proc.stderr.read()[-8000:]) from None
        self._reader.join(5)
        assert self.proc.stderr is not None
        return self.proc.returncode, self.proc.stderr.read()


def test_watch_shows_a_chunked_tensor_once_with_its_shape_and_survives_garbage(broker: BrokerProcess,
                                                                               make_bus) -> None:  # type: ignore[no-untyped-def]
    receiver = make_bus("rx", "stage-worker")
    announce(receiver)
    sender = make_bus("tx", "stage-worker", chunk_bytes=16 * 1024)
    watching = _Watching(broker.url)
    try:
        # Ready once it has shown the receiver's retained status.
        wait_until(lambda: any(x["schema"] == "edgeswarm.status" for x in watching.lines), 30,
                   message="the watch showing the retained status")
        pub = shutil.which("mosquitto_pub")
        assert pub, "mosquitto_pub is missing (apt-get install -y mosquitto-clients)"
        subprocess.run([pub, "-h", "127.0.0.1", "-p", str(broker.port), "-t", f"{topics.ROOT}/junk", "-m", "hello"],
                       check=True, timeout=10)
        value = np.arange(100 * 100, dtype=np.float32).reshape(100, 100)  # 40,000 bytes: 3 chunks of 16 KiB
        sender.send_tensor("rx", "stage-worker", m.BenchData(run_id="watched", seq=7), value)
        wait_until(lambda: any(x["tensor"] for x in watching.lines), 30, message="the tensor in the watch")
        time.sleep(0.5)  # room for a wrongly repeated line to show
    finally:
        status, stderr = watching.stop()
    assert status == 130 and "Traceback" not in stderr, stderr
    junk = [x for x in watching.lines if x["topic"] == f"{topics.ROOT}/junk"]
    assert len(junk) == 1 and junk[0]["error"].startswith("<undecodable: 5 bytes: ") and junk[0]["schema"] is None
    tensors = [x for x in watching.lines if x["tensor"]]
    assert len(tensors) == 1, tensors  # one line for the whole tensor, not one per chunk
    seen = tensors[0]
    assert seen["tensor"] == {"dtype": "float32", "shape": [100, 100], "nbytes": 40_000, "chunks": 3}
    assert seen["fields"] == {"run_id": "watched", "seq": 7} and seen["sender"] == "tx/stage-worker"
    assert seen["topic"] == topics.from_sender(topics.data("rx", "stage-worker"), "tx")


# --- the Observer, message by message ---------------------------------------------------------------------------

SENDER = Sender(node="n1", service="svc", instance="i1")


def test_observer_decodes_fields_and_shows_each_message_once() -> None:
    observer = Observer(clock=lambda: 100.0)
    body = m.BenchData(run_id="r", seq=1)
    payload = encode(SENDER.envelope(body), body)
    seen = observer.observe("edgeswarm/x", payload, retained=True)
    assert seen is not None and seen.schema_name == "edgeswarm.bench.data" and seen.fields == {"run_id": "r", "seq": 1}
    assert seen.retained and seen.time == 100.0 and seen.sender == "n1/svc" and seen.error is None
    assert observer.observe("edgeswarm/x", payload) is None  # the same message delivered again


def test_observer_shows_a_tensor_when_its_last_chunk_arrives_in_any_order() -> None:
    observer = Observer()
    body = m.BenchData(run_id="t", seq=0)
    value = np.ones((3, 1000), dtype=np.float16)  # 6,000 bytes in chunks of 2,048: 3 chunks
    frames = list(tensor_frames(SENDER.envelope(body), body, value, 2048))
    assert [observer.observe("edgeswarm/d", f) for f in (frames[2], frames[0])] == [None, None]
    assert observer.observe("edgeswarm/d", frames[0]) is None  # a duplicate chunk completes nothing
    seen = observer.observe("edgeswarm/d", frames[1])
    assert seen is not None and seen.tensor is not None
    assert (seen.tensor.dtype, seen.tensor.shape, seen.tensor.nbytes, seen.tensor.chunks) == ("float16", (3, 1000),
                                                                                              6000, 3)


def test_observer_reports_what_it_cannot_decode_and_flags_expired_messages() -> None:
    observer = Observer()
    assert observer.observe("t", b"\x00" * 12).error.startswith("<undecodable: 12 bytes: bad magic")  # type: ignore[union-attr]
    assert "retained message cleared" in observer.observe("t", b"", retained=True).error  # type: ignore[operator,union-attr]
    body = m.BenchData(run_id="old", seq=0)
    env = SENDER.envelope(body, ttl_s=1.0).model_copy(update={"expires_at": time.time() - 10})
    seen = observer.observe("t", encode(env, body))
    assert seen is not None and seen.expired and seen.fields["run_id"] == "old"


# --- the bus's raw subscription ---------------------------------------------------------------------------------

def test_a_raw_handler_that_raises_is_counted_and_the_bus_goes_on(make_bus) -> None:  # type: ignore[no-untyped-def]
    watcher = make_bus("w", "watch")
    seen: list[tuple[str, bytes, bool]] = []
    watcher.subscribe_raw("edgeswarm/raw/#", lambda raw: 1 / 0)
    watcher.subscribe_raw("edgeswarm/raw/#", lambda raw: seen.append((raw.topic, raw.payload, raw.retained)))
    typed: list[object] = []
    watcher.subscribe("edgeswarm/raw/typed", lambda msg: typed.append(msg.body), schemas=(m.BenchData,))
    talker = make_bus("t", "svc")
    talker.publish("edgeswarm/raw/typed", m.BenchData(run_id="x", seq=1))
    pub = shutil.which("mosquitto_pub")
    assert pub, "mosquitto_pub is missing (apt-get install -y mosquitto-clients)"
    port = watcher.hub.address.port
    subprocess.run([pub, "-h", "127.0.0.1", "-p", str(port), "-t", "edgeswarm/raw/junk", "-m", "garbage"], check=True,
                   timeout=10)
    junk = ("edgeswarm/raw/junk", b"garbage", False)
    wait_until(lambda: junk in seen and typed, 10, message="both messages at the raw handler, one typed")
    # Mosquitto delivers the typed message once per matching subscription: the raw handler may see it twice (as
    # subscribe_raw says), the typed handler sees it once.
    assert {topic for topic, _, _ in seen} == {"edgeswarm/raw/typed", "edgeswarm/raw/junk"}
    assert typed == [m.BenchData(run_id="x", seq=1)]
    assert watcher.metrics.counter("handler_errors") >= len(seen) >= 2  # the raising handler, once per delivery
    assert watcher.metrics.total("rejected.") == 0  # the garbage was shown, never decoded as a message

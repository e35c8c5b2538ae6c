"""Issue 13's findings, each replayed against the real broker and services: the service still answers afterwards
and nothing was lost. (Membership, memory, planning and upload bounds have their own tests beside their code.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.bus.peers import PeerDirectory
from edgeswarm.errors import RequestRejectedError
from edgeswarm.hpp.spec import TrainProgress
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.wire import Envelope, Sender, decode, encode
from edgeswarm.wire.codec import PREFIX
from edgeswarm.wire.tensor import TensorDescriptor
from helpers import FAST_ENV, wait_until

AGENT = "node-agent"


def raw_frame(env: Envelope, body: dict, tensor: dict | None = None, raw: bytes = b"") -> bytes:  # type: ignore[type-arg]
    """A frame built by hand, so it can say what no honest sender would."""
    header = msgpack.packb({"env": env.model_dump(), "body": body, "tensor": tensor}, use_bin_type=True)
    return PREFIX.pack(b"ES", 1, 0, len(header)) + header + raw


def probe_ok(bus: Bus, node: str, service: str) -> m.ProbeReply:
    reply = bus.request(topics.request(node, service), m.Probe(), timeout_s=10).body
    assert isinstance(reply, m.ProbeReply)
    return reply


def status_of(bus: Bus, node: str, service: str) -> m.Status:
    return bus.peers.wait_for(node, service, timeout_s=60)  # a service process starting on a loaded host


# --- 1. one message must not disable a service -----------------------------------------------------------

def test_an_unviewable_tensor_on_a_reply_topic_leaves_the_service_working(broker: BrokerProcess, services,
                                                                          make_bus) -> None:
    """The 416-byte reply of finding 1: shape [0, 2**62], nbytes 0, on the coordinator's reply topic (handled on
    paho's network thread). The coordinator keeps receiving, answering and stops cleanly on SIGTERM."""
    proc = services.start("coordinator", "hub", broker.url)
    client = make_bus("cli", "cli")
    status = status_of(client, "hub", "coordinator")
    attacker = Sender(node="mallory", service="cli", instance="m1")
    body = m.BenchData(run_id="x", seq=0)
    desc = {"dtype": "float32", "shape": [0, 2**62], "nbytes": 0, "chunk_size": 1 << 20, "chunk": 0, "n_chunks": 1,
            "crc32": zlib.crc32(b"")}
    frame = raw_frame(attacker.envelope(body, correlation_id="c" * 32), body.model_dump(), desc)
    assert len(frame) < 1024
    victim_reply = topics.reply("hub", "coordinator", status.instance)
    for _ in range(3):
        client.hub.publish(topics.from_sender(victim_reply, "mallory"), frame, qos=1)
    # It still receives: a probe (request and reply) goes through, and the bad frames were rejected and counted.
    wait_until(lambda: probe_ok(client, "hub", "coordinator").rejected >= 3, 10, message="the rejections counted")
    assert probe_ok(client, "hub", "coordinator").handler_errors == 0
    proc.send_signal(15)
    assert proc.wait(15) == 0, services.log_of(proc)


def test_a_service_whose_network_thread_dies_exits_and_its_last_will_fires(broker: BrokerProcess,
                                                                          make_bus, tmp_path: Path) -> None:
    """Whatever ends paho's network thread, the service must not live on deaf: it exits (status 70) and the
    broker publishes its Last Will, so the cluster sees it offline and its supervisor restarts it."""
    script = tmp_path / "deaf.py"
    script.write_text(textwrap.dedent('''
        from edgeswarm.logs import configure_logging
        from edgeswarm.runtime.service import Service
        from edgeswarm.settings import Settings

        class Deaf(Service):
            name = "deaf"

            def setup(self) -> None:
                # Stands for anything that ends the thread: paho's loop stops, the socket stays open.
                self.every(1.0, self.bus.hub._client.loop_stop, "stop-network-loop")

        configure_logging("deafnode", "deaf")
        raise SystemExit(Deaf(Settings()).run())
    '''))
    watcher = make_bus("watch", "cli")
    statuses: list[m.Status] = []
    watcher.subscribe(topics.status("deafnode", "deaf"), lambda msg: statuses.append(msg.body), schemas=(m.Status,))
    env = {**os.environ, **FAST_ENV, "EDGESWARM_NODE_ID": "deafnode", "EDGESWARM_HUB_URL": broker.url}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.wait(30) == 70
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert "network thread has stopped" in out
        wait_until(lambda: statuses and statuses[-1].state == "offline", 15, message="the Last Will")
        assert statuses[-1].reason == "connection lost"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# --- 2. a header must not reserve memory ------------------------------------------------------------------

def test_two_tiny_frames_reserve_nothing_and_a_real_transfer_still_arrives(broker: BrokerProcess, services,
                                                                          make_bus) -> None:
    proc = services.start(AGENT, "n1", broker.url)
    client = make_bus("cli", "cli")
    status_of(client, "n1", AGENT)
    attacker = Sender(node="mallory", service="cli", instance="m1")
    body = m.BenchData(run_id="never", seq=0)
    for _ in range(2):  # 2**31 bytes declared each, one byte sent
        desc = TensorDescriptor(dtype="uint8", shape=(2**31,), nbytes=2**31, chunk_size=1, chunk=0, n_chunks=2**31,
                                crc32=zlib.crc32(b"x"))
        client.hub.publish(topics.from_sender(topics.data("n1", AGENT), "mallory"),
                           encode(attacker.envelope(body), body, desc, b"x"), qos=1)
    metrics: list[Inbound] = []
    client.subscribe(topics.metrics("n1", AGENT), metrics.append, schemas=(m.MetricsReport,))
    done = client.expect()
    client.request(topics.request("n1", AGENT), m.BenchStart(run_id="real", count=1,
                                                           done_correlation_id=done.correlation_id))
    value = np.arange(1 << 20, dtype=np.float32)  # 4 MiB in 4 chunks
    client.send_tensor("n1", AGENT, m.BenchData(run_id="real", seq=0), value)
    ack = done.wait(20)
    assert ack is not None and ack.body.received == 1 and ack.body.bytes == value.nbytes
    wait_until(lambda: metrics and metrics[-1].body.uptime_s > 1.5, 20, message="a metrics report")
    assert metrics[-1].body.gauges["reassembly_bytes"] < 64 * 1024, "two frames hold what they carried, no more"
    assert proc.poll() is None


# --- 4. a stranger's ping holds nothing -------------------------------------------------------------------

def test_pings_from_unknown_senders_do_not_hold_up_a_link_measurement(broker: BrokerProcess, make_bus,
                                                                       tmp_path: Path) -> None:
    from conftest import bus_settings
    from edgeswarm.services.profiler.service import ProfilerService
    from helpers import running

    a = ProfilerService(bus_settings(broker.url, node_id="a", profile_dir=tmp_path / "a"))
    b = ProfilerService(bus_settings(broker.url, node_id="b", profile_dir=tmp_path / "b"))
    stranger = make_bus("stranger", "profiler")  # no status: nobody knows where to answer it
    with running(b), running(a):
        wait_until(lambda: a.bus.peers.get("b", "profiler") and b.bus.peers.get("a", "profiler"), 15,
                   message="both profilers online")
        for i in range(8):
            stranger.send_tensor("b", "profiler", m.LinkProbe(probe_id=f"s{i}", kind="ping"),
                                 np.zeros(64, dtype=np.uint8))
        wait_until(lambda: b.metrics.counter("link_probes_unknown_sender") >= 8, 10, message="the pings dropped")
        link = a.links.measure("b", timeout_s=30)  # each stranger's ping used to hold b's data thread 10 s
    # Both profilers share one broker on loopback: the link adds nothing to a ping's round trip beyond its own to
    # the sender, so its latency, net of that, is a median of differences near zero (0 when negative).
    assert link.bandwidth_bps > 0 and link.latency_s >= 0 and link.hop_s > 0
    assert b.metrics.counter("handler_errors") == 0


# --- 7. an overflowing inbox answers, and logs a bounded number of lines -------------------------------

def test_dropped_and_refused_requests_are_answered_and_logged_at_a_bounded_rate(broker: BrokerProcess, services,
                                                                                make_bus) -> None:
    proc = services.start(AGENT, "n1", broker.url, EDGESWARM_WORKERS="1", EDGESWARM_INBOX_CAPACITY="16")
    client = make_bus("cli", "cli")
    status_of(client, "n1", AGENT)

    # A request with an unknown schema, and one whose body fails validation, are answered at once.
    def ask(schema: str, body: dict) -> Inbound:  # type: ignore[type-arg]
        exp = client.expect()
        env = client.sender.envelope(m.Probe(), ttl_s=10, correlation_id=exp.correlation_id,
                                     reply_to=client.reply_topic)
        env = env.model_copy(update={"schema_name": schema})
        client.hub.publish(topics.from_sender(topics.request("n1", AGENT), "cli"), raw_frame(env, body), qos=1)
        reply = exp.wait(10)
        assert reply is not None, f"no answer to {schema}"
        return reply

    unknown = ask("edgeswarm.no_such_thing", {})
    assert isinstance(unknown.body, m.RequestRejected) and unknown.body.reason == "unknown_schema"
    invalid = ask("edgeswarm.bench.echo", {"payload": 12})
    assert isinstance(invalid.body, m.RequestRejected) and invalid.body.reason == "invalid_message"

    # A flood the inbox cannot hold: some requests are dropped and answered `overflow`.
    seen: list[str] = []
    spy = paho.Client(CallbackAPIVersion.VERSION2, client_id="overflow-spy", protocol=paho.MQTTv5)
    spy.on_message = lambda c, u, msg: seen.append(decode(msg.payload).envelope.schema_name)
    spy.connect(broker.host, broker.port)
    spy.subscribe(topics.from_sender(client.reply_topic, "+"), qos=0)
    spy.loop_start()
    try:
        time.sleep(0.3)
        frames = [encode(client.sender.envelope(m.BenchEcho(payload=bytes(2048)), ttl_s=30, correlation_id=f"{i:032x}",
                                                reply_to=client.reply_topic), m.BenchEcho(payload=bytes(2048)))
                  for i in range(3000)]
        topic = topics.from_sender(topics.request("n1", AGENT), "cli")
        for frame in frames:
            client.hub.publish(topic, frame, qos=0)
        wait_until(lambda: "edgeswarm.rejected" in seen, 20, message="an overflow answer")
    finally:
        spy.loop_stop()
        spy.disconnect()
    assert probe_ok(client, "n1", AGENT).handler_errors == 0
    assert proc.poll() is None
    log = [line for line in (services.log_of(proc)).splitlines() if "inbox full" in line]
    assert 1 <= len(log) <= 12, f"{len(log)} 'inbox full' lines for one flood"


def test_a_request_refused_by_the_bus_raises_at_the_requester(make_bus) -> None:
    server = make_bus("srv", "svc", max_packet_bytes=1 << 20)
    server.subscribe(topics.request("srv", "svc"), lambda msg: server.reply(msg, m.BenchEchoReply(payload=b"")),
                     schemas=(m.BenchEcho,))
    client = make_bus("cli", "cli")
    with pytest.raises(RequestRejectedError, match="unexpected_schema") as err:
        client.request(topics.request("srv", "svc"), m.Probe(), timeout_s=5)  # nobody takes probes on srv/svc
    assert err.value.reason == "unexpected_schema"


# --- 9 and 10: what the cluster trusts ------------------------------------------------------------------

def test_forged_senders_are_dropped(make_bus) -> None:
    victim = make_bus("victim", "svc")
    got: list[Inbound] = []
    victim.subscribe(topics.request("victim", "svc"), got.append, schemas=(m.Probe,))
    statuses: list[Inbound] = []
    victim.subscribe(topics.status("hub", "checkpoint-store"), statuses.append, schemas=(m.Status,))
    mallory = make_bus("mallory", "cli")
    liar = Sender(node="hub", service="coordinator", instance="x1")  # says it is the hub
    mallory.hub.publish(topics.from_sender(topics.request("victim", "svc"), "mallory"),
                        encode(liar.envelope(m.Probe()), m.Probe()))
    status = m.Status(state="online", node="hub", service="checkpoint-store", instance="x1", version="t", host="h",
                      pid=1, device_class="native", memory_budget_bytes=1, free_memory_bytes=1,
                      data_url="mqtt://evil.example:1883", heartbeat_interval_s=1.0, started_at=0.0)
    mallory.publish(topics.status("hub", "checkpoint-store"), status)  # sent as mallory, on hub's topic
    mallory.publish(topics.request("victim", "svc"), m.Probe())  # honest: arrives
    wait_until(lambda: got, 10, message="the honest probe")
    time.sleep(0.3)
    assert [g.envelope.sender_node for g in got] == ["mallory"]
    assert not statuses and victim.peers.get("hub", "checkpoint-store") is None
    assert victim.metrics.counter("rejected.forged_sender") >= 2  # the status may come once per matching filter


def test_a_status_from_the_future_does_not_outrank_later_ones() -> None:
    directory = PeerDirectory()

    def inbound(url: str, sent_at: float, retained: bool) -> Inbound:
        status = m.Status(state="online", node="hub", service="checkpoint-store", instance="i", version="t",
                          host="h", pid=1, device_class="native", memory_budget_bytes=1, free_memory_bytes=1,
                          data_url=url, heartbeat_interval_s=1.0, started_at=0.0)
        env = Sender(node="hub", service="checkpoint-store", instance="i").envelope(status)
        return Inbound(topics.status("hub", "checkpoint-store"), env.model_copy(update={"sent_at": sent_at}), status,
                       None, retained)

    directory.update(inbound("mqtt://evil.example:1883", time.time() + 10 * 365 * 86400, retained=True))
    directory.update(inbound("mqtt://hub:1883", time.time(), retained=False))
    status = directory.get("hub", "checkpoint-store")
    assert status is not None and status.data_url == "mqtt://hub:1883"


def test_retained_garbage_gives_warnings_not_tracebacks(broker: BrokerProcess, make_bus, tmp_path: Path) -> None:
    """Undecodable retained payloads, markup in strings, a job state filed under another job: `status` and `jobs`
    print their tables and one-line warnings, never a traceback."""
    mallory = make_bus("junk", "cli")
    mallory.hub.publish("edgeswarm/node/junk/node-agent/status", b"\x00not a frame" * 20, retain=True)
    mallory.hub.publish("edgeswarm/job/junk/state", b"ES\x01\x00\xff\xff\x00\x00garbage", retain=True)
    mallory.publish(topics.status("junk", "profiler"), m.Status(
        state="online", node="junk", service="profiler", instance="j1", version="[/red]", host="[bold]h",
        pid=1, device_class="[/nope]", memory_budget_bytes=1, free_memory_bytes=1, data_url="mqtt://x:1",
        heartbeat_interval_s=1.0, started_at=0.0), retain=True)
    mallory.publish(topics.job_state("other"), m.JobState(
        job_id="junk-job", status="failed", model="[/model]", submitted_at=0.0, updated_at=0.0,
        detail="[/x] not markup"), retain=True)
    mallory.publish(topics.job_state("junk-job"), m.JobState(
        job_id="junk-job", status="running", model="[/model]", progress=TrainProgress(round=3, loss=float("nan")),
        submitted_at=0.0, updated_at=0.0, detail="[/x] not markup"), retain=True)
    env = {**os.environ, "EDGESWARM_HUB_URL": broker.url}
    for command in (["status"], ["jobs"], ["jobs", "--json"], ["status", "--json"]):
        done = subprocess.run([sys.executable, "-m", "edgeswarm", *command], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stdout + done.stderr, (command, done.stderr)
    jobs = subprocess.run([sys.executable, "-m", "edgeswarm", "jobs"], env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=60)
    assert "[/x] not markup" in jobs.stdout and jobs.stdout.count("junk-job") == 1
    assert "rejected a message" in jobs.stderr and len(jobs.stderr.splitlines()) < 10


def test_a_restarting_coordinator_takes_over_only_its_own_job_states(broker: BrokerProcess, services,
                                                                     make_bus) -> None:
    forger = make_bus("mallory", "coordinator")  # a coordinator, but not on the hub
    spec = "name: forged\nmodel: {name: mlp}\ndata: {kind: teacher, size: 64}\nglobal_batch: 8\nrounds: 1\n"
    forger.publish(topics.job_state("forged"), m.JobState(
        job_id="forged", spec=spec, status="queued", model="mlp", submitted_at=0.0, updated_at=0.0),
        retain=True)
    proc = services.start("coordinator", "hub", broker.url)
    client = make_bus("cli", "cli")
    events: list[Inbound] = []
    client.subscribe(topics.job_events("forged"), events.append, schemas=(m.JobEvent,))
    status_of(client, "hub", "coordinator")
    wait_until(lambda: "not taking over the retained state on edgeswarm/job/forged/state" in services.log_of(proc),
               15, message="the forged state refused")
    time.sleep(1.0)
    assert not events, "the forged job was not run"
    probe_ok(client, "hub", "coordinator")



def test_a_body_on_a_nodes_own_topic_speaks_for_that_node_only() -> None:
    from edgeswarm.bus.bus import check_writer
    from edgeswarm.errors import WireError

    progress = m.ProfileProgress(request_id="r", node="other", fraction=0.5, message="m")
    env = Sender(node="pi-1", service="profiler", instance="i").envelope(progress)
    with pytest.raises(WireError, match="speaks for node other"):
        check_writer(topics.profile_progress("pi-1"), env, progress)
    check_writer(topics.profile_progress("pi-1"), env, progress.model_copy(update={"node": "pi-1"}))
    probe_reply = m.ProbeReply(node="pi-1", service="s", instance="i", healthy=True, uptime_s=1, inbox_depth=0,
                               handler_errors=0, rejected=0)
    check_writer(topics.from_sender(topics.reply("hub", "cli", "x"), "pi-1"), env, probe_reply)

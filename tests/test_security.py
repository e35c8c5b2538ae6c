"""A cluster that only its members may speak on: credentials, TLS and the ACL generated from the topic tree.

Most tests share one `edgeswarm up --local --secure` cluster (Mosquitto with TLS, a password per node and the
ACL): the operator sees it over TLS, outsiders and wrong passwords are refused, and a device's credentials do
not let it submit jobs, write another node's topics, read its requests, or write checkpoints it does not own. The
cluster has an edge server too (the edge role), which runs its role's services under its own credentials.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.checkpoints.client import list_checkpoints, save_checkpoint
from edgeswarm.errors import BrokerUnavailableError, CheckpointForbiddenError, NotAuthorizedError
from edgeswarm.hpp.spec import TrainProgress
from edgeswarm.local.broker import BrokerSecurity, free_port, start_broker
from edgeswarm.pipeline_serve.spec import ServeProgress
from edgeswarm.security.acl import rules
from edgeswarm.security.certs import CertsDir
from edgeswarm.security.credentials import CredentialsDir
from edgeswarm.security.passwords import mosquitto_hash
from edgeswarm.settings import Settings
from edgeswarm.wire import Sender
from edgeswarm.workloads.client import JobFollower, JobRequestError, cancel_job, submit_job
from helpers import FAST_ENV, announce, wait_serving, wait_until

DEVICES = ("tx2-0", "nano-1")
EDGE = "edge-0"  # `up --local --edges 1`
JOB = """name: guarded
model: {name: mlp, config: {hidden: 16, layers: 2}}
data: {kind: teacher, size: 256, test_size: 32}
global_batch: 32
micro_batches: 2
rounds: 2
checkpoint_interval: 1
"""


def mosquitto_verify(password: str, hashed: str) -> bool:
    """Whether ``password`` matches a ``$7$`` hash written by ``mosquitto_hash`` or ``mosquitto_passwd``."""
    try:
        _, kind, iterations, salt, digest = hashed.split("$")
        if kind != "7":
            return False
        expected = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(salt), int(iterations))
        return hmac.compare_digest(expected, base64.b64decode(digest))
    except ValueError:
        return False


@dataclass
class SecureCluster:
    workdir: Path
    env: dict[str, str]  # the operator's, from operator.env

    @property
    def hub_url(self) -> str:
        return self.env["EDGESWARM_HUB_URL"]

    @property
    def creds(self) -> CredentialsDir:
        return CredentialsDir(self.workdir / "secrets")

    def settings(self, member: str | None, **overrides: object) -> Settings:
        """Settings of a client logged in as ``member`` (None: anonymous), over TLS with the cluster's CA."""
        values: dict[str, object] = {"hub_url": self.hub_url, "tls_ca_file": self.env["EDGESWARM_TLS_CA_FILE"],
                                     "request_timeout_s": 10.0, "publish_timeout_s": 10.0}
        if member is not None:
            values.update(node_id=member, mqtt_username=member, mqtt_password_file=self.creds.password_file(member))
        values.update(overrides)
        return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    workdir = tmp_path_factory.mktemp("secure")
    cmd = [sys.executable, "-m", "edgeswarm", "up", "--local", "--secure", "--devices", "2", "--edges", "1",
           "--port", str(free_port()), "--workdir", str(workdir), "--heartbeat", "0.5", "--ready-timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **FAST_ENV, "COLUMNS": "200"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        wait_until(lambda: any("cluster up" in line for line in lines) or proc.poll() is not None, 150,
                   message="the secure cluster")
        assert proc.poll() is None, "".join(lines)
        env = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1)
                   for line in (workdir / "secrets" / "operator.env").read_text().splitlines())
        yield SecureCluster(workdir, env)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0, "".join(lines)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def connect(cluster: SecureCluster) -> Iterator:  # type: ignore[type-arg]
    """``connect(member, service="cli")``: a started Bus logged in as ``member``; stopped after the test."""
    buses: list[Bus] = []

    def make(member: str | None, service: str = "cli", **overrides: object) -> Bus:
        settings = cluster.settings(member, **overrides)
        bus = Bus(settings, Sender(node=member or "anon", service=service, instance=os.urandom(6).hex()))
        buses.append(bus)
        bus.start(timeout_s=5)
        return bus

    try:
        yield make
    finally:
        for bus in buses:
            bus.stop()


def test_the_operator_runs_commands_over_tls(cluster: SecureCluster) -> None:
    env = {**os.environ, **cluster.env}
    status = subprocess.run([sys.executable, "-m", "edgeswarm", "status", "--json"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    view = m.ClusterView.model_validate_json(status.stdout)
    assert {"hub", *DEVICES} <= {n.node for n in view.nodes}
    assert all(s.state == "online" for n in view.nodes for s in n.services)
    assert all(s.data_url.startswith("mqtts://") and "@" not in s.data_url for n in view.nodes for s in n.services)


def test_outsiders_are_refused(cluster: SecureCluster, connect) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NotAuthorizedError, match="an anonymous client"):
        connect(None)
    with pytest.raises(NotAuthorizedError, match="user 'nano-1'"):
        connect("nano-1", mqtt_password_file=None, mqtt_password="guessed")
    plain = cluster.hub_url.replace("mqtts://", "mqtt://")
    with pytest.raises(BrokerUnavailableError):
        connect("operator", hub_url=plain)  # no TLS on a TLS port
    with pytest.raises(BrokerUnavailableError):
        connect("operator", tls_ca_file=None)  # the system's CAs do not know the cluster's


def test_a_device_cannot_submit_jobs_nor_write_what_is_not_its_own(cluster: SecureCluster, connect) -> None:  # type: ignore[no-untyped-def]
    device = connect("nano-1")
    with pytest.raises(JobRequestError, match="refused edgeswarm.job.submit"):
        submit_job(device, JOB, timeout_s=5)
    operator = connect("operator")
    watched: list[Inbound] = []
    operator.subscribe(topics.status("tx2-0", "node-agent"), watched.append, schemas=(m.Status,))
    wait_until(lambda: watched, 10, message="tx2-0's retained status")
    genuine = watched[-1].body

    # Another node's status, the job states and the cluster view: the broker refuses each (MQTT 5 PUBACK).
    forged = genuine.model_copy(update={"state": "offline", "reason": "forged"})
    refused = [device.hub.publish(topics.status("tx2-0", "node-agent"), b"\x00" * 8, retain=True),
               device.hub.publish(topics.job_state("guarded"), b"\x00" * 8, retain=True),
               device.hub.publish(topics.CLUSTER_VIEW, b"\x00" * 8, retain=True),
               device.hub.publish(topics.CLUSTER_EVENTS, b"\x00" * 8),  # the coordinator's alone
               device.hub.publish(topics.service_events("tx2-0", "node-agent"), b"\x00" * 8),
               device.hub.publish(topics.from_sender(topics.request("tx2-0", "stage-worker"), "nano-1"), b"\x00")]
    device.publish(topics.status("tx2-0", "node-agent"), forged, retain=True)
    wait_until(lambda: all(device.hub.refusal(mid) for mid in refused), 10, message="the refusals")
    time.sleep(0.5)
    assert watched[-1].body.state == "online", "tx2-0's status is untouched"

    # A request to another node is not delivered to a third: only the node addressed reads it.
    overheard: list[Inbound] = []
    device.subscribe(topics.from_sender(topics.request("tx2-0", "node-agent"), "+"), overheard.append)
    assert operator.request(topics.request("tx2-0", "node-agent"), m.Probe(), timeout_s=10) is not None
    time.sleep(0.5)
    assert not overheard


def test_an_edge_server_runs_its_roles_services_and_writes_only_its_own(cluster: SecureCluster,
                                                                       connect) -> None:  # type: ignore[no-untyped-def]
    from edgeswarm.runtime.client import ClusterWatcher
    from edgeswarm.service_registry import services_of

    watcher = ClusterWatcher(connect("operator"))

    def edge_services() -> dict[str, str]:
        node = next((n for n in watcher.view()[0].nodes if n.node == EDGE), None)
        return {s.service: s.state for s in node.services} if node else {}

    wait_until(lambda: edge_services() == {s: "online" for s in services_of("edge")}, 30,
               message=f"{EDGE}'s services online")
    assert "stage-worker" not in edge_services()
    edge = connect(EDGE)
    refused = [edge.hub.publish(topics.from_sender(topics.request("tx2-0", "stage-worker"), EDGE), b"\x00"),
               edge.hub.publish(topics.job_state("guarded"), b"\x00" * 8, retain=True),
               edge.hub.publish(topics.status("tx2-0", "node-agent"), b"\x00" * 8, retain=True),
               edge.hub.publish(topics.from_sender(topics.request("hub", "coordinator"), EDGE), b"\x00")]
    wait_until(lambda: all(edge.hub.refusal(mid) for mid in refused), 10, message="the refusals")


def test_only_a_jobs_coordinator_and_stage_devices_write_its_checkpoints(cluster: SecureCluster,
                                                                         connect) -> None:  # type: ignore[no-untyped-def]
    operator = connect("operator")
    follower = JobFollower(operator, "guarded")
    submit_job(operator, JOB, submission=follower.submission)
    final = follower.wait(240)
    assert final.status == "succeeded", final.detail
    saved = final.progress_as(TrainProgress).checkpoint_version
    assert final.plan is not None and saved is not None
    kept = list_checkpoints(operator, "hub", "guarded", timeout_s=10)["guarded"]

    device = connect("nano-1", service="stage-worker")
    announce(device)  # the store streams answers to a loader's data topic: this bus needs a status too
    nano_stages = [k for k, s in enumerate(final.plan.stages) if "nano-1" in s.devices]
    targets = ["layout"] + [f"stage-{k}" for k in range(len(final.plan.stages)) if k not in nano_stages]
    for stage in targets:
        for version in range(saved + 1, saved + 4):
            with pytest.raises(CheckpointForbiddenError, match="may not write guarded"):
                save_checkpoint(device, "hub", "guarded", stage, version, {"w": np.zeros(4, np.float32)},
                                timeout_s=20)
    assert list_checkpoints(operator, "hub", "guarded", timeout_s=10)["guarded"] == kept, "nothing pruned"


def test_a_client_serves_a_trained_models_checkpoint_over_tls(cluster: SecureCluster,
                                                              connect) -> None:  # type: ignore[no-untyped-def]
    """Serving under the ACL: the hub deploys the stages with the weights a training job saved, the devices send
    their outputs to the coordinator, the operator's requests and the tensor answers cross TLS."""
    import torch

    from edgeswarm.models.zoo import build_model, example_input
    from edgeswarm.pipeline_serve.client import infer_stream
    from edgeswarm.state.layout import load_layout, load_stage
    from edgeswarm.state.units import model_state
    from edgeswarm.values.profiles import ModelSpec

    operator = connect("operator")
    announce(operator)  # loading the checkpoint streams it to the operator's data topic
    trained = JobFollower(operator, "to-serve")
    submit_job(operator, JOB.replace("name: guarded", "name: to-serve"), submission=trained.submission)
    assert trained.wait(240).status == "succeeded"
    served = JobFollower(operator, "serve-trained")
    submit_job(operator, "kind: serve-pipeline\nname: serve-trained\nmodel: {name: mlp, config: {hidden: 16, "
                         "layers: 2}}\nweights: {job: to-serve}\nmicro_batch_size: 4\n",
               submission=served.submission)
    wait_serving(served, 240)
    assert served.state.progress_as(ServeProgress).weights == "job to-serve version 2"
    spec = ModelSpec(name="mlp", config={"hidden": 16, "layers": 2})
    model = build_model(spec).eval()
    state: dict[str, torch.Tensor] = {}
    for k in range(len(load_layout(operator, "hub", "to-serve", 2, timeout_s=20))):
        state.update(model_state(load_stage(operator, "hub", "to-serve", k, 2, timeout_s=20)))
    model.load_state_dict(state)
    inputs = [example_input(spec, 3, seed=k) for k in range(6)]
    report = infer_stream(operator, "serve-trained", inputs, window=3, timeout_s=60)
    with torch.no_grad():
        for r in report.results:
            assert r.outputs is not None, r.error
            torch.testing.assert_close(r.outputs, model(inputs[r.index]), rtol=1e-5, atol=1e-5)
    cancel_job(operator, "serve-trained")
    assert served.wait(60).status == "cancelled"


def test_no_secret_reaches_a_log(cluster: SecureCluster) -> None:
    passwords = [cluster.creds.password(name) for name in cluster.creds.roster().members]
    logs = "".join(p.read_text(errors="replace") for p in (cluster.workdir / "logs").glob("*.log"))
    assert "user nano-1" in logs and "started as instance" in logs
    assert not [pw for pw in passwords if pw in logs]


# --- credentials, certificates and the brokers' files -------------------------------------------------------

def test_credentials_keep_passwords_and_write_what_the_brokers_read(tmp_path: Path) -> None:
    from edgeswarm.cli.main import main

    folder = CredentialsDir(tmp_path / "secrets")
    assert main(["credentials", "--dir", str(folder.path), "--hub", "hub", "--device", "pi-1"]) == 0
    first = folder.password("pi-1")
    assert main(["credentials", "--dir", str(folder.path), "--device", "pi-2", "--client", "alice"]) == 0
    assert folder.password("pi-1") == first, "adding members keeps the existing passwords"
    assert folder.roster().members == {"hub": "hub", "pi-1": "device", "pi-2": "device", "alice": "client"}
    passwd = dict(line.split(":", 1) for line in folder.mosquitto_passwd.read_text().splitlines())
    assert mosquitto_verify(first, passwd["pi-1"]) and not mosquitto_verify("wrong", passwd["pi-1"])
    acl = folder.mosquitto_acl.read_text()
    assert "user pi-1\n" in acl and "topic write edgeswarm/node/pi-1/+/status" in acl
    assert "topic write edgeswarm/node/+/coordinator/request/pi-1" not in acl, "devices do not submit jobs"
    assert "topic write edgeswarm/node/+/coordinator/request/alice" in acl
    assert main(["credentials", "--dir", str(folder.path), "--remove", "pi-2"]) == 0
    assert "pi-2" not in folder.roster().members and "pi-2" not in folder.mosquitto_passwd.read_text()
    assert main(["credentials", "--dir", str(folder.path), "--device", "bad/name"]) == 2


def test_our_hashes_and_mosquitto_passwd_agree(tmp_path: Path) -> None:
    """Both directions: mosquitto_passwd's hashes verify here, and Mosquitto itself accepts ours (the deployment
    tests log every service in with them)."""
    out = tmp_path / "pw"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(out), "alice", "s3cret"], check=True, capture_output=True)
    hashed = out.read_text().strip().split(":", 1)[1]
    assert mosquitto_verify("s3cret", hashed) and not mosquitto_verify("s3cret!", hashed)
    assert mosquitto_verify("s3cret", mosquitto_hash("s3cret"))


def test_the_acl_follows_the_topic_tree() -> None:
    hub = {(r.access, r.topic) for r in rules("hub", "hub")}
    device = {(r.access, r.topic) for r in rules("pi-1", "device")}
    client = {(r.access, r.topic) for r in rules("alice", "client")}
    assert ("write", "edgeswarm/job/+/state") in hub and ("write", "edgeswarm/cluster/view") in hub
    hub_only = ("edgeswarm/job/", "edgeswarm/cluster/view", "edgeswarm/cluster/events")
    assert ("write", "edgeswarm/cluster/events") in hub and ("write", "edgeswarm/node/pi-1/+/events") in device
    assert not {t for a, t in device | client if a == "write" and t.startswith(hub_only)}
    assert ("write", "edgeswarm/node/+/+/request/hub") in hub  # the hub addresses every service
    assert ("write", "edgeswarm/node/+/stage-worker/data/pi-1") in device
    assert ("write", "edgeswarm/node/+/stage-worker/data/alice") not in client
    assert ("read", "edgeswarm/node/pi-1/+/request/+") in device
    assert not {t for a, t in device if a == "read" and "/request/" in t and "pi-1" not in t}
    for name, granted in (("pi-1", device), ("alice", client)):  # nothing is ever written as anyone else
        for access, topic in granted:
            levels = topic.split("/")
            if access == "write" and (levels[1] == "reply" or "request" in levels or "data" in levels):
                assert levels[-1] == name, topic
            elif access == "write" and levels[1] == "node":
                assert levels[2] == name, topic


def test_the_amqtt_broker_checks_the_same_passwords(tmp_path: Path) -> None:
    folder = CredentialsDir(tmp_path / "secrets")
    folder.update(add={"hub": "hub", "pi-1": "device"})
    broker = start_broker("amqtt", workdir=tmp_path / "amqtt", security=BrokerSecurity(
        mosquitto_passwd=folder.mosquitto_passwd, mosquitto_acl=folder.mosquitto_acl,
        amqtt_passwd=folder.amqtt_passwd, amqtt_acl=folder.amqtt_acl))
    buses: list[Bus] = []
    try:
        def bus(member: str | None, password: str | None = None) -> Bus:
            settings = Settings(hub_url=broker.url, mqtt_protocol="3.1.1", node_id=member or "anon",
                                mqtt_username=member, mqtt_password=password)
            b = Bus(settings, Sender(node=member or "anon", service="cli", instance="i1"))
            buses.append(b)
            b.start(timeout_s=10)
            return b

        with pytest.raises(NotAuthorizedError):
            bus(None)
        with pytest.raises(NotAuthorizedError):
            bus("pi-1", "guessed")
        hub = bus("hub", folder.password("hub"))
        device = bus("pi-1", folder.password("pi-1"))
        got: list[Inbound] = []
        hub.subscribe(topics.request("hub", "svc"), got.append, schemas=(m.Probe,))
        device.publish(topics.request("hub", "svc"), m.Probe())  # not allowed for a device: dropped by the ACL
        hub.publish(topics.request("hub", "svc"), m.Probe())  # a node to its own services: allowed
        wait_until(lambda: got, 10, message="the hub's own probe")
        time.sleep(0.5)
        assert [g.envelope.sender_node for g in got] == ["hub"]
    finally:
        for b in buses:
            b.stop()
        broker.stop()


def test_tensors_reach_a_nodes_own_tls_broker(tmp_path: Path) -> None:
    """The data plane too: node a's tensors arrive on a's own broker, over TLS, from b logged in as itself."""
    folder = CredentialsDir(tmp_path / "secrets")
    folder.update(add={"a": "device", "b": "device"})
    certs = CertsDir(tmp_path / "secrets")
    certs.ensure_ca()
    brokers = []
    buses: list[Bus] = []
    try:
        for name in ("hub", "a"):
            cert, key = certs.issue_broker(name, ["127.0.0.1"])
            brokers.append(start_broker("mosquitto", workdir=tmp_path / name, security=BrokerSecurity(
                mosquitto_passwd=folder.mosquitto_passwd, mosquitto_acl=folder.mosquitto_acl,
                amqtt_passwd=folder.amqtt_passwd, amqtt_acl=folder.amqtt_acl, ca_file=certs.ca_cert,
                cert_file=cert, key_file=key)))
        hub, own = brokers

        def bus(member: str, **extra: object) -> Bus:
            settings = Settings(hub_url=hub.url, node_id=member, mqtt_password_file=folder.password_file(member),
                                tls_ca_file=certs.ca_cert, **extra)  # type: ignore[arg-type]
            b = Bus(settings, Sender(node=member, service="stage-worker", instance="i1"))
            buses.append(b)
            b.start(timeout_s=10)
            return b

        a = bus("a", data_url=own.url)
        got: list[Inbound] = []
        a.subscribe(topics.data("a", "stage-worker"), got.append, schemas=(m.BenchData,), plane="data")
        announce(a)
        b = bus("b")
        value = np.arange(300_000, dtype=np.float32)
        b.send_tensor("a", "stage-worker", m.BenchData(run_id="dp", seq=0), value)
        wait_until(lambda: got, 20, message="the tensor on a's broker")
        assert np.array_equal(got[0].tensor.array, value)
        assert own.url in b._pool and own.url.startswith("mqtts://")  # noqa: SLF001 - b connected to a's broker
    finally:
        for b in buses:
            b.stop()
        for broker in brokers:
            broker.stop()


# --- what a service refuses to start with -------------------------------------------------------------------

@pytest.mark.parametrize("env, says", [
    ({"EDGESWARM_HUB_URL": "mqtt://192.0.2.1:1883"}, "EDGESWARM_ALLOW_ANONYMOUS"),
    ({"EDGESWARM_HUB_URL": "mqtt://127.0.0.1:1883", "EDGESWARM_DATA_URL": "mqtt://hub.example:1883"},
     "may be reachable beyond this machine"),
    ({"EDGESWARM_MQTT_USERNAME": "someone-else", "EDGESWARM_MQTT_PASSWORD": "x"}, "a node logs in as its own id"),
    ({"EDGESWARM_HUB_URL": "mqtts://u:p@127.0.0.1:8883", "EDGESWARM_DATA_URL": "mqtts://v:q@127.0.0.1:8884"},
     "one identity for every broker"),
])
def test_a_service_refuses_an_unsafe_identity(env: dict[str, str], says: str) -> None:
    full = {**os.environ, "EDGESWARM_NODE_ID": "hub", **env}
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "service", "coordinator"], env=full,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert ":p@" not in done.stderr and ":q@" not in done.stderr, "no password in an error"


def test_credentials_in_a_url_move_out_of_it() -> None:
    settings = Settings(node_id="pi-1", hub_url="mqtts://pi-1:s%40cret@hub.example:8883")
    assert settings.hub_url == "mqtts://hub.example:8883"
    creds = settings.credentials()
    assert creds.username == "pi-1" and creds.password is not None
    assert creds.password.get_secret_value() == "s@cret" and "s@cret" not in repr(settings)

"""Services as registry entries (edgeswarm.service_registry): the built-ins, a plug-in found through an entry point,
the edge role in the topic tree, the ACL, credentials and cluster files, and the generic worker host."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.devices.cluster import ClusterSpec, cluster_of
from edgeswarm.errors import ConfigError
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.messages.serving import ServeRelease
from edgeswarm.messages.training import StageAbort
from edgeswarm.runtime.program import WorkerContext
from edgeswarm.runtime.reachability import compose_service_names
from edgeswarm.security.acl import rules
from edgeswarm.security.credentials import CredentialsDir
from edgeswarm.service_registry import (
    BUILT_IN,
    ServiceEntry,
    service_class,
    service_entry,
    service_names,
    services,
    services_of,
)
from edgeswarm.settings import Settings
from edgeswarm.workloads.worker_host import WorkerService
from helpers import running, wait_until

PLUGIN = "toy_edge_plugin"


def _forget_the_registry() -> None:
    services.cache_clear()
    topics.topic_tree.cache_clear()
    compose_service_names.cache_clear()


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """``install_plugin(entry_points)``: a package ``toy_edge_plugin`` installed on sys.path as a distribution whose
    ``entry_points.txt`` has the ``edgeswarm.services`` lines given, as ``pip install`` would leave it. Its
    ``ENTRY`` is an edge service (a worker service with no program); ``NOT_AN_ENTRY`` is a string."""
    site = tmp_path / "site"

    def install(entry_points: str) -> None:
        package = site / PLUGIN
        package.mkdir(parents=True)
        # The entry in a light module (read whenever the registry is), the service in its own (imported to run).
        (package / "__init__.py").write_text(textwrap.dedent("""\
            from edgeswarm.service_registry import ServiceEntry

            ENTRY = ServiceEntry("toy_edge_plugin.service:ToyManager", ("edge",), request_writers=("hub", "device"),
                                 data_writers=("device",), data_purpose="activations from the devices")
            DEFAULTS = ServiceEntry("toy_edge_plugin.service:ToyDefaults", ("device",))
            NOT_AN_ENTRY = "toy_edge_plugin.service:ToyManager"
            """))
        (package / "service.py").write_text(textwrap.dedent("""\
            from edgeswarm.workloads.worker_host import WorkerService


            class ToyManager(WorkerService):
                name = "toy-manager"


            class ToyDefaults(WorkerService):
                name = "toy-defaults"
            """))
        dist = site / f"{PLUGIN}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[edgeswarm.services]\n{entry_points}\n")
        monkeypatch.syspath_prepend(str(site))
        _forget_the_registry()

    try:
        yield install
    finally:
        for name in [n for n in sys.modules if n == PLUGIN or n.startswith(f"{PLUGIN}.")]:
            del sys.modules[name]
        monkeypatch.undo()
        _forget_the_registry()


def test_the_built_in_services_and_their_roles() -> None:
    assert list(BUILT_IN) == list(services())[:len(BUILT_IN)]
    assert services_of("hub") == ("coordinator", "planner", "checkpoint-store", "dashboard", "gateway")
    assert services_of("device") == ("node-agent", "profiler", "stage-worker", "tensor-shard-worker")
    assert services_of("edge") == ("node-agent", "profiler", "mec-manager")  # a node like any other, no stage-worker
    assert services_of("client") == ()
    assert service_class("stage-worker").__name__ == "StageWorkerService"
    assert issubclass(service_class("stage-worker"), WorkerService)
    with pytest.raises(ConfigError, match="unknown service 'nope'; available: checkpoint-store, coordinator"):
        service_entry("nope")
    # The old names still read from edgeswarm.services.
    from edgeswarm.services import SERVICES
    from edgeswarm.services import service_class as old_service_class

    assert SERVICES == services() and old_service_class is service_class
    assert service_class("gateway").__name__ == "GatewayService"


def test_topics_lists_every_installed_service_with_its_topics(install_plugin, capsys,  # type: ignore[no-untyped-def]
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # A plug-in service whose request writers are the defaults has no request row of its own in the tree: its
    # requests were listed nowhere.
    import argparse

    from edgeswarm.cli.status import run_topics

    install_plugin(f"toy-defaults = {PLUGIN}:DEFAULTS")
    assert "edgeswarm/node/{node}/toy-defaults/request/{sender}" not in {p.pattern for p in topics.topic_tree()}
    capsys.readouterr()
    from edgeswarm.cli.console import console

    monkeypatch.setattr(console, "width", 400)  # a row a line
    run_topics(argparse.Namespace(json=False))
    listed = " ".join(capsys.readouterr().out.split())
    for name in services():
        assert f"│ {name} │" in listed, name
    assert "edgeswarm/node/{node}/toy-defaults/request/{sender} │ hub: as {sender} only" in listed
    assert "edgeswarm/node/{node}/toy-defaults/data/{sender} │ hub, device, edge, client: as {sender} only" in listed


def test_an_entry_is_checked_where_it_is_made() -> None:
    with pytest.raises(ConfigError, match="node roles hub, device, edge"):
        ServiceEntry("a.b:C", ("client",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="node roles"):
        ServiceEntry("a.b:C", ())
    with pytest.raises(ConfigError, match="'module:Class'"):
        ServiceEntry("a.b.C", ("hub",))
    with pytest.raises(ConfigError, match="data_writers"):
        ServiceEntry("a.b:C", ("hub",), data_writers=("robot",))  # type: ignore[arg-type]


def test_a_plugin_service_joins_the_registry_the_topic_tree_and_the_acl(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(f"toy-manager = {PLUGIN}:ENTRY")
    assert service_names()[-1] == "toy-manager" and list(services())[-1] == "toy-manager"
    assert services_of("edge") == ("node-agent", "profiler", "mec-manager", "toy-manager")
    assert "toy-manager" not in services_of("device")
    assert service_class("toy-manager").__name__ == "ToyManager"
    assert "toy-manager" in compose_service_names()

    tree = {spec.pattern: spec for spec in topics.topic_tree()}
    requests = tree["edgeswarm/node/{node}/toy-manager/request/{sender}"]
    data = tree["edgeswarm/node/{node}/toy-manager/data/{sender}"]
    assert requests.writers == ("hub", "device") and data.writers == ("device",)
    assert data.purpose == "activations from the devices"
    assert topics.TOPIC_TREE == topics.topic_tree()  # the module attribute reads the same tree

    device = {(r.access, r.topic) for r in rules("pi-1", "device")}
    client = {(r.access, r.topic) for r in rules("alice", "client")}
    assert ("write", "edgeswarm/node/+/toy-manager/request/pi-1") in device
    assert ("write", "edgeswarm/node/+/toy-manager/data/pi-1") in device
    assert not {t for a, t in client if a == "write" and "/toy-manager/" in t}


def test_a_plugin_may_not_take_a_built_in_name(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(f"planner = {PLUGIN}:ENTRY")
    with pytest.raises(ConfigError, match="plug-in service 'planner' .* takes the name of a built-in service"):
        services()


def test_a_plugin_entry_must_name_a_service_entry(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(f"toy-manager = {PLUGIN}:NOT_AN_ENTRY\nbroken = {PLUGIN}.missing:ENTRY")
    with pytest.raises(ConfigError, match="service 'broken' comes from 'toy_edge_plugin.missing:ENTRY', which "
                                          "cannot be loaded"):
        services()
    assert "broken" in service_names()  # the names alone come from the metadata: nothing is imported for them
    # A broken plug-in stops what uses it, not the other services nor their start.
    assert service_class("stage-worker").__name__ == "StageWorkerService"
    assert {"broken", "toy-manager"} <= compose_service_names()
    with pytest.raises(ConfigError, match="which is a str, not an edgeswarm.service_registry.ServiceEntry"):
        service_class("toy-manager")


def test_an_edge_node_writes_only_what_its_role_may_and_only_as_itself() -> None:
    edge = {(r.access, r.topic) for r in rules("mec-0", "edge")}
    for topic in ("edgeswarm/node/mec-0/+/status", "edgeswarm/node/mec-0/+/heartbeat",
                  "edgeswarm/node/mec-0/profiler/progress", "edgeswarm/node/mec-0/profiler/profile/+",
                  "edgeswarm/node/mec-0/+/events",  # its services report a duplicate of their own node
                  "edgeswarm/node/+/checkpoint-store/request/mec-0",  # an edge server saves what it holds
                  "edgeswarm/node/+/profiler/data/mec-0",  # its profiler measures its links to the others
                  "edgeswarm/node/+/coordinator/data/mec-0",
                  "edgeswarm/node/+/stage-worker/data/mec-0"):  # split learning's tensors back to its devices
        assert ("write", topic) in edge, topic
    for topic in ("edgeswarm/node/+/stage-worker/request/mec-0",
                  "edgeswarm/node/+/coordinator/request/mec-0", "edgeswarm/job/+/state", "edgeswarm/cluster/view",
                  "edgeswarm/cluster/events"):
        assert ("write", topic) not in edge, topic
    assert ("read", "edgeswarm/node/mec-0/+/request/+") in edge
    assert not {t for a, t in edge if a == "read" and "/request/" in t and "mec-0" not in t}
    for access, topic in edge:  # nothing is ever written as anyone else
        levels = topic.split("/")
        if access == "write" and (levels[1] == "reply" or "request" in levels or "data" in levels):
            assert levels[-1] == "mec-0", topic
        elif access == "write" and levels[1] == "node":
            assert levels[2] == "mec-0", topic
    # A device may now also send its tensors to an edge server's profiler; the device's other rights are as before.
    device = {(r.access, r.topic) for r in rules("pi-1", "device")}
    assert ("write", "edgeswarm/node/+/stage-worker/data/pi-1") in device
    assert ("write", "edgeswarm/node/+/coordinator/request/pi-1") not in device


def test_credentials_take_the_edge_role(tmp_path: Path) -> None:
    from edgeswarm.cli.main import main

    assert main(["credentials", "--dir", str(tmp_path), "--hub", "hub", "--device", "pi-1", "--edge", "mec-0"]) == 0
    folder = CredentialsDir(tmp_path)
    assert folder.roster().members == {"hub": "hub", "pi-1": "device", "mec-0": "edge"}
    acl = folder.mosquitto_acl.read_text()
    assert "# mec-0: edge\nuser mec-0\n" in acl
    assert "topic write edgeswarm/node/mec-0/profiler/progress" in acl
    assert folder.password_file("mec-0").exists()
    with pytest.raises(ConfigError, match="unknown role 'robot'; a member is one of hub, device, edge, client"):
        folder.update(add={"r-1": "robot"})  # type: ignore[dict-item]


def test_a_cluster_file_names_its_edge_servers() -> None:
    spec = ClusterSpec.model_validate({
        "name": "with-mec", "devices": [{"id": "nano-0", "class": "jetson-nano"}, {"id": "pi-0", "class": "rpi4"}],
        "edges": [{"id": "mec-0", "class": "native"}],
        "links": [{"between": ["nano-0", "mec-0"], "bandwidth_mbps": 50, "latency_ms": 5}]})
    assert [d.id for d in spec.devices] == ["nano-0", "pi-0"] and [e.id for e in spec.edges] == ["mec-0"]
    assert [n.id for n in spec.nodes] == ["nano-0", "pi-0", "mec-0"]
    assert spec.links_from("nano-0")["mec-0"].bandwidth_bps == 50e6 / 8
    assert set(spec.links_from("mec-0")) == {"nano-0", "pi-0"}
    with pytest.raises(ValueError, match="node ids .* must be unique; repeated: \\['pi-0'\\]"):
        ClusterSpec.model_validate({"name": "x", "devices": [{"id": "pi-0", "class": "rpi4"}],
                                    "edges": [{"id": "pi-0", "class": "native"}]})
    grown = cluster_of(2).with_edges(2)
    assert [e.id for e in grown.edges] == ["edge-0", "edge-1"] and len(grown.devices) == 2
    assert [e.id for e in grown.with_edges(1).edges] == ["edge-0", "edge-1", "edge-2"]
    with pytest.raises(ConfigError, match="class 'no-such-class'"):
        cluster_of(1).with_edges(1, "no-such-class")


# --- the generic worker host ----------------------------------------------------------------------------------


class _ToyProgram:
    """A worker program that holds every job it gets a request for, and records what reaches it."""

    handles: tuple[type[m.Message], ...] = ()
    tensors: tuple[type[m.Message], ...] = ()

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.jobs: list[str] = []
        self.refused: list[tuple[str, str, str]] = []
        self.closed = False

    def job_of(self, body: m.Message) -> str:
        return str(getattr(body, "job_id", ""))

    def holds(self, job_id: str) -> bool:
        return job_id in self.jobs

    def on_request(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.jobs.append(self.job_of(msg.body))

    def on_tensor(self, msg) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("no tensors in this test")

    def refuse(self, msg, job_id: str, reason: str, detail: str) -> None:  # type: ignore[no-untyped-def]
        self.refused.append((job_id, reason, detail))

    def close(self) -> None:
        self.closed = True


class AbortTaker(_ToyProgram):
    handles = (StageAbort,)


class ReleaseTaker(_ToyProgram):
    handles = (ServeRelease,)


class ToyWorker(WorkerService):
    name = "toy-worker"

    def peer_wait_s(self) -> float:
        return 7.5

    def program_targets(self) -> list[str]:
        return [f"{__name__}:AbortTaker", f"{__name__}:ReleaseTaker"]


def _settings(node: str, broker: BrokerProcess) -> Settings:
    return Settings(node_id=node, hub_url=broker.url, heartbeat_interval_s=0.25, keepalive_s=5,
                    request_timeout_s=5.0, publish_timeout_s=5.0)


def test_the_worker_host_routes_by_schema_and_keeps_a_job_to_one_program(broker: BrokerProcess, make_bus) -> None:  # type: ignore[no-untyped-def]
    worker = ToyWorker(_settings("w0", broker))
    client = make_bus("cli", "cli")
    with running(worker):
        client.peers.wait_for("w0", "toy-worker", timeout_s=30)
        aborts, releases = worker.programs
        assert isinstance(aborts, AbortTaker) and isinstance(releases, ReleaseTaker)
        assert aborts.context is releases.context and aborts.context.wait_s == 7.5  # one context, one gate
        address = topics.request("w0", "toy-worker")
        client.publish(address, StageAbort(job_id="j1", epoch=0, round=0, reason="test"))
        wait_until(lambda: aborts.jobs == ["j1"], 10, message="the abort at its program")
        client.publish(address, ServeRelease(job_id="j1"))  # j1 is the other program's
        client.publish(address, ServeRelease(job_id="j2"))
        wait_until(lambda: releases.jobs == ["j2"] and releases.refused, 10, message="the releases")
        assert [(job, reason) for job, reason, _ in releases.refused] == [("j1", "bad_request")]
        assert "holds job j1 as AbortTaker, not ReleaseTaker" in releases.refused[0][2]
        assert aborts.jobs == ["j1"] and not aborts.refused
    assert aborts.closed and releases.closed


def test_the_stage_worker_hosts_the_programs_its_kinds_name() -> None:
    from edgeswarm.services.stage_worker.service import StageWorkerService
    from edgeswarm.workloads import worker_programs

    targets = StageWorkerService(Settings(node_id="w0")).program_targets()
    assert targets == worker_programs("stage-worker")
    assert "edgeswarm.hpp.worker:TrainingProgram" in targets
    assert "edgeswarm.pipeline_serve.worker:ServeStageProgram" in targets


def test_a_plugin_worker_service_with_no_program_starts(install_plugin, broker: BrokerProcess, make_bus) -> None:  # type: ignore[no-untyped-def]
    install_plugin(f"toy-manager = {PLUGIN}:ENTRY")
    manager = service_class("toy-manager")(_settings("mec-0", broker))
    client = make_bus("cli", "cli")
    with running(manager):
        client.peers.wait_for("mec-0", "toy-manager", timeout_s=30)
        reply = client.request(topics.request("mec-0", "toy-manager"), m.Probe(), timeout_s=10)
        assert isinstance(reply.body, m.ProbeReply)
        assert manager.programs == ()  # type: ignore[attr-defined]


def test_the_reference_topic_table_says_who_writes_each_topic_as_the_tree_does() -> None:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text().splitlines()
    for spec in topics.topic_tree():
        row = next(line for line in readme if line.startswith(f"| `{spec.pattern}` |"))
        assert row.split(" | ")[5] == spec.who_writes, f"docs/reference.md's row for {spec.pattern}: {row}"

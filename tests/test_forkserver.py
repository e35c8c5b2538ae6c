"""The fork server a local cluster starts its services from: a child is the service its request names, with that
request's environment and command line, and its end (status, signal) is reported; children die with the server."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeswarm.local.broker import BrokerProcess
from edgeswarm.local.forkserver import DIE_WITH_PARENT_ENV, NETNS_DIR, ForkServer, ForkServerError
from edgeswarm.procfs import read_cmdline
from edgeswarm.runtime.client import ClusterWatcher, client_bus
from edgeswarm.settings import Settings
from helpers import netns_unavailable, wait_until


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    forks = ForkServer(tmp_path / "forkserver.log")
    try:
        yield forks
    finally:
        forks.close()


def service_env(broker: BrokerProcess, node: str) -> dict[str, str]:
    # Nothing of this process's environment: a child sees only what its request carries.
    return {"PATH": os.environ.get("PATH", ""), "EDGESWARM_NODE_ID": node, "EDGESWARM_HUB_URL": broker.url,
            "EDGESWARM_HEARTBEAT_INTERVAL_S": "0.25"}


def test_a_child_is_the_service_its_request_names_with_that_environment(server: ForkServer, broker: BrokerProcess,
                                                                         tmp_path: Path) -> None:
    child = server.spawn("node-agent", service_env(broker, "forked-a"), tmp_path / "a.log")
    assert child.pid != server.pid
    # What ps and chaos's pid check read: the service, not the server (the child writes it first thing).
    wait_until(lambda: (read_cmdline(child.pid) or [])[-3:] == ["edgeswarm", "service", "node-agent"], 10,
               message="the child's command line")
    bus = client_bus(Settings(hub_url=broker.url))
    try:
        watcher = ClusterWatcher(bus)

        def online_pid() -> int | None:
            for node in watcher.view()[0].nodes:
                for service in node.services:
                    if node.node == "forked-a" and service.service == "node-agent" and service.state == "online":
                        return service.pid
            return None

        wait_until(lambda: online_pid() is not None, 60, message="the forked node-agent online as forked-a")
        assert online_pid() == child.pid
    finally:
        bus.stop()
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == 0
    log = (tmp_path / "a.log").read_text()
    assert "[forked-a/node-agent]" in log and "stopped" in log


def test_each_end_is_reported_with_its_status(server: ForkServer, tmp_path: Path) -> None:
    unknown = server.spawn("nosuch", {}, tmp_path / "unknown.log")
    assert unknown.wait(60) == 2  # a usage error, as from the command line
    assert "unknown service 'nosuch'" in (tmp_path / "unknown.log").read_text()
    killed = server.spawn("node-agent", {"EDGESWARM_HUB_URL": "mqtt://127.0.0.1:9"},
                          tmp_path / "killed.log")
    with pytest.raises(ForkServerError, match="cannot open its log"):
        server.spawn("node-agent", {}, tmp_path / "no-such-folder" / "x.log")
    with pytest.raises(subprocess.TimeoutExpired):
        killed.wait(0.2)
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL
    killed.kill()  # known to have ended: nothing is signalled (its pid may be another process's by now)


def test_children_die_with_the_server(server: ForkServer, broker: BrokerProcess, tmp_path: Path) -> None:
    child = server.spawn("node-agent", service_env(broker, "forked-b"), tmp_path / "b.log")
    wait_until(lambda: "started as instance" in (tmp_path / "b.log").read_text(errors="replace"), 60,
               message="the forked node-agent started")
    os.kill(server.pid, signal.SIGKILL)
    child.wait(30)  # its parent-death signal is SIGTERM: it stops as on any SIGTERM
    assert "stopped" in (tmp_path / "b.log").read_text()
    with pytest.raises(ForkServerError, match="fork server"):
        server.spawn("node-agent", {}, tmp_path / "late.log")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and read_cmdline(child.pid) is not None:
        time.sleep(0.05)
    assert read_cmdline(child.pid) is None


def test_the_server_loads_openmp_with_sleeping_waits_for_processes_sharing_the_cores(server: ForkServer) -> None:
    """OpenMP reads its wait policy once, when torch loads it in the server, and every child inherits it: threads
    that sleep at a barrier instead of spinning, since the children share this host's cores (a local cluster's
    services, with every service started through the launcher's environment)."""
    from edgeswarm.devices.compute import sharing_cores
    from edgeswarm.local.launcher import service_env as local_service_env

    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")  # a policy set for the whole run stays
    environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    assert f"OMP_WAIT_POLICY={policy}".encode() in environ, environ
    assert local_service_env("n", "mqtt://127.0.0.1:1", device_class="native")["OMP_WAIT_POLICY"] == policy
    assert sharing_cores({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}  # a user's choice stays


def test_a_childs_proc_environ_is_its_own_environment(server: ForkServer, tmp_path: Path) -> None:
    """What an operator (and the netns tests) read as a service's environment: its request's, not the server's."""
    env = {"EDGESWARM_HUB_URL": "mqtt://127.0.0.1:9", "EDGESWARM_NODE_ID": "env-a", "MARK": "x" * 3000,
           DIE_WITH_PARENT_ENV: "1"}
    child = server.spawn("node-agent", env, tmp_path / "env.log")
    try:
        def environ() -> dict[str, str]:
            raw = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
            return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

        wait_until(lambda: environ().get("EDGESWARM_NODE_ID") == "env-a", 10, message="the child's environ")
        assert environ() == {**env, DIE_WITH_PARENT_ENV: str(server.pid)}
    finally:
        child.kill()
        child.wait(30)


@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
def test_a_child_runs_in_the_network_namespace_its_request_names(server: ForkServer, tmp_path: Path) -> None:
    name = f"esfork{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        # A new namespace's loopback is down: the MQTT client cannot start there, and says so in one line.
        down = server.spawn("node-agent", {"EDGESWARM_HUB_URL": "mqtt://127.0.0.1:9"}, tmp_path / "down.log",
                            netns=name)
        assert down.wait(60) == 1
        assert "bring the loopback interface up" in (tmp_path / "down.log").read_text()
        assert "Traceback" not in (tmp_path / "down.log").read_text()
        # With it up the child lives, retrying a broker that refuses it, for as long as the check below needs.
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        child = server.spawn("node-agent", {"EDGESWARM_HUB_URL": "mqtt://127.0.0.1:9"}, tmp_path / "ns.log",
                             netns=name)
        try:
            pinned = os.stat(NETNS_DIR / name).st_ino
            wait_until(lambda: os.stat(f"/proc/{child.pid}/ns/net").st_ino == pinned, 10,
                       message="the child in the namespace")
            assert os.stat(f"/proc/{server.pid}/ns/net").st_ino != pinned  # the server stays where it was
        finally:
            child.kill()
            child.wait(30)
        missing = server.spawn("node-agent", {}, tmp_path / "missing.log", netns=f"{name}-none")
        assert missing.wait(60) == 1
        assert f"cannot enter network namespace {name}-none" in (tmp_path / "missing.log").read_text()
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)

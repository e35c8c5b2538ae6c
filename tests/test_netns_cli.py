"""``edgeswarm up --netns`` and the network chaos commands, as a user runs them: the refusal where the machine
cannot, one namespace cluster driven from the command line (status over TLS as ``operator``, cut and heal,
partition, a broker restart, pause and resume, clock skew), everything removed on Ctrl-C, and what a launcher
killed by SIGKILL left removed by the next start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeswarm.compose_env import services_for
from edgeswarm.netns import host, network
from edgeswarm.netns.state import saved_states
from helpers import netns_unavailable, wait_until

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def _faketime() -> bool:
    from edgeswarm.netns.clock import ClockSkewUnavailableError, find_libfaketime

    try:
        find_libfaketime()
    except ClockSkewUnavailableError:
        return False
    return True


SKEWABLE = ("--skewable", "native-1") if _faketime() else ()


needs_netns = pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")


def edgeswarm(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeswarm", *args], env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_up_netns_refuses_clearly_without_the_tools() -> None:
    bare = {**ENV, "PATH": str(Path(sys.executable).parent)}  # no ip, tc, nft or mosquitto
    done = edgeswarm("up", "--netns", "--devices", "1", env=bare)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    missing = r"ip, tc, nft, iptables, mosquitto not found on PATH \(apt-get install -y"
    assert re.search(missing, done.stderr), done.stderr
    both = edgeswarm("up", "--local", "--netns")
    assert both.returncode == 2 and "choose `edgeswarm up --local`" in both.stderr, both.stderr


def test_preflight_names_root() -> None:
    if os.geteuid() == 0:
        pytest.skip("runs as root here: the root check is the same line, proven by the message text below")
    with pytest.raises(host.NetnsUnavailableError, match="network namespaces need root"):
        host.preflight()


@needs_netns
def test_a_cluster_from_the_command_line_takes_every_network_fault_and_leaves_nothing(tmp_path: Path) -> None:
    work = tmp_path / "cluster"
    up = subprocess.Popen([sys.executable, "-m", "edgeswarm", "up", "--netns", "--devices", "2", "--device-class",
                           "native", "--workdir", str(work), "--heartbeat", "0.5", *SKEWABLE], env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if "cluster up" in line or up.poll() is not None:
                break
        text = "".join(lines)
        assert "cluster up" in text, text
        ours = [s for s in saved_states() if s.owner_pid == up.pid]
        assert len(ours) == 1, text
        state = ours[0]
        client = {**ENV, **dict(line.removeprefix("export ").split("=", 1)
                               for line in (work / "secrets" / "operator.env").read_text().splitlines())}
        client = {k: v.strip("'") for k, v in client.items()}
        status = edgeswarm("status", env=client)
        assert status.returncode == 0 and "native-1" in status.stdout and state.hub.address in status.stdout, status

        # The services run with compose's environment for their profile.
        device = state.node("native-0")
        composed = {s.name: s for s in services_for("device", {"EDGESWARM_NODE_ID": "native-0",
                                                               "EDGESWARM_DATA_URL": device.broker_url,
                                                               "EDGESWARM_HUB_URL": state.hub.broker_url,
                                                               "EDGESWARM_SECRETS": str(work / "secrets")})}
        worker_env = _environ(_pid_of(device.netns, "stage-worker"))
        for key, value in composed["stage-worker"].environment_on_host().items():
            if key not in ("EDGESWARM_DATA_CONNECT_URL", "EDGESWARM_HEALTH_DIR", "EDGESWARM_PROFILE_DIR",
                           "EDGESWARM_CHECKPOINT_DIR", "EDGESWARM_HEARTBEAT_INTERVAL_S"):
                assert worker_env.get(key) == value, key
        assert worker_env["EDGESWARM_DATA_CONNECT_URL"] == device.broker_url

        # --cluster: another test's namespace cluster may run beside this one
        ours = ("--cluster", state.run_id)
        cut = edgeswarm("chaos", "cut", "native-0", "--for", "1", *ours)
        assert cut.returncode == 0 and "native-0 (" in cut.stdout and "healed after 1 s" in cut.stdout, cut
        part = edgeswarm("chaos", "partition", "hub,native-0", "native-1", *ours)
        assert part.returncode == 0, part
        routes = host.run(["ip", "route", "show", "type", "blackhole"], ns=state.node("native-1").netns)
        assert state.hub.address in routes and device.address in routes
        assert edgeswarm("chaos", "heal-partition", *ours).returncode == 0
        assert not host.run(["ip", "route", "show", "type", "blackhole"], ns=state.node("native-1").netns).strip()
        restart = edgeswarm("chaos", "restart-broker", "hub", "--down", "0.5", *ours)
        assert restart.returncode == 0 and "the broker of hub restarted" in restart.stdout, restart
        link = edgeswarm("chaos", "link", "native-0", "native-1", "--loss", "5", "--delay", "3", "--for", "1", *ours)
        assert link.returncode == 0 and "loss 5%, delay 3 ms" in link.stdout and "put back" in link.stdout, link
        bad = edgeswarm("chaos", "link", "native-0", "native-1", "--loss", "150", *ours)
        assert bad.returncode == 2 and "--loss is a percentage" in bad.stderr, bad
        pause = edgeswarm("chaos", "pause", "native-1", "--for", "1", *ours)
        assert pause.returncode == 0 and "resumed after 1 s" in pause.stdout, pause
        unknown = edgeswarm("chaos", "cut", "nope", *ours)
        assert unknown.returncode == 1 and "unknown node 'nope'; nodes: hub, native-0, native-1" in unknown.stderr
        refused = edgeswarm("chaos", "skew", "native-0", "30", *ours)
        assert refused.returncode == 1 and "--skewable native-0" in refused.stderr, refused
        skew = edgeswarm("chaos", "skew", "native-1", "30", *ours)
        if SKEWABLE:
            assert skew.returncode == 0, skew
            assert (work / "nodes" / "native-1" / "clock").read_text().strip().startswith("+30")
            # The node's own processes read the skewed clock: its node-agent's heartbeats are stamped 30 s ahead.
            agent = _pid_of(state.node("native-1").netns, "node-agent")
            assert _environ(agent)["FAKETIME_TIMESTAMP_FILE"].endswith("native-1/clock")
            wait_until(lambda: _heartbeat_ahead(client, "native-1") > 25, 20, interval_s=0.5,
                       message="native-1's heartbeats stamped 30 s ahead")
            assert edgeswarm("chaos", "skew", "native-1", "0", *ours).returncode == 0
        # After all of it the cluster is whole again: every device's services back online.
        wait_until(lambda: edgeswarm("status", env=client).stdout.count("stage-worker") == 2, 60, interval_s=1.0,
                   message="both stage-workers online after the faults")
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0 and "stopped" in out, out
    assert not {n.netns for n in state.nodes} & set(host.netns_names())
    assert not any(s.owner_pid == up.pid for s in saved_states())
    assert not host.run(["ip", "link", "show", state.bridge], check=False).strip()


@needs_netns
def test_what_a_killed_launcher_left_is_removed_by_the_next_start(tmp_path: Path) -> None:
    up = subprocess.Popen([sys.executable, "-m", "edgeswarm", "up", "--netns", "--devices", "1", "--device-class",
                           "native", "--workdir", str(tmp_path / "w")], env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        state = wait_until(lambda: next((s for s in saved_states() if s.owner_pid == up.pid), None), 60,
                           message="the launcher's state file")
        wait_until(lambda: all(n.netns in host.netns_names() for n in state.nodes) and
                   network.pids_in(state.nodes[-1].netns), 60, message="the namespaces and their processes")
    finally:
        up.kill()
        up.wait(10)
    assert all(n.netns in host.netns_names() for n in state.nodes)  # left behind by the crash
    removed = network.clean_stale()
    assert state.run_id in removed
    assert not any(n.netns in host.netns_names() for n in state.nodes)
    assert not state.path().exists()
    assert not host.run(["ip", "link", "show", state.bridge], check=False).strip()


def _heartbeat_ahead(client: dict[str, str], node: str) -> float:
    """How far ahead of this machine's clock ``node``'s node-agent stamps its heartbeat (seconds)."""
    from edgeswarm import topics
    from edgeswarm.messages import Heartbeat
    from edgeswarm.runtime.client import client_bus, settings_from_env

    bus = client_bus(settings_from_env(client))
    got: list[float] = []
    try:
        bus.subscribe(topics.heartbeat(node, "node-agent"),
                      lambda m: got.append(m.envelope.sent_at - time.time()), schemas=(Heartbeat,))
        wait_until(lambda: len(got) >= 2, 10, message=f"{node}'s heartbeats")
    finally:
        bus.stop()
    return got[-1]


def _pid_of(netns: str, service: str) -> int:
    for pid in network.pids_in(netns):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"service" in cmd and service.encode() in cmd:
            return pid
    raise AssertionError(f"no {service} in {netns}")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_cluster_belongs_to_its_launcher_process_not_to_its_pid() -> None:
    """What decides that a saved cluster is a dead launcher's (and is removed): its pid and that process's start
    time, whatever the process is (a pytest-xdist worker has neither "pytest" nor "edgeswarm" in its command line)."""
    from edgeswarm.netns.state import NetnsState, owner_alive, process_start_ticks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state = NetnsState(run_id="abcd", owner_pid=child.pid, owner_started=process_start_ticks(child.pid),
                           subnet="10.123.7.0/24", bridge="esabcdbr", workdir="/nonexistent", nodes=[])
        assert owner_alive(state)
        assert not owner_alive(state.model_copy(update={"owner_started": (state.owner_started or 0) + 1}))
    finally:
        child.kill()
        child.wait(10)
    assert not owner_alive(state)

"""``edgeswarm up --netns`` and the network chaos commands, as a user runs them: the refusal where the machine
cannot, one namespace cluster driven from the command line (status over TLS as ``operator``, cut and heal,
partition, a broker restart, pause and resume, clock skew, link changes measured with sockets between the
namespaces), everything removed on Ctrl-C, and what a launcher killed by SIGKILL left removed by the next start.

The command-line cluster is shared by the tests in file order (a module fixture); the last one stops it."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgeswarm.compose_env import services_for
from edgeswarm.netns import host, network
from edgeswarm.netns.state import NetnsNode, NetnsState, saved_states
from edgeswarm.procfs import read_cmdline
from helpers import REPO, netns_unavailable, wait_until

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
PROBE = str(Path(__file__).with_name("netns_probe.py"))
# The cluster file of the command-line cluster: the devices' link is shaped (rate and delay), the hub's is not.
LINK_MBIT, LINK_DELAY_MS = 20, 2
CLUSTER_FILE = f"""name: cli-netns
network: {{bandwidth_mbps: {LINK_MBIT}, latency_ms: {LINK_DELAY_MS}}}
devices:
  - {{id: native-0, class: native}}
  - {{id: native-1, class: native}}
"""


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


@dataclass
class CliCluster:
    """A cluster started as ``edgeswarm up --netns`` with CLUSTER_FILE, and the operator's environment for it."""

    up: subprocess.Popen[str]
    state: NetnsState
    client: dict[str, str]
    work: Path
    output: str = ""

    def chaos(self, *args: str) -> subprocess.CompletedProcess[str]:
        # --cluster: another test's namespace cluster may run beside this one
        return edgeswarm("chaos", *args, "--cluster", self.state.run_id)

    def stop(self) -> None:
        """Ctrl-C, as a user stops it (idempotent); what it printed is kept in ``output``."""
        if self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            out, _ = self.up.communicate(timeout=60)
            self.output += out


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliCluster]:
    if netns_unavailable() is not None:
        pytest.skip(netns_unavailable() or "")
    root = tmp_path_factory.mktemp("cli-netns")
    (root / "cluster.yaml").write_text(CLUSTER_FILE)
    work = root / "cluster"
    up = subprocess.Popen([sys.executable, "-m", "edgeswarm", "up", "--netns", "--devices", str(root / "cluster.yaml"),
                           "--workdir", str(work), "--heartbeat", "0.5", *SKEWABLE], env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cluster: CliCluster | None = None
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
        # What a user needs next, printed: the run id for --cluster, the exact line to source.
        assert f"--cluster {ours[0].run_id}` picks this cluster" in text, text
        assert f"`. {work / 'secrets' / 'operator.env'}`" in text, text
        client = {**ENV, **dict(line.removeprefix("export ").split("=", 1)
                               for line in (work / "secrets" / "operator.env").read_text().splitlines())}
        client = {k: v.strip("'") for k, v in client.items()}
        cluster = CliCluster(up, ours[0], client, work)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        elif up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=60)


@needs_netns
def test_a_cluster_from_the_command_line_takes_every_network_fault(cli: CliCluster) -> None:
    state, client, work = cli.state, cli.client, cli.work
    status = edgeswarm("status", env=client)
    assert status.returncode == 0 and "native-1" in status.stdout and state.hub.address in status.stdout, status
    # docs/netns.md's mosquitto_sub line, as written there, against the hub's TLS broker (one message is enough).
    doc = (REPO / "docs" / "netns.md").read_text()
    line = "hub=${EDGESWARM_HUB_URL" + doc.split("hub=${EDGESWARM_HUB_URL", 1)[1].split("-t 'edgeswarm/#'", 1)[0]
    sub = subprocess.run(["bash", "-c", line + "-t 'edgeswarm/#' -C 1 -W 20"], env=client, capture_output=True,
                         timeout=60)  # the payloads are msgpack: bytes
    assert sub.returncode == 0 and sub.stdout.startswith(b"edgeswarm/"), sub

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


def _probe(node: NetnsNode, *args: str) -> dict:
    """tests/netns_probe.py run as a client in ``node``'s namespace; its JSON result."""
    done = subprocess.run(["ip", "netns", "exec", node.netns, sys.executable, PROBE, *args], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _serving(node: NetnsNode, *args: str) -> subprocess.Popen[str]:
    """tests/netns_probe.py as a server in ``node``'s namespace, once it listens (stopped by its caller, by PID)."""
    proc = subprocess.Popen(["ip", "netns", "exec", node.netns, sys.executable, PROBE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _round_trips(src: NetnsNode, dst: NetnsNode, port: int, count: int = 15) -> list[float]:
    """Round trips (seconds) of 64-byte TCP exchanges from ``src`` to an echo on ``dst``."""
    server = _serving(dst, "echo", dst.address, str(port), "15")
    try:
        return _probe(src, "ping", dst.address, str(port), str(count))["rtts"]
    finally:
        server.kill()
        server.communicate(timeout=10)


def _rate(src: NetnsNode, dst: NetnsNode, port: int, seconds: float = 1.5) -> float:
    """The median rate (bytes/s) a TCP stream from ``src`` is received at on ``dst``."""
    server = _serving(dst, "sink", dst.address, str(port), "15")
    try:
        _probe(src, "send", dst.address, str(port), str(seconds))
        out, err = server.communicate(timeout=20)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate(timeout=10)
    rates = json.loads(out.strip().splitlines()[-1])["rates"]
    assert rates, err
    return statistics.median(rates)


@needs_netns
def test_a_link_change_alters_only_what_it_names_and_outlives_the_chaos_command(cli: CliCluster) -> None:
    from edgeswarm.netns import faults
    from edgeswarm.netns.shaping import LinkShape

    state = cli.state
    zero, one, hub = state.node("native-0"), state.node("native-1"), state.hub
    delay_s, rate_bps = LINK_DELAY_MS / 1000, LINK_MBIT * 1e6 / 8
    filed = LinkShape(rate_bps=rate_bps, delay_s=delay_s)  # what the cluster file gives the devices' link
    assert min(_round_trips(zero, one, 5101)) >= 2 * delay_s * 0.9

    # 1% loss for a while, the rest of the link named nowhere: its rate and delay stay, in the kernel.
    chaos = subprocess.Popen([sys.executable, "-m", "edgeswarm", "chaos", "link", "native-0", "native-1", "--loss",
                              "1", "--for", "5", "--cluster", state.run_id], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert chaos.stdout is not None
        said = chaos.stdout.readline()
        assert "loss 1%" in said, said + (chaos.stderr.read() if chaos.stderr else "")
        during = {name: faults.shaper_of(state, name).shapes for name in ("native-0", "native-1")}
        during_rtts = _round_trips(zero, one, 5102)
        during_rate = _rate(zero, one, 5103)
    finally:
        out, err = chaos.communicate(timeout=60)
    assert chaos.returncode == 0 and "put back after 5 s" in out, out + err
    assert min(during_rtts) >= 2 * delay_s * 0.9, during_rtts  # the delay stayed (0 had it been dropped)
    # The rate stayed: a stream is held to it (a dropped rate lets it run at the machine's speed, 100s of Mbit/s).
    assert during_rate <= 1.15 * rate_bps, f"{during_rate * 8 / 1e6:.1f} Mbit/s on a {LINK_MBIT} Mbit/s link"
    assert during["native-0"][one.address] == during["native-1"][zero.address] == filed.model_copy(
        update={"loss": 0.01})
    # --for put back exactly the shape before, at both ends.
    assert faults.shaper_of(state, "native-0").shapes[one.address] == filed
    assert faults.shaper_of(state, "native-1").shapes[zero.address] == filed

    # The hub's link, delayed by a chaos command that then exits: the delay is the cluster's, at both ends, and
    # stays (the hub's delay line used to be the chaos process's, and ended with it).
    assert cli.chaos("link", "hub", "native-0", "--delay", "10").returncode == 0
    time.sleep(1.5)  # a delay line checks on its owner every 0.5 s
    hub_rtts = _round_trips(hub, zero, 5104)
    assert min(hub_rtts) >= 2 * 0.010 * 0.9, hub_rtts
    assert cli.chaos("link", "hub", "native-0", "--delay", "0").returncode == 0
    assert min(_round_trips(hub, zero, 5105)) < 0.005
    nothing = cli.chaos("link", "native-0", "native-1")
    assert nothing.returncode == 2 and "name what to change" in nothing.stderr, nothing


@needs_netns
def test_ctrl_c_stops_the_cluster_and_leaves_nothing(cli: CliCluster) -> None:
    cli.stop()
    state = cli.state
    assert cli.up.returncode == 0 and "stopped" in cli.output, cli.output
    assert not {n.netns for n in state.nodes} & set(host.netns_names())
    assert not any(s.owner_pid == cli.up.pid for s in saved_states())
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
        cmd = read_cmdline(pid) or []
        if "service" in cmd and service in cmd:
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

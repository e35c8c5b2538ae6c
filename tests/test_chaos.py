"""``edgeswarm chaos``: target selection and its refusals, the pid checks, the duty cycle of ``slow``, and every
action against a real local cluster (``edgeswarm up --local`` over Mosquitto)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgeswarm.bus import Bus
from edgeswarm.cli.chaos import ChaosRefused, Target, check_process, do_slow, hold, select_targets
from edgeswarm.cli.main import main
from edgeswarm.local.launcher import DEVICE_SERVICES, HUB_SERVICES
from edgeswarm.messages import ClusterView, NodeView, ServiceView
from edgeswarm.procfs import ProcStat, read_cmdline, read_stat
from edgeswarm.runtime.client import ClusterWatcher, client_bus
from edgeswarm.settings import Settings
from helpers import wait_until
from test_cli import Up, edgeswarm

# Not stopped by SIGSTOP (T) nor gone: waiting on a disk write (D) is running too, as the profiler was once in CI.
RUNNING = ("R", "S", "D")

HOST = "this-host"

# --- selection from the view (pure) -----------------------------------------------------------------


def view_of(nodes: dict[str, list[tuple[str, str, int]]]) -> ClusterView:
    """A view of ``{node: [(service, host, pid), ...]}``, everything online."""
    return ClusterView(generated_at=time.time(), heartbeat_timeout_factor=3.0, nodes=tuple(
        NodeView(node=node, state="online", device_class="native", memory_budget_bytes=0, free_memory_bytes=0,
                 services=tuple(ServiceView(service=svc, instance=f"{node}-{svc}", state="online", version="0",
                                            host=host, pid=pid, data_url="", heartbeat_age_s=0.1, started_at=0.0)
                                for svc, host, pid in services))
        for node, services in nodes.items()))


VIEW = view_of({
    "hub": [("checkpoint-store", HOST, 101), ("coordinator", HOST, 102), ("planner", HOST, 103)],
    "nano-0": [("node-agent", HOST, 201), ("profiler", HOST, 202), ("stage-worker", HOST, 203)],
    "far-0": [("node-agent", "elsewhere", 301)],
    "new-0": [("node-agent", "unknown", 0), ("stage-worker", HOST, 401)],
})


def test_an_unknown_node_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ChaosRefused, match="unknown node 'nope'; known nodes: hub, nano-0, far-0, new-0"):
        select_targets(VIEW, "nope", None, hostname=HOST)
    with pytest.raises(ChaosRefused, match="known nodes: none"):
        select_targets(view_of({}), "nope", None, hostname=HOST)


def test_a_node_on_another_host_is_refused() -> None:
    with pytest.raises(ChaosRefused, match="chaos works on a local cluster only: far-0 runs on host elsewhere"):
        select_targets(VIEW, "far-0", None, hostname=HOST)


def test_the_coordinators_node_needs_the_services_named() -> None:
    with pytest.raises(ChaosRefused, match="runs the coordinator.*--service coordinator"):
        select_targets(VIEW, "hub", None, hostname=HOST)
    targets, _ = select_targets(VIEW, "hub", ["coordinator"], hostname=HOST)
    assert [(t.service, t.pid) for t in targets] == [("coordinator", 102)]
    targets, _ = select_targets(VIEW, "hub", ["planner", "checkpoint-store"], hostname=HOST)
    assert sorted(t.pid for t in targets) == [101, 103]


def test_services_pids_and_unknown_instances() -> None:
    targets, notes = select_targets(VIEW, "nano-0", None, hostname=HOST)
    assert [(t.service, t.pid) for t in targets] == [("node-agent", 201), ("profiler", 202), ("stage-worker", 203)]
    assert notes == []
    targets, _ = select_targets(VIEW, "nano-0", ["stage-worker"], hostname=HOST)
    assert [t.pid for t in targets] == [203]
    with pytest.raises(ChaosRefused, match="node nano-0 runs no bogus; its services: node-agent, profiler, stage"):
        select_targets(VIEW, "nano-0", ["bogus"], hostname=HOST)
    # Our own pid (or our parent's) is never a target; an instance known only from heartbeats has no pid.
    targets, notes = select_targets(VIEW, "nano-0", None, hostname=HOST, never=frozenset({202}))
    assert [t.pid for t in targets] == [201, 203] and "pid 202 is this command or its parent" in notes[0]
    targets, notes = select_targets(VIEW, "new-0", None, hostname=HOST)
    assert [t.pid for t in targets] == [401] and "no status seen yet" in notes[0]
    with pytest.raises(ChaosRefused, match="nothing to signal on node nano-0"):
        select_targets(VIEW, "nano-0", ["profiler"], hostname=HOST, never=frozenset({202}))


def test_usage_errors_exit_2_before_anything_is_contacted(capsys: pytest.CaptureFixture[str]) -> None:
    unreachable = "mqtt://127.0.0.1:9"
    assert main(["chaos", "slow", "nano-0", "--factor", "1", "--for", "1", "--hub", unreachable]) == 2
    assert "--factor must be greater than 1" in capsys.readouterr().err
    assert main(["chaos", "stop", "nano-0", "--for", "0", "--hub", unreachable]) == 2
    assert main(["chaos", "slow", "nano-0", "--factor", "4", "--for", "1", "--period", "0", "--hub", unreachable]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["chaos", "slow", "nano-0", "--for", "1"])
    assert exc.value.code == 2


# --- pid checks and the duty cycle, on plain processes ----------------------------------------------


def spawn(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def stat(pid: int) -> ProcStat:
    st = read_stat(pid)
    assert st is not None, f"no process {pid}"
    return st


def cpu_s(pid: int) -> float:
    return stat(pid).cpu_ticks / os.sysconf("SC_CLK_TCK")


def target(pid: int, service: str = "stage-worker", started_at: float | None = None) -> Target:
    return Target(node="n", service=service, instance="i", host=HOST, pid=pid,
                  started_at=time.time() if started_at is None else started_at, state="online")


def test_only_a_live_edgeswarm_process_of_that_service_that_started_in_time_passes() -> None:
    other = spawn("sleep", "30")
    mimic = spawn(sys.executable, "-c", "import time; time.sleep(30)", "edgeswarm", "stage-worker")
    try:
        time.sleep(0.2)
        assert "not edgeswarm's stage-worker" in (check_process(target(other.pid))[1] or "")
        assert check_process(target(mimic.pid))[1] is None
        assert "not edgeswarm's profiler" in (check_process(target(mimic.pid, "profiler"))[1] or "")
        # A process that started long after the instance did holds a recycled pid.
        assert "recycled pid" in (check_process(target(mimic.pid, started_at=time.time() - 3600))[1] or "")
        with pytest.raises(ChaosRefused, match="no running process of node n to signal"):
            hold([target(other.pid)])
    finally:
        for p in (other, mimic):
            p.kill()
            p.wait(5)
    assert check_process(target(mimic.pid))[1] == "not running"


def test_slow_gives_a_busy_process_about_one_fth_of_the_cpu_and_leaves_it_running() -> None:
    busy = spawn(sys.executable, "-c", "while True: pass", "edgeswarm", "stage-worker")
    try:
        time.sleep(0.3)
        held, _ = hold([target(busy.pid)])
        before, t0 = cpu_s(busy.pid), time.monotonic()
        assert do_slow(held, factor=4, for_s=1.0) == 0
        elapsed, used = time.monotonic() - t0, cpu_s(busy.pid) - before
        assert 0.9 <= elapsed < 3.0
        assert 0 < used < 0.6, f"a 4x slow-down let it use {used:.2f} s of CPU in {elapsed:.2f} s"
        assert stat(busy.pid).state in RUNNING
        after = cpu_s(busy.pid)
        time.sleep(0.3)
        assert cpu_s(busy.pid) > after, "it runs again"
    finally:
        os.kill(busy.pid, signal.SIGCONT)
        busy.kill()
        busy.wait(5)


# --- against a local cluster ------------------------------------------------------------------------


@dataclass
class Cluster:
    up: Up
    watcher: ClusterWatcher
    pids: dict[tuple[str, str], int]  # (node, service) -> pid

    @property
    def url(self) -> str:
        return self.up.url

    def state(self, node: str, service: str) -> str | None:
        nv = self.watcher.view()[0].node(node)
        return next((s.state for s in nv.services if s.service == service), None) if nv else None

    def node_pids(self, node: str) -> list[int]:
        return [pid for (n, _), pid in self.pids.items() if n == node]


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie counts as gone)."""
    st = read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def state_of(pid: int) -> str:
    return stat(pid).state


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two emulated devices (tx2-0, nano-1) and the hub. A long MQTT keepalive keeps a stopped service
    *suspect* (no Last Will) for the whole test. Every service is resumed before the cluster is stopped."""
    up = Up(tmp_path_factory.mktemp("chaos"), "--devices", "2", env={"EDGESWARM_KEEPALIVE_S": "30"})
    bus: Bus | None = None
    pids: dict[tuple[str, str], int] = {}
    try:
        up.status(devices=2)  # waits for the broker and the node agents
        bus = client_bus(Settings(hub_url=up.url))
        watcher = ClusterWatcher(bus)
        expected = {("hub", s) for s in HUB_SERVICES} | {(n, s) for n in ("tx2-0", "nano-1") for s in DEVICE_SERVICES}

        def all_online() -> bool:
            view = watcher.view()[0]
            online = {(n.node, s.service): s.pid for n in view.nodes for s in n.services if s.state == "online"}
            pids.update(online)
            return expected <= set(online)

        wait_until(all_online, 60, interval_s=0.2, message="every service online")
        yield Cluster(up, watcher, pids)
    finally:
        for pid in pids.values():
            with suppress(OSError):  # a stopped process would only die of SIGKILL after a timeout
                if alive(pid) and any("edgeswarm" in a for a in read_cmdline(pid) or []):
                    os.kill(pid, signal.SIGCONT)
        if bus is not None:
            bus.stop()
        up.stop()


def test_refusals_exit_1_and_signal_nothing(cluster: Cluster) -> None:
    result = edgeswarm("chaos", "kill", "nosuch", "--hub", cluster.url, check=False)
    assert result.returncode == 1, result.stderr
    assert "unknown node 'nosuch'; known nodes:" in result.stderr
    for node in ("hub", "tx2-0", "nano-1"):
        assert node in result.stderr
    result = edgeswarm("chaos", "kill", "hub", "--hub", cluster.url, check=False)
    assert result.returncode == 1 and "runs the coordinator" in result.stderr and "--service" in result.stderr
    result = edgeswarm("chaos", "stop", "tx2-0", "--service", "bogus", "--hub", cluster.url, check=False)
    assert result.returncode == 1 and "runs no bogus" in result.stderr
    everything = list(cluster.pids.values())
    assert all(alive(pid) and state_of(pid) != "T" for pid in everything)


def test_stop_makes_a_service_suspect_and_cont_brings_it_back(cluster: Cluster) -> None:
    pid = cluster.pids[("tx2-0", "stage-worker")]
    try:
        result = edgeswarm("chaos", "stop", "tx2-0", "--service", "stage-worker", "--hub", cluster.url)
        assert f"stopped stage-worker on tx2-0 (pid {pid})" in result.stdout
        assert "edgeswarm chaos cont tx2-0" in result.stdout
        assert state_of(pid) == "T"
        assert state_of(cluster.pids[("tx2-0", "node-agent")]) != "T", "only the service asked for"
        wait_until(lambda: cluster.state("tx2-0", "stage-worker") == "suspect", 15, interval_s=0.1,
                   message="the stopped stage-worker to turn suspect")
        result = edgeswarm("chaos", "cont", "tx2-0", "--hub", cluster.url)
        assert f"resumed stage-worker on tx2-0 (pid {pid})" in result.stdout
        assert state_of(pid) != "T"
        wait_until(lambda: cluster.state("tx2-0", "stage-worker") == "online", 15, interval_s=0.1,
                   message="the resumed stage-worker to come back online")
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


def test_stop_for_resumes_by_itself(cluster: Cluster) -> None:
    t0 = time.monotonic()
    result = edgeswarm("chaos", "stop", "tx2-0", "--for", "0.5", "--hub", cluster.url, timeout=30)
    assert time.monotonic() - t0 >= 0.5
    assert result.stdout.count("resumed") == len(DEVICE_SERVICES)
    assert all(state_of(pid) != "T" for pid in cluster.node_pids("tx2-0"))


def test_slow_returns_after_the_duration_and_leaves_the_node_running(cluster: Cluster) -> None:
    t0 = time.monotonic()
    result = edgeswarm("chaos", "slow", "tx2-0", "--factor", "4", "--for", "1", "--hub", cluster.url, timeout=30)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 20, elapsed
    assert "4x for 1 s" in result.stdout and result.stdout.count("left running") == len(DEVICE_SERVICES)
    for pid in cluster.node_pids("tx2-0"):
        assert state_of(pid) in RUNNING, f"pid {pid} is {state_of(pid)}"
    wait_until(lambda: all(cluster.state("tx2-0", s) == "online" for s in DEVICE_SERVICES), 15,
               message="tx2-0 online after the slow-down")


def test_kill_ends_every_process_of_the_node_and_nothing_else(cluster: Cluster) -> None:
    victims = cluster.node_pids("nano-1")
    survivors = [pid for (node, _), pid in cluster.pids.items() if node != "nano-1"]
    result = edgeswarm("chaos", "kill", "nano-1", "--hub", cluster.url)
    for service in DEVICE_SERVICES:
        assert f"killed {service} on nano-1 (pid {cluster.pids[('nano-1', service)]})" in result.stdout
    # Gone, not merely zombies: `edgeswarm up` notices and reaps its children within a second or so.
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in victims), 10,
               message="nano-1's processes gone")
    assert all(alive(pid) for pid in survivors)
    wait_until(lambda: all(cluster.state("nano-1", s) in ("offline", "suspect") for s in DEVICE_SERVICES), 15,
               interval_s=0.1, message="nano-1's services offline or suspect in the view")
    assert all(cluster.state("tx2-0", s) == "online" for s in DEVICE_SERVICES)
    # Nothing is left to kill: refused, not an error in the dark.
    result = edgeswarm("chaos", "kill", "nano-1", "--hub", cluster.url, check=False)
    assert result.returncode == 1 and "not running" in result.stderr

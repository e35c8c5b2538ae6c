"""Service processes: status, heartbeat, probe, metrics, Last Will, hung nodes and duplicate node ids."""

from __future__ import annotations

import os
import signal
import time

import pytest

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.runtime.client import ClusterWatcher
from edgeswarm.wire import Sender, encode
from helpers import wait_until

KEEPALIVE_S = 2  # FAST_ENV in helpers.py


def latest(bus: Bus, topic: str, schema: type[m.Message]) -> list[Inbound]:
    got: list[Inbound] = []
    bus.subscribe(topic, got.append, schemas=(schema,))
    return got


def start_online(services, broker: BrokerProcess, make_bus, node: str, **env: str):
    """Start a node agent on ``node`` and wait until its retained status says online.

    Returns the process and the list that keeps collecting its statuses.
    """
    proc = services.start("node-agent", node, broker.url, **env)
    statuses = latest(make_bus(f"watch-{node}", "cli"), topics.status(node, "node-agent"), m.Status)
    wait_until(lambda: statuses and statuses[-1].body.state == "online", 20, message=f"{node} online")
    return proc, statuses


def service_state(watcher: ClusterWatcher, node: str, service: str) -> str | None:
    view, _ = watcher.view()
    n = view.node(node)
    states = [s.state for s in n.services if s.service == service] if n else []
    return states[0] if len(states) == 1 else None


def coordinator_says(watcher: ClusterWatcher, node: str, state: str) -> bool:
    """Whether the coordinator's view (not the fallback from retained topics) has ``node``'s agent in ``state``."""
    return watcher.view()[1] == "coordinator" and service_state(watcher, node, "node-agent") == state


def test_a_service_announces_itself_beats_answers_probes_and_says_goodbye(broker: BrokerProcess, services,
                                                                          make_bus) -> None:
    watch = make_bus("watch", "cli")
    beats = latest(watch, topics.heartbeat("nano-1", "node-agent"), m.Heartbeat)
    metrics = latest(watch, topics.metrics("nano-1", "node-agent"), m.MetricsReport)
    proc, statuses = start_online(services, broker, make_bus, "nano-1", EDGESWARM_DEVICE_CLASS="jetson-nano")
    status = statuses[-1].body
    assert status.device_class == "jetson-nano" and status.pid == proc.pid
    assert status.data_url == broker.url and 0 < status.memory_budget_bytes <= 3 * 2**30
    # The first report may go out before anything arrived; the bus's gauges are in from its first second on.
    wait_until(lambda: len(beats) >= 3 and metrics and metrics[-1].body.gauges, 10, message="heartbeats and metrics")
    assert [b.body.seq for b in beats[-2:]] == sorted(b.body.seq for b in beats[-2:])
    assert beats[-1].envelope.expires_at is not None
    assert "inbox_depth" in metrics[-1].body.gauges

    reply = watch.request(topics.request("nano-1", "node-agent"), m.Probe(), timeout_s=5)
    assert isinstance(reply.body, m.ProbeReply) and reply.body.healthy
    assert reply.body.instance == status.instance

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    wait_until(lambda: statuses[-1].body.state == "offline", 10, message="offline status")
    assert statuses[-1].body.reason == "shutdown"


def test_sigkill_leaves_an_offline_status_within_the_keepalive_bound(broker: BrokerProcess, services,
                                                                     make_bus) -> None:
    proc, statuses = start_online(services, broker, make_bus, "tx2-0")
    proc.kill()
    killed_at = time.monotonic()
    wait_until(lambda: statuses[-1].body.state == "offline", 1.5 * KEEPALIVE_S + 2, message="Last Will")
    assert time.monotonic() - killed_at <= 1.5 * KEEPALIVE_S + 2
    assert statuses[-1].body.reason == "connection lost"
    late = make_bus("late", "cli")  # a subscriber that arrives afterwards reads the retained Will
    retained = latest(late, topics.status("tx2-0", "node-agent"), m.Status)
    wait_until(lambda: retained, 5, message="retained status")
    assert retained[0].retained and retained[0].body.state == "offline"


def test_a_stopped_node_turns_suspect_then_offline(broker: BrokerProcess, services, make_bus) -> None:
    services.start("coordinator", "hub", broker.url)
    agent = services.start("node-agent", "nano-2", broker.url)
    events = latest(make_bus("events", "cli"), topics.CLUSTER_EVENTS, m.ClusterEvent)
    watcher = ClusterWatcher(make_bus("watch", "cli"))
    wait_until(lambda: coordinator_says(watcher, "nano-2", "online"), 20, message="online in the coordinator's view")
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_until(lambda: service_state(watcher, "nano-2", "node-agent") == "suspect", 6, message="suspect")
        assert time.monotonic() - stopped < 0.25 * 3 + 3
        wait_until(lambda: service_state(watcher, "nano-2", "node-agent") == "offline", 1.5 * KEEPALIVE_S + 6,
                   message="offline after the broker's keep-alive expires")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    # The events come on their own topic, a moment after the view that the waits above read.
    wait_until(lambda: {"service_suspect", "service_offline"} <= {e.body.kind for e in events
                                                                    if e.body.node == "nano-2"}, 10,
               message="the suspect and offline events")


def test_a_second_instance_with_the_same_node_id_refuses_to_start(broker: BrokerProcess, services,
                                                                   make_bus) -> None:
    first, statuses = start_online(services, broker, make_bus, "nano-3")
    second = services.start("node-agent", "nano-3", broker.url)
    assert second.wait(20) == 3
    assert "already runs node-agent as live instance" in services.log_of(second)
    assert first.poll() is None
    assert statuses[-1].body.instance == statuses[0].body.instance, "the first instance's status stands"


def test_a_duplicate_that_appears_later_is_reported_not_merged(broker: BrokerProcess, services, make_bus) -> None:
    services.start("coordinator", "hub", broker.url)
    services.start("node-agent", "nano-4", broker.url)
    events = latest(make_bus("events", "cli"), topics.CLUSTER_EVENTS, m.ClusterEvent)
    # The running instance reports on its own node's events topic; the coordinator on the cluster's.
    own_events = latest(make_bus("own-events", "cli"), topics.service_events("nano-4", "node-agent"), m.ClusterEvent)
    watcher = ClusterWatcher(make_bus("watch", "cli"))
    wait_until(lambda: coordinator_says(watcher, "nano-4", "online"), 20, message="online in the coordinator's view")
    # A second live process on the same node id, as when two start at the same moment: it announces
    # itself and beats without having seen the first.
    twin = make_bus("nano-4", "node-agent")
    s = twin.sender
    twin.publish(topics.status("nano-4", "node-agent"), m.Status(
        state="online", node="nano-4", service="node-agent", instance=s.instance, version="x", host="elsewhere",
        pid=4242, device_class="rpi4", memory_budget_bytes=1, free_memory_bytes=1, data_url=broker.url,
        heartbeat_interval_s=0.25, started_at=time.time()), retain=True)
    for seq in range(12):
        twin.publish(topics.heartbeat("nano-4", "node-agent"), m.Heartbeat(
            node="nano-4", service="node-agent", instance=s.instance, seq=seq, interval_s=0.25, uptime_s=1.0,
            free_memory_bytes=1, inbox_depth=0), qos=0, retain=True, ttl_s=1)
        time.sleep(0.1)
    wait_until(lambda: [e for e in own_events if e.body.kind == "duplicate_node" and e.envelope.sender_service ==
                        "node-agent"], 5, message="the running instance reports the duplicate")
    wait_until(lambda: [e for e in events if e.body.kind == "duplicate_node" and e.envelope.sender_service ==
                        "coordinator"], 5, message="the coordinator reports the duplicate")
    view, _ = watcher.view()
    node = view.node("nano-4")
    assert node is not None and node.conflicts and "4242" in node.conflicts[0]
    assert len([sv for sv in node.services if sv.service == "node-agent"]) == 2, "both kept, not merged"


def test_a_stale_online_status_is_taken_over(broker: BrokerProcess, services, make_bus) -> None:
    ghost = make_bus("nano-5", "node-agent")
    ghost.publish(topics.status("nano-5", "node-agent"), m.Status(
        state="online", node="nano-5", service="node-agent", instance="deadbeef", version="x", host="gone", pid=1,
        device_class="native", memory_budget_bytes=1, free_memory_bytes=1, data_url=broker.url,
        heartbeat_interval_s=0.25, started_at=0.0), retain=True)
    ghost.hub.flush(5)
    proc = services.start("node-agent", "nano-5", broker.url)
    statuses = latest(make_bus("watch", "cli"), topics.status("nano-5", "node-agent"), m.Status)
    wait_until(lambda: statuses and statuses[-1].body.instance != "deadbeef"
               and statuses[-1].body.state == "online", 20, message="take-over")
    assert proc.poll() is None
    assert "taking over node id nano-5" in services.log_of(proc)


def test_forged_heartbeats_leave_the_coordinators_view_bounded_until_retention_forgets_them(
        broker: BrokerProcess, services, make_bus) -> None:
    """3,000 heartbeats for 3,000 made-up nodes: the coordinator's view never holds more than the cap
    (EDGESWARM_MEMBERSHIP_MAX_NODES, default 128) and stays small, the refusals are logged a few times rather than
    thousands, the genuine node stays listed, probes are answered, and once the retention has passed the forged
    nodes are gone and a new genuine node finds room."""
    retention_s = 3.0
    coordinator = services.start("coordinator", "hub", broker.url, EDGESWARM_MEMBERSHIP_RETENTION_S=str(retention_s))
    services.start("node-agent", "real-1", broker.url)
    watch = make_bus("watch", "cli")
    views = latest(watch, topics.CLUSTER_VIEW, m.ClusterView)
    metrics = latest(watch, topics.metrics("hub", "coordinator"), m.MetricsReport)
    wait_until(lambda: views and views[-1].body.node("real-1") is not None, 20, message="real-1 in the view")

    attacker = make_bus("attacker", "cli")
    for i in range(3000):  # each as the node it names: on an anonymous broker nothing stops that
        forged = Sender(node=f"forged-{i}", service="node-agent", instance="f0f0f0f0f0f0")
        beat = m.Heartbeat(node=f"forged-{i}", service="node-agent", instance="f0f0f0f0f0f0", seq=0,
                           interval_s=3600.0, uptime_s=1.0, free_memory_bytes=0, inbox_depth=0)
        attacker.hub.publish(topics.heartbeat(f"forged-{i}", "node-agent"), encode(forged.envelope(beat), beat), qos=0)
    attacker.hub.flush(30)
    full = wait_until(lambda: next((v for v in views if len(v.body.nodes) == 128), None), 30,
                      message="the view filled up to the cap")
    flooded = views[views.index(full):]
    wait_until(lambda: _probe_node(watch, "hub", "coordinator"), 15, message="a probe answered after the flood")
    assert max(len(v.body.nodes) for v in views) == 128
    biggest = max(len(encode(v.envelope, v.body)) for v in views)
    assert biggest < 128 * 1024, f"the view grew to {biggest} bytes"
    assert all(v.body.node("real-1") is not None for v in flooded), "the genuine node stays listed"

    log = services.log_of(coordinator)
    refusals = log.count("membership is full")
    assert 1 <= refusals <= 30, f"{refusals} log lines for the refused nodes: not rate-limited"
    assert "EDGESWARM_MEMBERSHIP_MAX_NODES" in log
    counted = wait_until(lambda: next((r.body for r in reversed(metrics)
                                       if r.body.counters.get("membership_refused", 0) > 0), None), 10,
                         message="the refusals counted in the coordinator's metrics")
    assert counted.gauges["membership_nodes"] <= 128

    wait_until(lambda: {n.node for n in views[-1].body.nodes} == {"hub", "real-1"}, retention_s + 15,
               message="the forged nodes forgotten after the retention")
    services.start("node-agent", "real-2", broker.url)
    wait_until(lambda: views[-1].body.node("real-2") is not None, 20, message="a new genuine node admitted")
    assert coordinator.poll() is None and _probe_node(watch, "hub", "coordinator")


def test_invalid_settings_stop_a_service_with_the_variable_named(broker: BrokerProcess, services) -> None:
    proc = services.start("node-agent", "x", broker.url, EDGESWARM_HEARTBEAT_INTERVAL_S="-1")
    assert proc.wait(20) == 2
    assert "EDGESWARM_HEARTBEAT_INTERVAL_S" in services.log_of(proc)
    proc = services.start("node-agent", "x", broker.url, EDGESWARM_DEVICE_CLASS="cray-1")
    assert proc.wait(20) == 2
    assert "unknown device class 'cray-1'" in services.log_of(proc)
    proc = services.start("coordinator", "x", broker.url, EDGESWARM_MEMBERSHIP_RETENTION_S="0.5")
    assert proc.wait(20) == 2
    assert "EDGESWARM_MEMBERSHIP_RETENTION_S (0.5 s) must exceed" in services.log_of(proc)


@pytest.mark.parametrize("service", ["coordinator", "node-agent"])
def test_every_service_survives_a_broker_restart(tmp_path, services, make_bus, service: str) -> None:
    from edgeswarm.local.broker import start_broker

    hub = start_broker("mosquitto", workdir=tmp_path / "b1")
    port = hub.port
    try:
        proc = services.start(service, "n1", hub.url)
        watch = make_bus("watch", "cli", hub_url=hub.url)
        wait_until(lambda: _probe(watch, service), 20, message="first probe")
        hub.stop()
        time.sleep(1.0)
        hub = start_broker("mosquitto", port=port, workdir=tmp_path / "b2")
        wait_until(lambda: _probe(watch, service), 30, interval_s=0.2, message="probe after the restart")
        statuses = latest(watch, topics.status("n1", service), m.Status)
        wait_until(lambda: statuses and statuses[-1].body.state == "online", 10, message="status republished")
        assert proc.poll() is None
    finally:
        hub.stop()


def _probe(bus: Bus, service: str) -> bool:
    try:
        return bool(bus.request(topics.request("n1", service), m.Probe(), timeout_s=0.5).body.healthy)
    except Exception:
        return False


def _probe_node(bus: Bus, node: str, service: str) -> bool:
    try:
        return bool(bus.request(topics.request(node, service), m.Probe(), timeout_s=2.0).body.healthy)
    except Exception:
        return False


def test_waiting_for_a_cluster_waits_for_every_service_it_started(broker: BrokerProcess, services, make_bus) -> None:
    # `edgeswarm up` said "cluster up" once every device's node-agent was online, while the hub's services could
    # still be starting: a job submitted then was planned without them.
    from edgeswarm.runtime.client import not_online

    watcher = ClusterWatcher(make_bus("watch", "cli"))
    start_online(services, broker, make_bus, "dev-1")
    started = {("dev-1", "node-agent"), ("hub", "planner")}
    view, _ = watcher.wait(settle_s=0.2, devices=1, timeout_s=1.0, services=started)
    assert not_online(view, started) == [("hub", "planner")]
    services.start("planner", "hub", broker.url)
    view, _ = watcher.wait(settle_s=0.0, devices=1, timeout_s=30.0, services=started)
    assert not_online(view, started) == []

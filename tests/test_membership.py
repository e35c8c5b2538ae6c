"""Membership as a pure fold: states from statuses and heartbeats, conflicts, events."""

from __future__ import annotations

from edgeswarm.membership import MembershipTable, diff_events, observed_at
from edgeswarm.messages import Heartbeat, Status


def status(node: str, service: str = "node-agent", instance: str = "i1", state: str = "online",
           interval: float = 1.0, reason: str | None = None) -> Status:
    return Status(state=state, node=node, service=service, instance=instance, version="1", host="h", pid=1,
                  device_class="jetson-nano", memory_budget_bytes=100, free_memory_bytes=50, data_url="mqtt://x:1",
                  heartbeat_interval_s=interval, started_at=0.0, reason=reason)


def beat(node: str, service: str = "node-agent", instance: str = "i1") -> Heartbeat:
    return Heartbeat(node=node, service=service, instance=instance, seq=0, interval_s=1.0, uptime_s=1.0,
                     free_memory_bytes=50, inbox_depth=0)


def states(table: MembershipTable, now: float) -> dict[tuple[str, str, str], str]:
    view = table.view(now)
    return {(n.node, s.service, s.instance): s.state for n in view.nodes for s in n.services}


def test_online_then_suspect_after_timeout_then_online_again() -> None:
    t = MembershipTable(heartbeat_timeout_factor=3.0)
    t.apply_status(status("a"), at=100.0)
    assert states(t, 101.0) == {("a", "node-agent", "i1"): "online"}
    t.apply_heartbeat(beat("a"), at=102.0)
    assert states(t, 104.9)[("a", "node-agent", "i1")] == "online"
    assert states(t, 105.1)[("a", "node-agent", "i1")] == "suspect"
    t.apply_heartbeat(beat("a"), at=105.2)
    assert states(t, 105.3)[("a", "node-agent", "i1")] == "online"
    view = t.view(105.3)
    assert view.nodes[0].services[0].heartbeat_age_s == 0.1


def test_offline_status_wins_and_older_messages_are_ignored() -> None:
    t = MembershipTable()
    t.apply_status(status("a"), at=10.0)
    t.apply_status(status("a", state="offline", reason="connection lost"), at=12.0)
    t.apply_status(status("a"), at=11.0)  # late, older copy
    view = t.view(12.5)
    assert view.nodes[0].state == "offline"
    assert view.nodes[0].services[0].reason == "connection lost"


def test_a_new_instance_replaces_an_offline_one_but_two_live_ones_conflict() -> None:
    t = MembershipTable()
    t.apply_status(status("a", instance="old", state="offline"), at=1.0)
    t.apply_status(status("a", instance="new"), at=2.0)
    assert states(t, 2.5) == {("a", "node-agent", "new"): "online"}
    t.apply_status(status("a", instance="twin"), at=2.2)
    view = t.view(2.5)
    assert len(view.nodes[0].conflicts) == 1
    assert "2 live instances" in view.nodes[0].conflicts[0]


def test_node_state_and_resources_come_from_its_best_service() -> None:
    t = MembershipTable()
    t.apply_status(status("a", service="node-agent"), at=1.0)
    t.apply_status(status("a", service="other", instance="i2", state="offline"), at=1.0)
    t.apply_status(status("b"), at=1.0)
    view = t.view(10.0)  # both node-agents are long silent by now
    assert [n.node for n in view.nodes] == ["a", "b"]
    assert view.node("a").state == "suspect"
    assert view.node("a").device_class == "jetson-nano"
    assert view.online_nodes() == []


def test_events_report_each_change_once() -> None:
    t = MembershipTable()
    t.apply_status(status("a"), at=1.0)
    first = t.view(1.5)
    events = diff_events(None, first)
    assert [(e.kind, e.node) for e in events] == [("service_online", "a")]
    assert diff_events(first, t.view(1.6)) == []
    suspect = t.view(10.0)
    assert [e.kind for e in diff_events(first, suspect)] == ["service_suspect"]
    t.apply_status(status("a", state="offline", reason="shutdown"), at=11.0)
    offline = diff_events(suspect, t.view(11.5))
    assert [e.kind for e in offline] == ["service_offline"] and "shutdown" in offline[0].detail
    t.apply_status(status("a", instance="x"), at=12.0)
    t.apply_status(status("a", instance="y"), at=12.1)
    kinds = [e.kind for e in diff_events(None, t.view(12.2))]
    assert kinds.count("duplicate_node") == 1


def test_observed_at_uses_send_time_only_for_retained_copies() -> None:
    assert observed_at(5.0, retained=True, now=9.0) == 5.0
    assert observed_at(5.0, retained=False, now=9.0) == 9.0


def test_an_instance_heard_only_by_heartbeats_is_kept_until_its_status_arrives() -> None:
    t = MembershipTable()
    t.apply_status(status("a", instance="real"), at=1.0)
    t.apply_heartbeat(beat("a", instance="twin"), at=1.1)  # its retained status was overwritten
    view = t.view(1.2)
    assert {s.instance: s.state for s in view.nodes[0].services} == {"real": "online", "twin": "online"}
    assert view.nodes[0].conflicts, "two live instances are a conflict even without the twin's status"
    assert view.nodes[0].device_class == "jetson-nano", "the node is described by the real status"
    t.apply_status(status("a", instance="twin", state="offline", reason="shutdown"), at=1.3)
    twin = next(s for s in t.view(1.4).nodes[0].services if s.instance == "twin")
    assert twin.state == "offline" and twin.reason == "shutdown"

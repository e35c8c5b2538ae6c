"""Membership as a pure fold: states from statuses and heartbeats, conflicts, events, retention and caps."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from edgeswarm.logs import RateLimitedLog
from edgeswarm.membership import MembershipTable, diff_events, membership_table, observed_at
from edgeswarm.messages import Heartbeat, Status
from edgeswarm.settings import DEFAULT_MAX_NODES, Settings
from edgeswarm.wire import Sender, encode


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
    assert [n.node for n in view.nodes if n.state == "online"] == []


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


# --- bounds: retention and caps -------------------------------------------------------------------------------


def test_instances_silent_past_the_retention_are_forgotten_whatever_their_state() -> None:
    t = MembershipTable(retention_s=60.0)
    t.apply_status(status("left", state="offline", reason="shutdown"), at=100.0)
    t.apply_status(status("hung"), at=100.0)
    t.apply_status(status("alive"), at=100.0)
    t.apply_status(status("alive", service="profiler", instance="p1", state="offline"), at=100.0)
    for at in (130.0, 159.0):
        t.apply_heartbeat(beat("alive"), at=at)
    # Within the retention a departed node is still listed, offline with its reason, and a hung one as suspect.
    view = t.view(160.0)
    assert view.node("left").state == "offline" and view.node("left").services[0].reason == "shutdown"
    assert view.node("hung").state == "suspect"
    # Past it, both are gone, and so is the offline service of a node that is still alive.
    assert sorted(t.prune(160.5)) == [("alive", "profiler", "p1"), ("hung", "node-agent", "i1"),
                                      ("left", "node-agent", "i1")]
    assert states(t, 161.0) == {("alive", "node-agent", "i1"): "online"}
    assert [n.node for n in t.view(219.0).nodes] == ["alive"]  # heard at 159: kept until 219
    assert t.view(219.5).nodes == () and len(t) == 0 and t.node_count == 0


def test_a_retained_send_time_in_the_future_counts_as_now() -> None:
    # Else a forged retained heartbeat "sent" in a year would stay fresh, and held, for a year.
    assert observed_at(10_000.0, retained=True, now=9.0) == 9.0
    t = MembershipTable(retention_s=60.0)
    t.apply_heartbeat(beat("ghost"), at=observed_at(1e12, retained=True, now=100.0))
    assert t.view(161.0).nodes == ()


def test_a_new_node_beyond_the_cap_is_refused_with_one_log_line_per_burst(caplog) -> None:
    t = MembershipTable(retention_s=60.0, max_nodes=3)
    assert all(t.apply_status(status(f"n{i}"), at=1.0) for i in range(3))
    with caplog.at_level(logging.ERROR, logger="edgeswarm.membership"):
        for i in range(1000):
            assert not t.apply_heartbeat(beat(f"forged-{i}"), at=2.0)
    assert [n.node for n in t.view(2.0).nodes] == ["n0", "n1", "n2"]
    assert t.refused == 1000
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 10, "a flood must not become a flood of log lines"
    assert "EDGESWARM_MEMBERSHIP_MAX_NODES" in lines[0] and "forged-0" in lines[0] and "holds 3 nodes" in lines[0]
    # Members keep being updated, and once one has been silent past the retention a newcomer gets its place.
    t.apply_heartbeat(beat("n0"), at=50.0)
    t.apply_heartbeat(beat("n1"), at=50.0)
    assert t.apply_status(status("late"), at=62.0) is False
    t.prune(62.0)
    assert t.apply_status(status("late"), at=62.0) is True
    assert [n.node for n in t.view(62.0).nodes] == ["late", "n0", "n1"]


def test_a_node_holds_at_most_the_capped_number_of_instances() -> None:
    t = MembershipTable(retention_s=60.0, max_instances_per_node=2)
    assert t.apply_status(status("a", service="node-agent"), at=1.0)
    assert t.apply_status(status("a", service="profiler", instance="p1", state="offline"), at=1.0)
    assert not any(t.apply_heartbeat(beat("a", service="stage-worker", instance=f"x{i}"), at=2.0) for i in range(50))
    assert t.refused == 50 and len(t) == 2
    # A restarted service takes the place of its own offline instance even at the cap.
    assert t.apply_status(status("a", service="profiler", instance="p2"), at=3.0)
    assert {(s.service, s.instance) for s in t.view(3.0).nodes[0].services} == {("node-agent", "i1"),
                                                                               ("profiler", "p2")}


def test_thousands_of_forged_heartbeats_leave_a_bounded_table_and_view() -> None:
    t = MembershipTable(retention_s=60.0)  # the default caps
    for i in range(3000):
        t.apply_heartbeat(Heartbeat(node=f"forged-{i:04d}-{'x' * 50}", service="s" * 64, instance="i" * 64, seq=0,
                                    interval_s=1e9, uptime_s=1e9, free_memory_bytes=0, inbox_depth=0), at=1.0)
    view = t.view(2.0)
    assert len(view.nodes) == DEFAULT_MAX_NODES and len(t) == DEFAULT_MAX_NODES
    # What one never-seen instance costs is fixed: names the schema bounds and a constant provisional status.
    size = len(encode(Sender(node="hub", service="coordinator", instance="c").envelope(view), view))
    assert size < DEFAULT_MAX_NODES * 1024, size
    # A huge heartbeat interval keeps a forged instance "online", but not past the retention.
    assert view.nodes[0].state == "online"
    assert t.view(61.5).nodes == ()


def test_status_strings_are_bounded_by_the_schema() -> None:
    with pytest.raises(ValidationError, match="host"):
        Status(**{**status("a").model_dump(), "host": "h" * 256})
    with pytest.raises(ValidationError, match="reason"):
        Status(**{**status("a").model_dump(), "reason": "r" * 513})


def test_membership_settings_come_from_the_environment_and_are_checked(monkeypatch) -> None:
    monkeypatch.setenv("EDGESWARM_MEMBERSHIP_RETENTION_S", "7")
    monkeypatch.setenv("EDGESWARM_MEMBERSHIP_MAX_NODES", "5")
    table = membership_table(Settings(heartbeat_interval_s=1.0))
    assert (table.retention_s, table.max_nodes, table.max_instances_per_node) == (7.0, 5, 16)
    with pytest.raises(ValidationError, match="EDGESWARM_MEMBERSHIP_RETENTION_S"):
        Settings(heartbeat_interval_s=3.0)  # suspect after 9 s, forgotten after 7: live services would blink


def test_rate_limited_log_writes_a_burst_then_one_summary_per_window(caplog) -> None:
    clock = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.limited"), burst=2, window_s=10.0, what="refusals",
                             clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="test.limited"):
        for i in range(5):
            limited.warning("k", "line %d", i)
        limited.warning("other", "other key")
        clock[0] = 11.0
        limited.warning("k", "line %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "line 0", "line 1", "other key", "... 3 more 'k' refusals in the last 10 s", "line 5"]

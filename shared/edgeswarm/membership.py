"""Cluster membership as a pure fold over status and heartbeat messages.

The coordinator feeds every retained status and heartbeat into a MembershipTable and publishes the
resulting ClusterView; ``edgeswarm status`` does the same from the retained topics when no coordinator
runs. A service is *online* while its status says online and it has been heard from within
``heartbeat_timeout_factor`` of its heartbeat interval, *suspect* when it has gone quiet longer than that
(hung, stopped or cut off), and *offline* once its status says so (shutdown or Last Will). Two
instances of the same service on the same node that are both online are a conflict: reported, never
merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgeswarm.messages import ClusterEvent, ClusterView, Heartbeat, NodeView, ServiceView, Status
from edgeswarm.messages.cluster import ServiceState

_RANK: dict[ServiceState, int] = {"online": 0, "suspect": 1, "offline": 2}


@dataclass
class _Instance:
    status: Status
    status_at: float
    heard_at: float


class MembershipTable:
    """Latest known state of every service instance. ``at`` arguments are Unix seconds of the observation."""

    def __init__(self, heartbeat_timeout_factor: float = 3.0) -> None:
        self.timeout_factor = heartbeat_timeout_factor
        self._instances: dict[tuple[str, str, str], _Instance] = {}

    def apply_status(self, status: Status, at: float) -> None:
        """Record a status observed at ``at`` (older than the one already held: ignored)."""
        key = (status.node, status.service, status.instance)
        held = self._instances.get(key)
        if held is not None and held.status_at > at:
            return
        self._instances[key] = _Instance(status, at, max(at, held.heard_at) if held else at)
        if status.state == "online":
            self._forget_superseded(status, at)

    def apply_heartbeat(self, hb: Heartbeat, at: float) -> None:
        """Record a heartbeat observed at ``at``.

        An instance heard only through heartbeats is kept with a provisional status until its real one
        arrives: a live twin whose retained status was overwritten by the other's is still seen, so the
        conflict is reported.
        """
        key = (hb.node, hb.service, hb.instance)
        held = self._instances.get(key)
        if held is None:
            self._instances[key] = _Instance(_provisional_status(hb, at), -math.inf, at)
        elif at > held.heard_at:
            held.heard_at = at

    def view(self, now: float) -> ClusterView:
        """The cluster as of ``now``: one NodeView per node, services sorted by name."""
        by_node: dict[str, list[tuple[_Instance, ServiceView]]] = {}
        for inst in self._instances.values():
            by_node.setdefault(inst.status.node, []).append((inst, self._service_view(inst, now)))
        nodes = [self._node_view(node, entries) for node, entries in sorted(by_node.items())]
        return ClusterView(generated_at=now, heartbeat_timeout_factor=self.timeout_factor, nodes=tuple(nodes))

    def _service_view(self, inst: _Instance, now: float) -> ServiceView:
        st = inst.status
        age = max(0.0, now - inst.heard_at)
        if st.state == "offline":
            state: ServiceState = "offline"
        elif age > st.heartbeat_interval_s * self.timeout_factor:
            state = "suspect"
        else:
            state = "online"
        return ServiceView(service=st.service, instance=st.instance, state=state, version=st.version,
                           host=st.host, pid=st.pid, data_url=st.data_url, heartbeat_age_s=round(age, 3),
                           started_at=st.started_at, reason=st.reason)

    def _node_view(self, node: str, entries: list[tuple[_Instance, ServiceView]]) -> NodeView:
        entries.sort(key=lambda e: (e[1].service, _RANK[e[1].state], -e[0].status_at))
        conflicts = []
        services = sorted({sv.service for _, sv in entries})
        for name in services:
            live = [sv for _, sv in entries if sv.service == name and sv.state == "online"]
            if len(live) > 1:
                who = ", ".join(f"{sv.instance} (host {sv.host}, pid {sv.pid})" for sv in live)
                conflicts.append(f"{name}: {len(live)} live instances claim node {node}: {who}")
        best = min(entries, key=lambda e: (_RANK[e[1].state], e[1].service != "node-agent", -e[0].status_at))
        status = best[0].status
        return NodeView(
            node=node,
            state=best[1].state,
            device_class=status.device_class,
            memory_budget_bytes=status.memory_budget_bytes,
            free_memory_bytes=status.free_memory_bytes,
            services=tuple(sv for _, sv in entries),
            conflicts=tuple(conflicts),
        )

    def _forget_superseded(self, status: Status, at: float) -> None:
        # An offline instance replaced by a newer one of the same service is history, not membership.
        for key, inst in list(self._instances.items()):
            if (key[0], key[1]) == (status.node, status.service) and key[2] != status.instance \
                    and inst.status.state == "offline" and inst.status_at <= at:
                del self._instances[key]


def _provisional_status(hb: Heartbeat, at: float) -> Status:
    return Status(state="online", node=hb.node, service=hb.service, instance=hb.instance, version="unknown",
                  host="unknown", pid=0, device_class="unknown", memory_budget_bytes=0,
                  free_memory_bytes=hb.free_memory_bytes, data_url="", heartbeat_interval_s=hb.interval_s,
                  started_at=at - hb.uptime_s, reason="known only from its heartbeats; no status seen yet")


def observed_at(sent_at: float, retained: bool, now: float) -> float:
    """When a liveness message was true (Unix seconds): its send time for a retained copy, else ``now``.

    Live messages are stamped with the receiver's clock so clock skew between nodes does not age them;
    retained copies delivered on subscribe are as old as their send time says, but never younger than now.
    """
    return min(sent_at, now) if retained else now


def diff_events(before: ClusterView | None, after: ClusterView) -> list[ClusterEvent]:
    """Events for every service whose state changed between two views, and every new conflict."""
    old_states = {} if before is None else _states(before)
    old_conflicts = set() if before is None else {c for n in before.nodes for c in n.conflicts}
    events = []
    for (node, service, instance), (state, reason) in sorted(_states(after).items()):
        if old_states.get((node, service, instance), (None, None))[0] != state:
            detail = f"{node}/{service} is {state}" + (f" ({reason})" if reason and state == "offline" else "")
            events.append(ClusterEvent(kind=f"service_{state}", node=node, service=service, instance=instance,
                                       detail=detail, at=after.generated_at))
    for n in after.nodes:
        for conflict in n.conflicts:
            if conflict not in old_conflicts:
                service = conflict.split(":", 1)[0]
                sv = next(s for s in n.services if s.service == service)
                events.append(ClusterEvent(kind="duplicate_node", node=n.node, service=service,
                                           instance=sv.instance, detail=conflict, at=after.generated_at))
    return events


def _states(view: ClusterView) -> dict[tuple[str, str, str], tuple[str, str | None]]:
    return {(n.node, s.service, s.instance): (s.state, s.reason) for n in view.nodes for s in n.services}

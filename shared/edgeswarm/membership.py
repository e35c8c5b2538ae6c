"""Cluster membership as a pure fold over status and heartbeat messages.

The coordinator feeds every retained status and heartbeat into a MembershipTable and publishes the
resulting ClusterView; ``edgeswarm status`` does the same from the retained topics when no coordinator
runs. A service is *online* while its status says online and it has been heard from within
``heartbeat_timeout_factor`` of its heartbeat interval, *suspect* when it has gone quiet longer than that
(hung, stopped or cut off), and *offline* once its status says so (shutdown or Last Will). Two
instances of the same service on the same node that are both online are a conflict: reported, never
merged.

The table is bounded: an instance silent (no status or heartbeat) for longer than ``retention_s`` is
forgotten, whatever its state, and at most ``max_nodes`` nodes of at most ``max_instances_per_node``
instances each are held. A newcomer beyond a cap is refused (counted in ``refused`` and logged, rate-limited)
until retention frees room: without the caps, anyone who can publish a heartbeat could grow the table, and the
view republished every second, without bound. The per-node cap is each writer's share: a node's status and
heartbeat topics are its own (the bus drops another sender's as ``forged_sender``, the ACL of a secure cluster
refuses them), so one member's fake instances fill only its own node's cap, never the others' room. Only a
client that can write as any node (an anonymous cluster) can fill ``max_nodes``. Every time is passed in by the
caller.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import ClusterEvent, ClusterView, Heartbeat, NodeView, ServiceView, Status
from edgeswarm.messages.cluster import ServiceState
from edgeswarm.settings import DEFAULT_MAX_INSTANCES_PER_NODE, DEFAULT_MAX_NODES, DEFAULT_RETENTION_S, Settings

log = logging.getLogger(__name__)


_RANK: dict[ServiceState, int] = {"online": 0, "suspect": 1, "offline": 2}
_FORGOTTEN_NAMED = 5  # instances named in the log line that reports forgotten ones

Key = tuple[str, str, str]  # (node, service, instance)


@dataclass
class _Instance:
    status: Status
    status_at: float
    heard_at: float


class MembershipTable:
    """Latest known state of every service instance. ``at`` and ``now`` arguments are Unix seconds of the
    observation; ``retention_s`` is seconds of silence after which an instance is forgotten."""

    def __init__(self, heartbeat_timeout_factor: float = 3.0, *, retention_s: float = DEFAULT_RETENTION_S,
                 max_nodes: int = DEFAULT_MAX_NODES,
                 max_instances_per_node: int = DEFAULT_MAX_INSTANCES_PER_NODE) -> None:
        self.timeout_factor = heartbeat_timeout_factor
        self.retention_s = retention_s
        self.max_nodes = max_nodes
        self.max_instances_per_node = max_instances_per_node
        self.refused = 0  # statuses and heartbeats of newcomers turned away by a cap
        # node -> (service, instance) -> instance: per node, so caps and superseding need not scan everyone.
        self._nodes: dict[str, dict[tuple[str, str], _Instance]] = {}
        self._cap_log = RateLimitedLog(log, what="refused newcomers")

    def __len__(self) -> int:
        """How many service instances are held."""
        return sum(len(held) for held in self._nodes.values())

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def apply_status(self, status: Status, at: float) -> bool:
        """Record a status observed at ``at`` (older than the one already held: ignored). Returns False when a cap
        turned a newcomer away."""
        node, key = status.node, (status.service, status.instance)
        held = self._nodes.get(node, {}).get(key)
        if held is not None and held.status_at > at:
            return True
        if status.state == "online":
            self._forget_superseded(status, at)  # first: a restarted service takes its old instance's place
        if held is None and not self._admit(node, key):
            return False
        self._nodes.setdefault(node, {})[key] = _Instance(status, at, max(at, held.heard_at) if held else at)
        return True

    def apply_heartbeat(self, hb: Heartbeat, at: float) -> bool:
        """Record a heartbeat observed at ``at``. Returns False when a cap turned a newcomer away.

        An instance heard only through heartbeats is kept with a provisional status until its real one
        arrives: a live twin whose retained status was overwritten by the other's is still seen, so the
        conflict is reported. The provisional status holds only the heartbeat's bounded names and numbers.
        """
        node, key = hb.node, (hb.service, hb.instance)
        held = self._nodes.get(node, {}).get(key)
        if held is None:
            if not self._admit(node, key):
                return False
            self._nodes.setdefault(node, {})[key] = _Instance(_provisional_status(hb, at), -math.inf, at)
        elif at > held.heard_at:
            held.heard_at = at
        return True

    def prune(self, now: float) -> list[Key]:
        """Forget every instance silent for more than ``retention_s`` as of ``now``; returns the forgotten keys."""
        horizon = now - self.retention_s
        gone: list[Key] = []
        for node, held in list(self._nodes.items()):
            for key, inst in list(held.items()):
                if inst.heard_at < horizon:
                    del held[key]
                    gone.append((node, *key))
            if not held:
                del self._nodes[node]
        if gone:
            named = ", ".join("/".join(k) for k in gone[:_FORGOTTEN_NAMED])
            more = f" and {len(gone) - _FORGOTTEN_NAMED} more" if len(gone) > _FORGOTTEN_NAMED else ""
            log.info("forgot %d service instance(s) silent for over %g s (EDGESWARM_MEMBERSHIP_RETENTION_S): %s%s",
                     len(gone), self.retention_s, named, more)
        return gone

    def view(self, now: float) -> ClusterView:
        """The cluster as of ``now``: one NodeView per node, services sorted by name. Forgets instances silent past
        the retention first (``prune``)."""
        self.prune(now)
        nodes = [self._node_view(node, [(inst, self._service_view(inst, now)) for inst in held.values()])
                 for node, held in sorted(self._nodes.items())]
        return ClusterView(generated_at=now, heartbeat_timeout_factor=self.timeout_factor, nodes=tuple(nodes))

    def _admit(self, node: str, key: tuple[str, str]) -> bool:
        """Whether a new instance ``key`` of ``node`` fits under the caps; logs (rate-limited) when not."""
        held = self._nodes.get(node)
        if held is None and len(self._nodes) >= self.max_nodes:
            self.refused += 1
            self._cap_log.error(
                "max_nodes", "membership is full: it holds %d nodes, the cap (EDGESWARM_MEMBERSHIP_MAX_NODES); node "
                "%s (%s/%s) is left out until a node has been silent for %g s (EDGESWARM_MEMBERSHIP_RETENTION_S). "
                "Raise the cap if the cluster really is this large, else find who publishes for unknown nodes",
                len(self._nodes), node, *key, self.retention_s)
            return False
        if held is not None and len(held) >= self.max_instances_per_node:
            self.refused += 1
            self._cap_log.error(
                "max_instances_per_node", "node %s already has %d service instances, the cap "
                "(EDGESWARM_MEMBERSHIP_MAX_INSTANCES_PER_NODE); instance %s of %s is left out until one has been "
                "silent for %g s (EDGESWARM_MEMBERSHIP_RETENTION_S)", node, len(held), key[1], key[0],
                self.retention_s)
            return False
        return True

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
            # The node agent computes nothing: the compute device is that of a service that computes, live first.
            compute=next((e[0].status.compute for e in sorted(entries, key=lambda e: _RANK[e[1].state])
                          if e[0].status.compute), ""),
            # Every service that reports it reads the same ledger; one announced before the last change may lag.
            reserved_memory_bytes=max((e[0].status.reserved_memory_bytes for e in entries if e[1].state == "online"),
                                      default=0),
        )

    def _forget_superseded(self, status: Status, at: float) -> None:
        # An offline instance replaced by a newer one of the same service is history, not membership.
        held = self._nodes.get(status.node)
        if held is None:
            return
        for key, inst in list(held.items()):
            if key[0] == status.service and key[1] != status.instance \
                    and inst.status.state == "offline" and inst.status_at <= at:
                del held[key]


def membership_table(settings: Settings, timeout_factor: float | None = None) -> MembershipTable:
    """A MembershipTable with the retention and caps of ``settings`` (the EDGESWARM_MEMBERSHIP_* variables), and
    its heartbeat timeout factor unless ``timeout_factor`` is given."""
    factor = settings.heartbeat_timeout_factor if timeout_factor is None else timeout_factor
    return MembershipTable(factor, retention_s=settings.membership_retention_s,
                           max_nodes=settings.membership_max_nodes,
                           max_instances_per_node=settings.membership_max_instances_per_node)


def _provisional_status(hb: Heartbeat, at: float) -> Status:
    return Status(state="online", node=hb.node, service=hb.service, instance=hb.instance, version="unknown",
                  host="unknown", pid=0, device_class="unknown", memory_budget_bytes=0,
                  free_memory_bytes=hb.free_memory_bytes, data_url="", heartbeat_interval_s=hb.interval_s,
                  started_at=at - hb.uptime_s, reason="known only from its heartbeats; no status seen yet")


def observed_at(sent_at: float, retained: bool, now: float) -> float:
    """When a liveness message was true (Unix seconds): its send time for a retained copy, else ``now``.

    Live messages are stamped with the receiver's clock so clock skew between nodes does not age them;
    retained copies delivered on subscribe are as old as their send time says, but never newer than ``now``:
    a send time in the future would keep an instance fresh, and so held, for as long as the sender liked.
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

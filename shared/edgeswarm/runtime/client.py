"""A short-lived client of the cluster, as the CLI commands use it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Collection, Mapping
from typing import Literal

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.membership import membership_table, observed_at
from edgeswarm.messages import ClusterView, Heartbeat, Status
from edgeswarm.settings import Settings
from edgeswarm.wire import Sender

ViewSource = Literal["coordinator", "retained topics"]
CLI_CONNECT_TIMEOUT_S = 5.0  # a command line gives up on an unreachable broker sooner than a service


CLI_NODE = "cli"


def settings_from_env(env: Mapping[str, str]) -> Settings:
    """The settings the ``EDGESWARM_*`` variables of ``env`` give (a cluster's ``client_env()``, say), as a process
    started with them would read them; other variables are ignored."""
    prefix = "EDGESWARM_"
    return Settings(**{k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)})


def client_bus(settings: Settings, role: str = "cli", connect_timeout_s: float = CLI_CONNECT_TIMEOUT_S) -> Bus:
    """A started Bus for a command-line client, service ``role``. Its node id is the broker user name it logs in
    with (the ACL binds what a client writes to it), or ``cli`` when anonymous. Call ``stop()`` when done."""
    node = settings.credentials().username or CLI_NODE
    bus = Bus(settings, Sender(node=node, service=role, instance=uuid.uuid4().hex[:12]))
    bus.start(timeout_s=connect_timeout_s)
    return bus


class ClusterWatcher:
    """Follows the cluster view: the coordinator's when it is fresh, else one folded from retained topics."""

    def __init__(self, bus: Bus, heartbeat_timeout_factor: float = 3.0, fresh_s: float = 5.0) -> None:
        self._lock = threading.Lock()
        self._fresh_s = fresh_s
        self._coordinator_view: ClusterView | None = None
        self._received_at = 0.0
        # EDGESWARM_MEMBERSHIP_*, as the coordinator reads them: the fallback view is bounded too.
        self._table = membership_table(bus.settings, heartbeat_timeout_factor)
        bus.subscribe(topics.CLUSTER_VIEW, self._on_view, schemas=(ClusterView,))
        bus.subscribe(topics.ALL_STATUS, self._on_status, schemas=(Status,))
        bus.subscribe(topics.ALL_HEARTBEATS, self._on_heartbeat, schemas=(Heartbeat,))

    def _on_view(self, msg: Inbound) -> None:
        with self._lock:
            assert isinstance(msg.body, ClusterView)
            self._coordinator_view = msg.body
            self._received_at = time.time()

    def _on_status(self, msg: Inbound) -> None:
        with self._lock:
            assert isinstance(msg.body, Status)
            self._table.apply_status(msg.body, observed_at(msg.envelope.sent_at, msg.retained, time.time()))

    def _on_heartbeat(self, msg: Inbound) -> None:
        with self._lock:
            assert isinstance(msg.body, Heartbeat)
            self._table.apply_heartbeat(msg.body, observed_at(msg.envelope.sent_at, msg.retained, time.time()))

    def view(self) -> tuple[ClusterView, ViewSource]:
        """The freshest view and where it came from."""
        now = time.time()
        with self._lock:
            cv = self._coordinator_view
            if cv is not None and now - cv.generated_at < self._fresh_s and now - self._received_at < self._fresh_s:
                return cv, "coordinator"
            return self._table.view(now), "retained topics"

    def wait(self, settle_s: float = 1.0, devices: int = 0, timeout_s: float = 0.0,
             cancel: threading.Event | None = None,
             services: Collection[tuple[str, str]] = ()) -> tuple[ClusterView, ViewSource]:
        """Wait ``settle_s`` for retained messages, then until ``devices`` nodes run an online node-agent and every
        ``(node, service)`` of ``services`` is online, ``timeout_s`` passes or ``cancel`` is set; returns the last
        view either way."""
        cancel = cancel or threading.Event()
        cancel.wait(settle_s)
        deadline = time.monotonic() + timeout_s
        view, source = self.view()
        while (online_devices(view) < devices or not_online(view, services)) and time.monotonic() < deadline \
                and not cancel.is_set():
            cancel.wait(0.2)
            view, source = self.view()
        return view, source


def not_online(view: ClusterView, services: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(node, service)`` pairs of ``services`` that ``view`` does not show online, sorted."""
    online = {(n.node, s.service) for n in view.nodes for s in n.services if s.state == "online"}
    return sorted(set(services) - online)


def online_device_ids(view: ClusterView) -> list[str]:
    """Ids of the nodes that run a node-agent that is online, in the view's order."""
    return nodes_running(view, "node-agent")


def nodes_running(view: ClusterView, service: str) -> list[str]:
    """Ids of the nodes where ``service`` is online, in the view's order."""
    return [n.node for n in view.nodes if any(s.service == service and s.state == "online" for s in n.services)]


def wait_for_service(watcher: ClusterWatcher, service: str, nodes: list[str], timeout_s: float) -> list[str]:
    """Wait until ``service`` is online on every node of ``nodes`` or ``timeout_s`` passes; the nodes still
    without it (empty when all are ready)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = sorted(set(nodes) - set(nodes_running(watcher.view()[0], service)))
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def online_devices(view: ClusterView) -> int:
    """How many nodes run a node-agent that is online."""
    return len(online_device_ids(view))

"""The coordinator: keeps the live cluster view from the retained status and heartbeat topics.

It publishes the view, retained, on ``edgeswarm/cluster/view`` every second and an event on
``edgeswarm/cluster/events`` for every change of a service's state and every duplicate node id. The view is
bounded by the EDGESWARM_MEMBERSHIP_* settings (retention and caps, see ``edgeswarm.membership``).
It also owns the jobs of every kind (``jobs.JobManager``): ``edgeswarm.job.submit`` and ``edgeswarm.job.cancel`` on
its request topic, with each job's state retained on ``edgeswarm/job/{job}/state``.
"""

from __future__ import annotations

import logging
import threading
import time

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.membership import diff_events, membership_table, observed_at
from edgeswarm.messages import ClusterView, Heartbeat, NodeView, Status
from edgeswarm.runtime.service import Service
from edgeswarm.services.coordinator.jobs import JobManager

log = logging.getLogger(__name__)


class CoordinatorService(Service):
    name = "coordinator"

    def setup(self) -> None:
        self.table = membership_table(self.settings)
        self._lock = threading.Lock()
        self._last_view: ClusterView | None = None
        self._refused_counted = 0
        self.bus.subscribe(topics.ALL_STATUS, self._on_status, schemas=(Status,))
        self.bus.subscribe(topics.ALL_HEARTBEATS, self._on_heartbeat, schemas=(Heartbeat,))
        self.every(min(1.0, self.settings.heartbeat_interval_s), self.publish_view, "cluster-view")
        self.jobs = JobManager(self.bus, self.node, timeout_s=self.settings.job_step_timeout_s,
                               members=self.nodes_running)

    def teardown(self) -> None:
        self.jobs.stop()

    def _on_status(self, msg: Inbound) -> None:
        assert isinstance(msg.body, Status)
        with self._lock:
            self.table.apply_status(msg.body, observed_at(msg.envelope.sent_at, msg.retained, time.time()))

    def _on_heartbeat(self, msg: Inbound) -> None:
        assert isinstance(msg.body, Heartbeat)
        with self._lock:
            self.table.apply_heartbeat(msg.body, observed_at(msg.envelope.sent_at, msg.retained, time.time()))

    def nodes_running(self, service: str) -> list[NodeView]:
        """The nodes where ``service`` is online now."""
        with self._lock:
            view = self.table.view(time.time())
        return [n for n in view.nodes if any(s.service == service and s.state == "online" for s in n.services)]

    def publish_view(self) -> None:
        """Publish the current view (retained) and one event per change since the last one."""
        with self._lock:
            view = self.table.view(time.time())
            events = diff_events(self._last_view, view)
            self._last_view = view
            self.metrics.gauge("membership_nodes", self.table.node_count)
            self.metrics.gauge("membership_instances", len(self.table))
            refused, self._refused_counted = self.table.refused - self._refused_counted, self.table.refused
        if refused:
            self.metrics.count("membership_refused", refused)  # newcomers a cap turned away
        self.bus.publish(topics.CLUSTER_VIEW, view, retain=True)
        for event in events:
            level = logging.ERROR if event.kind == "duplicate_node" else logging.INFO
            log.log(level, "%s", event.detail)
            self.bus.publish(topics.CLUSTER_EVENTS, event)

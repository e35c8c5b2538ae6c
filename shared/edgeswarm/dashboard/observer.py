"""What the dashboard hears on the bus, kept bounded: one store for the snapshot builder and the Prometheus collector.

``subscribe`` puts the ``on_*`` methods on the bus's topics; the handler threads call them with validated messages.
``observed()`` hands the snapshot builder a consistent copy, ``metrics_inputs()`` the Prometheus collector its
(the fresh metrics reports, the view, the job states, the links). Everything is bounded: jobs (``MAX_JOBS``, the
oldest finished ones dropped first), events per job and of the cluster (``MAX_EVENTS``), links (``MAX_LINKS``),
metrics reports (``MAX_REPORTS``, the newest per node and service), nodes with clocks (the cluster view's size
bound). ``changed`` is set on every update, for the server to push a fresh snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.dashboard.model import MAX_EVENTS, TimedEvent
from edgeswarm.dashboard.snapshot import Observed, job_series, merge_series
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import ClusterEvent, ClusterView, Heartbeat, JobEvent, JobState, MetricsReport, ProfileReport
from edgeswarm.messages.jobs import FINISHED
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.schedule import ScheduleView
from edgeswarm.workloads import typed_state

_limited = RateLimitedLog(logging.getLogger(__name__))

MAX_JOBS = 64
MAX_LINKS = 1024
MAX_NODES = 256
MAX_REPORTS = 1024  # (node, service) pairs
MAX_GAUGES = 64  # per node
_CLOCK_SAMPLES = 16  # a node's latest heartbeat delays: the smallest is its clock offset (the network only adds)


class Observer:
    """The dashboard's bounded memory of the cluster (see the module docstring)."""

    def __init__(self, hub_url: str) -> None:
        self._lock = threading.Lock()
        self._hub_url = hub_url
        self._view: ClusterView | None = None
        self._jobs: dict[str, JobState] = {}
        self._job_events: dict[str, deque[TimedEvent]] = {}
        self._series: dict[str, list] = {}  # type: ignore[type-arg]
        self._cluster_events: deque[TimedEvent] = deque(maxlen=MAX_EVENTS)
        self._links: dict[str, LinkProfile] = {}
        self._reports: OrderedDict[tuple[str, str], tuple[float, MetricsReport]] = OrderedDict()
        self._delays: dict[str, deque[float]] = {}
        self._schedules: dict[str, ScheduleView] = {}
        self.changed = threading.Event()

    def subscribe(self, bus: Bus) -> None:
        """Hear the cluster: its view and events, the jobs' states and events, every service's metrics reports and
        heartbeats, and the profilers' reports (their links)."""
        bus.subscribe(topics.CLUSTER_VIEW, self.on_view, schemas=(ClusterView,))
        bus.subscribe(topics.CLUSTER_EVENTS, self.on_cluster_event, schemas=(ClusterEvent,))
        bus.subscribe(topics.ALL_SERVICE_EVENTS, self.on_cluster_event, schemas=(ClusterEvent,))
        bus.subscribe(topics.job_state("+"), self.on_job_state, schemas=(JobState,))
        bus.subscribe(topics.job_events("+"), self.on_job_event, schemas=(JobEvent,))
        bus.subscribe(topics.metrics("+", "+"), self.on_metrics, schemas=(MetricsReport,), qos=0)
        bus.subscribe(topics.ALL_HEARTBEATS, self.on_heartbeat, schemas=(Heartbeat,), qos=0)
        bus.subscribe(topics.ALL_PROFILE_REPORTS, self.on_profile, schemas=(ProfileReport,))

    # --- bus handlers (any thread) ------------------------------------------------------------------------

    def on_view(self, msg: Inbound) -> None:
        assert isinstance(msg.body, ClusterView)
        with self._lock:
            self._view = msg.body
        self.changed.set()

    def on_cluster_event(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, ClusterEvent)
        with self._lock:
            self._cluster_events.append(TimedEvent(at=body.at, kind=body.kind, detail=body.detail, node=body.node,
                                                   service=body.service))
        self.changed.set()

    def on_job_state(self, msg: Inbound) -> None:
        assert isinstance(msg.body, JobState)
        if topics.job_of(msg.topic) != msg.body.job_id:
            return  # a state filed under another job's topic speaks for nobody
        state = typed_state(msg.body)
        fresh = job_series(state)
        with self._lock:
            old = self._jobs.get(state.job_id)
            if old is not None and old.submission != state.submission:
                # The same name submitted again: a new job, whose history starts empty.
                self._job_events.pop(state.job_id, None)
                self._series.pop(state.job_id, None)
            self._jobs[state.job_id] = state
            self._series[state.job_id] = merge_series(self._series.get(state.job_id, []), fresh)
            self._evict()
        self.changed.set()

    def on_job_event(self, msg: Inbound) -> None:
        event = msg.body
        assert isinstance(event, JobEvent)
        with self._lock:
            held = self._jobs.get(event.job_id)
            if held is not None and event.submission and held.submission and event.submission != held.submission:
                self._job_events.pop(event.job_id, None)  # the first event of a new submission of that name
            events = self._job_events.setdefault(event.job_id, deque(maxlen=MAX_EVENTS))
            events.append(TimedEvent(at=msg.envelope.sent_at, kind=event.kind, detail=event.detail,
                                     round=event.round))
            if len(self._job_events) > 2 * MAX_JOBS:  # events of jobs whose state never came
                for jid in [j for j in self._job_events if j not in self._jobs][:MAX_JOBS]:
                    del self._job_events[jid]
        self.changed.set()

    def on_metrics(self, msg: Inbound) -> None:
        report = msg.body
        assert isinstance(report, MetricsReport)
        if msg.topic != topics.metrics(report.node, report.service):
            _limited.warning("report-topic", "dropped a metrics report of %s/%s on %s: not its own topic",
                             report.node, report.service, msg.topic[:256])
            return
        with self._lock:
            key = (report.node, report.service)
            self._reports[key] = (time.monotonic(), report)
            self._reports.move_to_end(key)
            while len(self._reports) > MAX_REPORTS:
                self._reports.popitem(last=False)
        self.changed.set()

    def on_heartbeat(self, msg: Inbound, now: float | None = None) -> None:
        """A live (not retained) heartbeat: its delay from ``sent_at`` to now samples the node's clock offset."""
        body = msg.body
        assert isinstance(body, Heartbeat)
        if msg.retained:
            return  # a retained heartbeat was sent long ago: its delay says nothing about the clock
        delay = (time.time() if now is None else now) - msg.envelope.sent_at
        with self._lock:
            if body.node not in self._delays and len(self._delays) >= MAX_NODES:
                return
            self._delays.setdefault(body.node, deque(maxlen=_CLOCK_SAMPLES)).append(delay)

    def on_profile(self, msg: Inbound) -> None:
        report = msg.body
        assert isinstance(report, ProfileReport)
        if topics.owner_of(msg.topic) != report.node:
            return  # a report on another node's topic speaks for nobody
        with self._lock:
            for link in report.own_links():
                key = f"{link.src}->{link.dst}"
                if key in self._links or len(self._links) < MAX_LINKS:
                    self._links[key] = link
        self.changed.set()

    def set_schedule(self, job_id: str, schedule: ScheduleView | None) -> None:
        """The latest round's schedule of ``job_id`` (from the trace collector), None to drop it."""
        with self._lock:
            if schedule is None:
                self._schedules.pop(job_id, None)
            elif job_id in self._jobs:
                self._schedules[job_id] = schedule

    # --- for the builder -----------------------------------------------------------------------------------

    def jobs(self) -> list[JobState]:
        with self._lock:
            return list(self._jobs.values())

    def metrics_inputs(self, stale_after_s: float
                       ) -> tuple[list[MetricsReport], ClusterView | None, list[JobState], list[LinkProfile]]:
        """What the Prometheus collector builds its families from: the metrics reports heard within
        ``stale_after_s`` seconds (older ones are of services that stopped), the cluster view, the job states and
        the links."""
        now = time.monotonic()
        with self._lock:
            return ([r for at, r in self._reports.values() if now - at <= stale_after_s], self._view,
                    list(self._jobs.values()), list(self._links.values()))

    def observed(self) -> Observed:
        """A copy of everything, for ``build_snapshot``. A node's clock offset is its smallest recent delay
        negated (a heartbeat cannot arrive before it was sent: a negative delay is its clock running ahead)."""
        with self._lock:
            return Observed(
                hub_url=self._hub_url, view=self._view, jobs=dict(self._jobs),
                job_events={k: list(v) for k, v in self._job_events.items()},
                series={k: list(v) for k, v in self._series.items()}, cluster_events=list(self._cluster_events),
                links=dict(self._links), gauges=self._gauges(),
                clock_offsets={node: -min(d) for node, d in self._delays.items() if d},
                schedules=dict(self._schedules))

    def _gauges(self) -> dict[str, dict[str, float]]:
        # Called with the lock held: each node's gauges, the newest report's value of each, at most MAX_GAUGES.
        out: dict[str, dict[str, float]] = {}
        for _, report in self._reports.values():
            if report.node not in out and len(out) >= MAX_NODES:
                continue
            gauges = out.setdefault(report.node, {})
            for name, value in report.gauges.items():
                if name in gauges or len(gauges) < MAX_GAUGES:
                    gauges[name] = value
        return out

    def _evict(self) -> None:
        # Called with the lock held: the oldest finished jobs go first, then the oldest of all.
        while len(self._jobs) > MAX_JOBS:
            finished = [s for s in self._jobs.values() if s.status in FINISHED]
            victim = min(finished or self._jobs.values(), key=lambda s: s.updated_at).job_id
            for table in (self._jobs, self._job_events, self._series, self._schedules):
                table.pop(victim, None)  # type: ignore[attr-defined]

"""Prometheus metrics for the whole cluster, exposed on the hub.

The collector listens to what the services already publish: every service's MetricsReport (its bus's counters,
what its programs measured: ``observability.record``), the coordinator's retained cluster view, the jobs' retained
states and the profilers' retained reports (their measured links). It keeps the newest of each (per node and
service; per job; per link), forgets metrics reports that stopped coming (3 report intervals), and turns them into
the families ``observability.catalogue`` lists, on its own CollectorRegistry. Instance ids are never labels: a
restarted service continues its series (Prometheus sees its counters reset).

Everything it reads was validated by the bus's schemas; what the schemas cannot say (a counter below zero, a gauge
that is not finite, a report whose node is not its topic's) is dropped, and a family that fails to build is left
out of the exposition rather than failing it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import ClusterView, JobState, MetricsReport, ProfileReport
from edgeswarm.messages.jobs import FINISHED
from edgeswarm.observability.catalogue import CATALOGUE, MetricDef, Source
from edgeswarm.workloads import installed_workload, typed_state

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

ALL_METRICS = topics.metrics("+", "+")
STALE_INTERVALS = 3.0  # a service's report this many report intervals old is gone (it publishes each with this TTL)
MAX_REPORTS = 1024  # (node, service) pairs kept
MAX_JOBS = 512
MAX_LINKS = 4096

LabelValues = tuple[str, ...]


@dataclass(frozen=True)
class _Link:
    rtt_s: float
    bandwidth_bps: float


class _Families(Collector):
    """The prometheus_client collector: builds every family from the collector's state at each scrape."""

    def __init__(self, owner: PrometheusCollector) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        reports, view, jobs, links = self.owner.snapshot()
        for metric in CATALOGUE:
            try:
                family = _family(metric, reports, view, jobs, links)
            except Exception:  # noqa: BLE001 - one family must never cost the whole exposition
                _limited.log(logging.WARNING, metric.name, "metric %s left out of the exposition", metric.name,
                             exc_info=True)
                continue
            if family is not None:
                yield family


class PrometheusCollector:
    """The cluster's metrics as Prometheus families, from what the services publish on the hub."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.stale_after_s = STALE_INTERVALS * bus.settings.metrics_interval_s
        self._lock = threading.Lock()
        self._reports: OrderedDict[tuple[str, str], tuple[float, MetricsReport]] = OrderedDict()
        self._view: ClusterView | None = None
        self._jobs: OrderedDict[str, JobState] = OrderedDict()
        self._links: OrderedDict[tuple[str, str], _Link] = OrderedDict()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Families(self))

    def start(self) -> None:
        """Subscribe to what the metrics are made of."""
        self.bus.subscribe(ALL_METRICS, self._on_report, schemas=(MetricsReport,), qos=0)
        self.bus.subscribe(topics.CLUSTER_VIEW, self._on_view, schemas=(ClusterView,))
        self.bus.subscribe(topics.ALL_JOB_STATES, self._on_job, schemas=(JobState,))
        self.bus.subscribe(topics.ALL_PROFILE_REPORTS, self._on_profile, schemas=(ProfileReport,))

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def snapshot(self) -> tuple[list[MetricsReport], ClusterView | None, list[JobState], dict[tuple[str, str], _Link]]:
        """The fresh metrics reports (stale ones forgotten), the cluster view, the job states and the links."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (at, _) in self._reports.items() if now - at > self.stale_after_s]:
                del self._reports[key]
            return ([r for _, r in self._reports.values()], self._view, list(self._jobs.values()),
                    dict(self._links))

    # --- handlers (bus threads) ---------------------------------------------------------------------

    def _on_report(self, msg: Inbound) -> None:
        report = msg.body
        assert isinstance(report, MetricsReport)
        parts = msg.topic.split("/")
        if len(parts) != 5 or (parts[2], parts[3]) != (report.node, report.service):
            _limited.warning("report-topic", "dropped a metrics report of %s/%s on %s: not its own topic",
                             report.node, report.service, msg.topic)
            return
        _put(self._lock, self._reports, (report.node, report.service), (time.monotonic(), report), MAX_REPORTS)

    def _on_view(self, msg: Inbound) -> None:
        assert isinstance(msg.body, ClusterView)
        with self._lock:
            self._view = msg.body

    def _on_job(self, msg: Inbound) -> None:
        assert isinstance(msg.body, JobState)
        if topics.job_of(msg.topic) != msg.body.job_id:
            return
        state = typed_state(msg.body)
        _put(self._lock, self._jobs, state.job_id, state, MAX_JOBS)

    def _on_profile(self, msg: Inbound) -> None:
        report = msg.body
        assert isinstance(report, ProfileReport)
        if topics.owner_of(msg.topic) != report.node:
            return
        for link in report.own_links():
            _put(self._lock, self._links, (link.src, link.dst), _Link(link.latency_s, link.bandwidth_bps), MAX_LINKS)


def _put(lock: threading.Lock, table: OrderedDict, key: object, value: object, cap: int) -> None:  # type: ignore[type-arg]
    """``table[key] = value`` as the newest entry, the oldest dropped beyond ``cap``."""
    with lock:
        table[key] = value
        table.move_to_end(key)
        while len(table) > cap:
            table.popitem(last=False)


# --- building the families ------------------------------------------------------------------------------


def _family(metric: MetricDef, reports: list[MetricsReport], view: ClusterView | None, jobs: list[JobState],
            links: dict[tuple[str, str], _Link]) -> Metric | None:
    kind = metric.sources[0].kind
    if kind in ("counter", "gauge", "histogram", "uptime"):
        return _from_reports(metric, reports)
    if kind == "cluster":
        return _from_view(metric, view)
    if kind == "job":
        return _from_jobs(metric, jobs)
    if kind == "link":
        return _from_links(metric, links)
    return None


def _labelled(metric: MetricDef, source: Source, report: MetricsReport, internal: str) -> LabelValues | None:
    """The label values (in ``metric.labels``' order) of the series ``internal`` of ``report`` makes, or None."""
    values = source.label_values(internal)
    if values is None:
        return None
    by_name = {"node": report.node, "service": report.service, **dict(zip(source.labels, values, strict=True)),
               **dict(source.fixed)}
    return tuple(by_name[label] for label in metric.labels)


def _from_reports(metric: MetricDef, reports: list[MetricsReport]) -> Metric:
    labels = list(metric.labels)
    if metric.type == "histogram":
        hist = HistogramMetricFamily(metric.name, metric.help, labels=labels, unit="")
        seen: set[LabelValues] = set()
        for report in reports:
            for source in metric.sources:
                for internal, h in report.histograms.items():
                    values = _labelled(metric, source, report, internal)
                    if values is None or values in seen or not math.isfinite(h.sum):
                        continue
                    seen.add(values)
                    buckets = [(floatToGoString(b), float(n)) for b, n in zip(h.bounds, h.counts, strict=True)]
                    hist.add_metric(list(values), buckets + [("+Inf", float(h.count))], h.sum)
        return hist
    family: CounterMetricFamily | GaugeMetricFamily
    family = (CounterMetricFamily(metric.name, metric.help, labels=labels) if metric.type == "counter" else
              GaugeMetricFamily(metric.name, metric.help, labels=labels))
    series: dict[LabelValues, float] = {}
    for report in reports:
        for source in metric.sources:
            if source.kind == "uptime":
                series[(report.node, report.service)] = report.uptime_s
                continue
            table: dict[str, int] | dict[str, float] = report.counters if source.kind == "counter" else report.gauges
            for internal, value in table.items():
                values = _labelled(metric, source, report, internal)
                if values is None or not math.isfinite(value) or (metric.type == "counter" and value < 0):
                    continue
                series[values] = float(value)
    for values, value in series.items():
        family.add_metric(list(values), value)
    return family


def _from_view(metric: MetricDef, view: ClusterView | None) -> Metric:
    if metric.type == "info":
        info = InfoMetricFamily(metric.name, metric.help, labels=["node"])
        for node in view.nodes if view else ():
            info.add_metric([node.node], {"device_class": node.device_class, "compute": node.compute})
        return info
    gauge = GaugeMetricFamily(metric.name, metric.help, labels=["node"])
    for node in view.nodes if view else ():
        value: float | None
        if metric.name == "edgeswarm_node_up":
            value = 1.0 if node.state == "online" else 0.0
        elif metric.name == "edgeswarm_node_memory_budget_bytes":
            value = node.memory_budget_bytes
        elif metric.name == "edgeswarm_node_memory_used_bytes":
            value = max(0, node.memory_budget_bytes - node.free_memory_bytes)
        elif metric.name == "edgeswarm_node_memory_reserved_bytes":
            value = node.reserved_memory_bytes
        elif metric.name == "edgeswarm_node_heartbeat_age_seconds":
            ages = [s.heartbeat_age_s for s in node.services if s.heartbeat_age_s is not None]
            value = min(ages) if ages else None
        else:
            value = None
        if value is not None and math.isfinite(value):
            gauge.add_metric([node.node], float(value))
    return gauge


def _rounds_done(state: JobState) -> int | None:

    work = installed_workload(state.kind)
    if work is None:
        return None
    try:
        return work.summary(state).round
    except Exception:  # noqa: BLE001 - a kind's summary of an odd state leaves its figure out, nothing more
        return None


def _from_jobs(metric: MetricDef, jobs: list[JobState]) -> Metric:
    gauge = GaugeMetricFamily(metric.name, metric.help, labels=["job", "kind"])
    for state in jobs:
        value: float | None
        if metric.name == "edgeswarm_job_active":
            value = 0.0 if state.status in FINISHED else 1.0
        elif metric.name == "edgeswarm_job_rounds_done":
            rounds = _rounds_done(state)
            value = float(rounds) if rounds else None
        elif metric.name == "edgeswarm_job_loss":
            loss = getattr(state.progress, "loss", None)
            value = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
        else:
            value = None
        if value is not None and math.isfinite(value):
            gauge.add_metric([state.job_id, state.kind], value)
    return gauge


def _from_links(metric: MetricDef, links: dict[tuple[str, str], _Link]) -> Metric:
    gauge = GaugeMetricFamily(metric.name, metric.help, labels=["node", "peer"])
    for (src, dst), link in sorted(links.items()):
        value = link.rtt_s if metric.name == "edgeswarm_link_rtt_seconds" else link.bandwidth_bps
        if math.isfinite(value):
            gauge.add_metric([src, dst], value)
    return gauge

"""Prometheus metrics for the whole cluster, exposed on the hub.

The collector reads what the dashboard's Observer keeps of what the services already publish: every service's
MetricsReport (its bus's counters, what its programs measured: ``observability.record``), the coordinator's retained
cluster view, the jobs' retained states and the profilers' retained reports (their measured links), the newest of
each (per node and service; per job; per link). It leaves out metrics reports that stopped coming (3 report
intervals) and turns the rest into the families ``observability.catalogue`` lists, on its own CollectorRegistry.
Instance ids are never labels: a restarted service continues its series (Prometheus sees its counters reset).

Everything it reads was validated by the bus's schemas; what the schemas cannot say (a counter below zero, a gauge
that is not finite; a report whose node is not its topic's, which the Observer drops) is left out, and a family that
fails to build is left out of the exposition rather than failing it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

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

from edgeswarm.dashboard.observer import Observer
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages import ClusterView, JobState, MetricsReport
from edgeswarm.messages.jobs import FINISHED
from edgeswarm.observability.catalogue import CATALOGUE, MetricDef, Source
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.workloads import installed_workload

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

STALE_INTERVALS = 3.0  # a service's report this many report intervals old is gone (it publishes each with this TTL)
MAX_REPORTS = 1024  # (node, service) pairs kept
MAX_JOBS = 512
MAX_LINKS = 4096

LabelValues = tuple[str, ...]


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
    """The cluster's metrics as Prometheus families, from what the dashboard's Observer heard (``observer``): the
    metrics reports of the last ``stale_after_s`` seconds, the cluster view, the job states and the links."""

    def __init__(self, observer: Observer, stale_after_s: float) -> None:
        self.observer = observer
        self.stale_after_s = stale_after_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Families(self))

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def snapshot(self) -> tuple[list[MetricsReport], ClusterView | None, list[JobState], list[LinkProfile]]:
        """The fresh metrics reports (stale ones left out), the cluster view, the job states and the links."""
        return self.observer.metrics_inputs(self.stale_after_s)


# --- building the families ------------------------------------------------------------------------------


def _family(metric: MetricDef, reports: list[MetricsReport], view: ClusterView | None, jobs: list[JobState],
            links: list[LinkProfile]) -> Metric | None:
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


def _from_links(metric: MetricDef, links: list[LinkProfile]) -> Metric:
    gauge = GaugeMetricFamily(metric.name, metric.help, labels=["node", "peer"])
    for link in sorted(links, key=lambda link: (link.src, link.dst)):
        value = link.latency_s if metric.name == "edgeswarm_link_rtt_seconds" else link.bandwidth_bps
        if math.isfinite(value):
            gauge.add_metric([link.src, link.dst], value)
    return gauge

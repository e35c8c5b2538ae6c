"""The snapshot builder: pure functions from what the dashboard has observed on the bus to the page's ``Snapshot``.

``Observed`` holds the typed messages as they came (the coordinator's ClusterView, every job's JobState, the
JobEvents and ClusterEvents with their arrival times, the profile reports' links, the MetricsReports' gauges, each
node's clock offset); ``build_snapshot`` turns them into the page's model. Nothing here touches the bus or a clock:
``now`` is an argument.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.dashboard.health import health_warnings
from edgeswarm.dashboard.model import (
    MAX_EVENTS,
    JobCard,
    LinkCell,
    NodeCard,
    ServiceCard,
    Snapshot,
    TimedEvent,
)
from edgeswarm.messages.cluster import ClusterView, NodeView
from edgeswarm.messages.jobs import JobState
from edgeswarm.observability import catalogue
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.schedule import ScheduleView
from edgeswarm.workloads import installed_workload
from edgeswarm.workloads.views import MAX_POINTS, PlanView, Series

log = logging.getLogger(__name__)

# Gauges a node's MetricsReports may carry about its accelerator (any service of the node).


class Observed(BaseModel):
    """What the dashboard knows, as the messages said it. ``gauges``: node -> gauge -> the latest value any of its
    services reported; ``clock_offsets``: node -> seconds its clock runs ahead of the dashboard's (arrival minus
    ``sent_at`` of its live heartbeats, the smallest recent one: the network only adds delay); ``series``: job ->
    every point seen (``merge_series``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    hub_url: str = ""
    view: ClusterView | None = None
    jobs: dict[str, JobState] = Field(default_factory=dict)
    job_events: dict[str, list[TimedEvent]] = Field(default_factory=dict)
    series: dict[str, list[Series]] = Field(default_factory=dict)
    cluster_events: list[TimedEvent] = Field(default_factory=list)
    links: dict[str, LinkProfile] = Field(default_factory=dict)  # "src->dst" -> the latest measurement
    gauges: dict[str, dict[str, float]] = Field(default_factory=dict)
    clock_offsets: dict[str, float] = Field(default_factory=dict)
    schedules: dict[str, ScheduleView] = Field(default_factory=dict)


def merge_series(old: list[Series], new: list[Series]) -> list[Series]:
    """``old`` with ``new``'s points added, by series name and ``x`` (a point at an ``x`` already held replaces it:
    after a recovery a training job runs its rounds again). A restarted run (points before the latest ``x``) drops
    the points beyond it. At most ``MAX_POINTS`` each, the latest kept."""
    by_name = {s.name: s for s in old}
    for fresh in new:
        held = by_name.get(fresh.name)
        if held is None:
            by_name[fresh.name] = fresh.model_copy(update={"points": fresh.points[-MAX_POINTS:]})
            continue
        first_new = min((p.x for p in fresh.points), default=None)
        kept = [p for p in held.points if first_new is None or p.x < first_new]
        points = sorted({p.x: p for p in (*kept, *fresh.points)}.values(), key=lambda p: p.x)[-MAX_POINTS:]
        by_name[fresh.name] = fresh.model_copy(update={"points": tuple(points)})
    return list(by_name.values())


def node_card(node: NodeView, gauges: dict[str, float]) -> NodeCard:
    """One node of the cluster view as the page shows it."""
    ages = [s.heartbeat_age_s for s in node.services if s.heartbeat_age_s is not None and s.state != "offline"]
    util = gauges.get(catalogue.ACCELERATOR_UTILIZATION)
    temp = gauges.get(catalogue.ACCELERATOR_TEMPERATURE)
    return NodeCard(
        node=node.node, state=node.state, device_class=node.device_class, compute=node.compute,
        heartbeat_age_s=min(ages) if ages else None, memory_budget_bytes=node.memory_budget_bytes,
        memory_used_bytes=max(0, node.memory_budget_bytes - node.free_memory_bytes),
        reserved_memory_bytes=node.reserved_memory_bytes,
        accelerator_utilization=util, accelerator_temperature_c=temp,
        data_url=next((s.data_url for s in node.services if s.state != "offline" and s.data_url), ""),
        services=tuple(ServiceCard(service=s.service, state=s.state, heartbeat_age_s=s.heartbeat_age_s)
                       for s in sorted(node.services, key=lambda s: s.service)))


def plan_view(state: JobState) -> PlanView | None:
    """The kind's drawing of ``state``'s plan; None for a kind not installed here or a drawing that fails (a
    plug-in's bug must not take the page down)."""
    work = installed_workload(state.kind)
    if work is None or state.plan is None:
        return None
    try:
        return work.plan_view(state)
    except Exception:
        log.exception("the %s workload could not draw job %s's plan", state.kind, state.job_id)
        return None


def job_series(state: JobState) -> list[Series]:
    """The kind's figures of ``state`` (see ``Workload.series``); none for a kind not installed or a hook that
    fails."""
    work = installed_workload(state.kind)
    if work is None:
        return []
    try:
        return work.series(state)
    except Exception:
        log.exception("the %s workload could not chart job %s", state.kind, state.job_id)
        return []


def job_card(state: JobState, events: list[TimedEvent], series: list[Series],
             schedule: ScheduleView | None) -> JobCard:
    """One job as the page shows it."""
    work = installed_workload(state.kind)
    progress, figures = state.status, ""
    if work is not None:
        try:
            summary = work.summary(state)
            progress, figures = summary.progress, summary.figures
        except Exception:
            log.exception("the %s workload could not summarise job %s", state.kind, state.job_id)
    return JobCard(job_id=state.job_id, kind=state.kind, status=state.status, model=state.model, progress=progress,
                   figures=figures, detail=state.detail, submitted_at=state.submitted_at,
                   updated_at=state.updated_at, plan=plan_view(state), series=tuple(series),
                   events=tuple(events[-MAX_EVENTS:]), schedule=schedule)


def build_snapshot(seen: Observed, now: float, seq: int = 0) -> Snapshot:
    """The page's snapshot of ``seen`` at Unix time ``now``: nodes in name order, links, jobs newest first, the
    latest cluster events and the health warnings."""
    nodes = tuple(node_card(n, seen.gauges.get(n.node, {})) for n in sorted(seen.view.nodes, key=lambda n: n.node)) \
        if seen.view is not None else ()
    links = tuple(LinkCell(src=lp.src, dst=lp.dst, bandwidth_bps=lp.bandwidth_bps, latency_s=lp.latency_s)
                  for _, lp in sorted(seen.links.items()))
    jobs = tuple(job_card(st, seen.job_events.get(jid, []), seen.series.get(jid, []), seen.schedules.get(jid))
                 for jid, st in sorted(seen.jobs.items(), key=lambda kv: -kv[1].submitted_at))
    warnings = health_warnings(view=seen.view, hub_url=seen.hub_url, clock_offsets=seen.clock_offsets,
                               jobs=list(seen.jobs.values()), schedules=seen.schedules)
    return Snapshot(seq=seq, generated_at=now, hub_url=seen.hub_url,
                    view_at=seen.view.generated_at if seen.view is not None else None, nodes=nodes, links=links,
                    jobs=jobs, cluster_events=tuple(seen.cluster_events[-MAX_EVENTS:]), warnings=tuple(warnings))

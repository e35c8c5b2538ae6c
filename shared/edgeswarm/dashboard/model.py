"""The dashboard's snapshot: everything the page draws, as one typed value the server sends as JSON.

Times ending ``_at`` are Unix seconds, ``_s`` seconds, sizes bytes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.values.schedule import ScheduleView
from edgeswarm.workloads.views import PlanView, Series

MAX_EVENTS = 200  # per job and for the cluster: the page shows the latest


class ServiceCard(BaseModel):
    """One service instance of a node as the page lists it."""

    model_config = ConfigDict(frozen=True)

    service: str
    state: str
    heartbeat_age_s: float | None = None


class NodeCard(BaseModel):
    """One node: class, compute device, state, its freshest heartbeat's age, memory against its budget (``used``:
    what its busiest process uses; ``reserved``: the node's ledger), accelerator gauges where its metrics carry them
    (``accelerator_utilization`` 0..1, ``accelerator_temperature_c``)."""

    model_config = ConfigDict(frozen=True)

    node: str
    state: str
    device_class: str
    compute: str = ""
    heartbeat_age_s: float | None = None
    memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    reserved_memory_bytes: int = 0
    accelerator_utilization: float | None = None
    accelerator_temperature_c: float | None = None
    data_url: str = ""
    services: tuple[ServiceCard, ...] = ()


class LinkCell(BaseModel):
    """The measured link from ``src`` to ``dst`` (the latest profile report's): bytes per second and round-trip
    seconds."""

    model_config = ConfigDict(frozen=True)

    src: str
    dst: str
    bandwidth_bps: float
    latency_s: float


class TimedEvent(BaseModel):
    """A job's or the cluster's event, with when it arrived here. ``node``/``service`` only for cluster events."""

    model_config = ConfigDict(frozen=True)

    at: float
    kind: str
    detail: str = ""
    round: int = 0
    node: str = ""
    service: str = ""


class JobCard(BaseModel):
    """One job of any kind: its state in a line (``progress``, ``figures``), its plan drawn (the kind's
    ``plan_view``), its figures as series, its events, and the latest round planned beside measured."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    kind: str
    status: str
    model: str
    progress: str = ""
    figures: str = ""
    detail: str = ""
    submitted_at: float
    updated_at: float
    plan: PlanView | None = None
    series: tuple[Series, ...] = ()
    events: tuple[TimedEvent, ...] = ()
    schedule: ScheduleView | None = None


class HealthWarning(BaseModel):
    """Something a user can act on: ``subject`` (a node, a job, the broker), the ``problem`` and its ``fix``."""

    model_config = ConfigDict(frozen=True)

    check: Literal["data_url", "tls", "clock", "slow", "memory"]
    severity: Literal["warning", "error"] = "warning"
    subject: str
    problem: str
    fix: str


class Snapshot(BaseModel):
    """The whole page. ``seq`` grows with every snapshot built; ``view_at`` is when the coordinator made the cluster
    view it shows (None: no view yet)."""

    model_config = ConfigDict(frozen=True)

    seq: int = 0
    generated_at: float
    hub_url: str = ""
    view_at: float | None = None
    nodes: tuple[NodeCard, ...] = ()
    links: tuple[LinkCell, ...] = ()
    jobs: tuple[JobCard, ...] = ()
    cluster_events: tuple[TimedEvent, ...] = Field(default=(), max_length=MAX_EVENTS)
    warnings: tuple[HealthWarning, ...] = ()

"""PLACEHOLDER (issue 24 interface; the tracing work replaces the body, keeping the signatures)."""

from __future__ import annotations

from edgeswarm.bus import Bus
from edgeswarm.messages.jobs import JobState
from edgeswarm.metrics import Metrics
from edgeswarm.tracing.schedule import ScheduleView


class TraceCollector:
    """Keeps the spans every worker publishes, per job, bounded; answers trace requests on ``request_topic``."""

    def __init__(self, bus: Bus, metrics: Metrics) -> None:
        self.bus = bus
        self.metrics = metrics

    def start(self, request_topic: str) -> None:
        """Subscribe to every node's span batches and answer trace requests sent to ``request_topic``."""

    def jobs(self) -> list[str]:
        """The jobs it holds spans of."""
        return []

    def chrome_trace_json(self, job_id: str) -> bytes:
        """Job ``job_id``'s spans as Chrome trace format (JSON bytes). Raises KeyError for a job it holds none of."""
        raise KeyError(job_id)

    def round_schedule(self, state: JobState) -> ScheduleView | None:
        """The latest round of job ``state`` whose spans are all in, planned beside measured; None when none is."""
        return None

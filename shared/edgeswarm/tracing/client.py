"""Asking the dashboard service for a job's measured spans (``edgeswarm trace``, and a kind's command that draws a
measured round)."""

from __future__ import annotations

from collections.abc import Iterable

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.errors import EdgeswarmError, RequestTimeoutError
from edgeswarm.messages.tracing import SpanRecord, TraceReply, TraceRequest

DASHBOARD_NODE = "hub"
DASHBOARD = "dashboard"
NOT_RUNNING = ("is the dashboard service running? `edgeswarm up --local` starts it (on a deployed hub: its "
               "compose profile, or `edgeswarm service dashboard`)")
SKEW_S = 2.0  # how far a device's clock may be behind the hub's when spans are matched to a submission


class NoTraceError(EdgeswarmError):
    """Nobody answered a trace request, or the answer holds no spans of the job."""


def fetch_trace(bus: Bus, job_id: str, timeout_s: float = 10.0) -> TraceReply:
    """The dashboard's spans of ``job_id``. Raises NoTraceError when nothing answers within ``timeout_s`` seconds
    (saying how to start the dashboard), EdgeswarmError when the request is refused."""
    try:
        reply = bus.request(topics.request(DASHBOARD_NODE, DASHBOARD), TraceRequest(job_id=job_id),
                            timeout_s=timeout_s)
    except RequestTimeoutError:
        raise NoTraceError(f"no answer to a trace request within {timeout_s:.0f} s: {NOT_RUNNING}") from None
    if not isinstance(reply.body, TraceReply):
        raise NoTraceError(f"the dashboard answered a trace request with {type(reply.body).__name__}")
    return reply.body


def submission_spans(spans: Iterable[SpanRecord], submitted_at: float) -> list[SpanRecord]:
    """The ``spans`` of the job submitted at ``submitted_at`` (Unix seconds): an earlier job of the same name's are
    left out."""
    return [s for s in spans if s.start >= submitted_at - SKEW_S]

"""Asking the dashboard service for a job's measured spans (``edgeswarm trace``, and a kind's command that draws a
measured round)."""

from __future__ import annotations

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.errors import EdgeswarmError, RequestTimeoutError
from edgeswarm.messages.tracing import TraceReply, TraceRequest

DASHBOARD_NODE = "hub"
DASHBOARD = "dashboard"
NOT_RUNNING = ("is the dashboard service running? `edgeswarm up --local` starts it (on a deployed hub: its "
               "compose profile, or `edgeswarm service dashboard`)")


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

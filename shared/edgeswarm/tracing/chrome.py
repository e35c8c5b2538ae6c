"""Spans as Chrome trace format (the Trace Event format that chrome://tracing and Perfetto open).

One process per node (``pid``, named by a ``process_name`` metadata event), one thread per lane of that node
(``tid``, named by ``thread_name``), one complete event (``"ph": "X"``) per span with ``ts`` and ``dur`` in
microseconds; ``ts`` counts from the earliest span, whose Unix time is ``otherData.origin_unix_s``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.values.schedule import lane_key

US_PER_S = 1e6


class ChromeEvent(BaseModel):
    """One event of the trace: a complete event (``ph`` "X": ``ts`` and ``dur`` in microseconds) or a metadata event
    (``ph`` "M": ``args.name`` names the process or thread)."""

    model_config = ConfigDict(frozen=True)

    name: str
    ph: str
    pid: int
    tid: int
    ts: float = 0.0
    dur: float | None = None
    cat: str | None = None
    args: dict[str, str | int | float | None] = Field(default_factory=dict)


class ChromeTrace(BaseModel):
    """A whole trace file."""

    model_config = ConfigDict(frozen=True)

    traceEvents: list[ChromeEvent]  # noqa: N815 - the format's own key
    displayTimeUnit: str = "ms"  # noqa: N815
    otherData: dict[str, str | float] = Field(default_factory=dict)  # noqa: N815


def chrome_trace(spans: Sequence[SpanRecord], *, job_id: str = "") -> ChromeTrace:
    """``spans`` as a Chrome trace (see the module's docstring); nodes and lanes numbered in sorted order."""
    nodes = sorted({s.node for s in spans})
    pids = {node: i + 1 for i, node in enumerate(nodes)}
    lanes: dict[tuple[str, str], int] = {}
    for node in nodes:
        for i, lane in enumerate(sorted({s.lane for s in spans if s.node == node}, key=lane_key)):
            lanes[(node, lane)] = i + 1
    origin = min((s.start for s in spans), default=0.0)
    events: list[ChromeEvent] = []
    for node, pid in pids.items():
        events.append(ChromeEvent(name="process_name", ph="M", pid=pid, tid=0, args={"name": node}))
        events.append(ChromeEvent(name="process_sort_index", ph="M", pid=pid, tid=0, args={"sort_index": pid}))
    for (node, lane), tid in lanes.items():
        events.append(ChromeEvent(name="thread_name", ph="M", pid=pids[node], tid=tid, args={"name": lane or "-"}))
        events.append(ChromeEvent(name="thread_sort_index", ph="M", pid=pids[node], tid=tid,
                                  args={"sort_index": tid}))
    for s in sorted(spans, key=lambda s: s.start):
        label = s.name if s.micro_batch is None else f"{s.name} {s.micro_batch}"
        events.append(ChromeEvent(
            name=label, ph="X", cat=s.cat, pid=pids[s.node], tid=lanes[(s.node, s.lane)],
            ts=round((s.start - origin) * US_PER_S, 3), dur=round(s.dur_s * US_PER_S, 3),
            args={"job": s.job_id, "service": s.service, "round": s.round, "micro_batch": s.micro_batch,
                  "samples": s.samples}))
    return ChromeTrace(traceEvents=events, otherData={"job": job_id, "origin_unix_s": origin})


def chrome_trace_bytes(spans: Sequence[SpanRecord], *, job_id: str = "") -> bytes:
    """``chrome_trace(spans)`` as JSON bytes (unset fields left out)."""
    return json.dumps(chrome_trace(spans, job_id=job_id).model_dump(exclude_none=True),
                      separators=(",", ":")).encode()

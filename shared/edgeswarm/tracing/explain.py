"""Where a plan's prediction misses: each planned operation beside its measured spans, the largest gap first.

A kind's planned schedule (``Workload.planned_schedule``: one round of training, or one item through a serving
pipeline, as bars) and the spans its workers measured are lined up by lane and operation ("stage 1" / "backward",
"link 0→1" / "activation"). For each, per unit (a round, an item): the planned seconds (the sum of its planned
occurrences) and the measured seconds (the busiest device on that lane, summed over the unit, averaged over the
units), and one occurrence of each. Operations the plan does not price (waits, the optimizer step) show as measured
only. ``outside spans`` is what the job measured per unit beyond its spans' extent: the messages that start and end
a round, aggregation, checkpoint uploads, a request's queueing, which no operation covers; a plan that prices such
costs names them with a bar on lane ``job`` called ``outside spans``.

Pure functions over typed data (``edgeswarm explain`` fetches and prints; tests feed them directly).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from statistics import fmean
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.values.schedule import ScheduleBar, lane_key

Unit = Literal["round", "item"]
OUTSIDE = "outside spans"  # the operation name of the time a unit took beyond its spans


class OperationGap(BaseModel):
    """One operation on one lane: its planned and measured seconds per unit (``planned_s``, ``measured_s``) and
    per occurrence (``planned_each_s``, ``measured_each_s``; None where it was not planned, or not measured)."""

    model_config = ConfigDict(frozen=True)

    lane: str
    name: str
    cat: str
    planned_s: float = Field(ge=0)
    measured_s: float = Field(ge=0)
    planned_each_s: float | None = None
    measured_each_s: float | None = None

    @property
    def gap_s(self) -> float:
        """Measured minus planned seconds per unit: what this operation adds to (or saves from) the prediction."""
        return self.measured_s - self.planned_s

    @property
    def ratio(self) -> float | None:
        """Measured over planned, None when it was not planned."""
        return self.measured_s / self.planned_s if self.planned_s > 0 else None


class Explanation(BaseModel):
    """A job's plan against its measurement, per ``unit``: ``units`` are the ones measured (round or item
    numbers), ``predicted_s``/``reported_s`` the job's own predicted and measured seconds per unit (None where the
    kind does not say), ``planned_s`` the planned schedule's extent, ``spans_s`` the measured spans' extent averaged
    over the units, and ``operations`` every lined-up operation, the largest gap (either way) first."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    unit: Unit
    units: list[int]
    predicted_s: float | None = None
    reported_s: float | None = None
    planned_s: float = 0.0
    spans_s: float = 0.0
    operations: list[OperationGap] = Field(default_factory=list)


def unit_of(span: SpanRecord, unit: Unit) -> int | None:
    """The round or item a span belongs to (items are numbered by the span's micro-batch)."""
    return span.round if unit == "round" else span.micro_batch


def explain(job_id: str, planned: Sequence[ScheduleBar], spans: Iterable[SpanRecord], unit: Unit,
            units: Sequence[int], *, predicted_s: float | None = None,
            reported_s: float | None = None) -> Explanation:
    """Line up ``planned`` (one unit's planned bars) with the ``spans`` of ``units``; ``predicted_s`` and
    ``reported_s`` are the job's own figures per unit (seconds). Units without spans are left out."""
    wanted = set(units)
    # (lane, name) -> unit -> node -> seconds; and each occurrence's duration.
    busy: dict[tuple[str, str], dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    each: dict[tuple[str, str], list[float]] = defaultdict(list)
    cats: dict[tuple[str, str], str] = {}
    extent: dict[int, tuple[float, float]] = {}
    for s in spans:
        u = unit_of(s, unit)
        if u is None or u not in wanted:
            continue
        key = (s.lane, s.name)
        per_node = busy[key][u]
        per_node[s.node] = per_node.get(s.node, 0.0) + s.dur_s
        each[key].append(s.dur_s)
        cats[key] = s.cat
        lo, hi = extent.get(u, (s.start, s.start + s.dur_s))
        extent[u] = (min(lo, s.start), max(hi, s.start + s.dur_s))
    measured_units = sorted(extent)
    planned_by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for b in planned:
        planned_by[(b.lane, b.name)].append(b.dur_s)
        cats.setdefault((b.lane, b.name), b.cat)
    # A plan may price what no span covers (a round's start and finish messages, say): it lines up with the row
    # of what the job measured beyond its spans, not as an operation of its own.
    planned_outside = sum(planned_by.pop(("job", OUTSIDE), []))
    rows = []
    for key in set(planned_by) | set(busy):
        plan = planned_by.get(key, [])
        per_unit = busy.get(key, {})
        # A unit in which the operation never ran counts as 0 s: it is part of the average like any other.
        measured = fmean(max(per_unit[u].values()) if u in per_unit else 0.0 for u in measured_units) \
            if measured_units else 0.0
        rows.append(OperationGap(lane=key[0], name=key[1], cat=cats[key], planned_s=sum(plan), measured_s=measured,
                                 planned_each_s=fmean(plan) if plan else None,
                                 measured_each_s=fmean(each[key]) if each.get(key) else None))
    spans_s = fmean(hi - lo for lo, hi in extent.values()) if extent else 0.0
    if reported_s is not None and measured_units:
        rows.append(OperationGap(lane="job", name=OUTSIDE, cat="other", planned_s=planned_outside,
                                 measured_s=max(0.0, reported_s - spans_s), planned_each_s=planned_outside or None))
    rows.sort(key=lambda r: (-abs(r.gap_s), lane_key(r.lane), r.name))
    planned_extent = (max(b.start_s + b.dur_s for b in planned) - min(b.start_s for b in planned)) if planned else 0.0
    return Explanation(job_id=job_id, unit=unit, units=measured_units, predicted_s=predicted_s, reported_s=reported_s,
                       planned_s=planned_extent, spans_s=spans_s, operations=rows)

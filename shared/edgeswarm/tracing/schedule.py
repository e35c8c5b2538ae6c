"""One round's schedule, planned beside measured, for the dashboard and the timeline PNG to draw.

Pure functions over typed data: ``measured_bars`` turns one round's spans into bars from the round's start,
``complete_rounds`` says which rounds every device has reported to the end, ``timeline_bars`` turns a simulated
HPP round (``planning.hpp.schedule.Timeline``) into planned bars, and ``schedule_view`` puts both together.

Lanes: a stage is "stage p", the link between two stages "link p→p+1" (both the plan's and the workers' names); a
lane that several devices report in one round (a stage replicated for data parallelism) is shown per device,
"stage p (node)".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.values.schedule import ScheduleBar, ScheduleView, lane_key

if TYPE_CHECKING:
    from edgeswarm.planning.hpp.schedule import Timeline

# The span a device records last in each round (the optimizer step): its round is all in once this one is.
ROUND_END = "step"


def complete_rounds(spans: Iterable[SpanRecord], nodes: Iterable[str] = ()) -> list[int]:
    """The rounds, ascending, that every one of ``nodes`` (empty: every node with spans of that round) has
    reported to the end: it recorded its ``ROUND_END`` span of the round, or any span of a later round."""
    ended: dict[str, set[int]] = {}
    latest: dict[str, int] = {}
    seen: dict[int, set[str]] = {}
    for s in spans:
        if s.round is None:
            continue
        seen.setdefault(s.round, set()).add(s.node)
        latest[s.node] = max(latest.get(s.node, -1), s.round)
        if s.name == ROUND_END:
            ended.setdefault(s.node, set()).add(s.round)
    expected = set(nodes)
    out = []
    for r in sorted(seen):
        who = expected or seen[r]
        if all(r in ended.get(n, set()) or latest.get(n, -1) > r for n in who):
            out.append(r)
    return out


def measured_bars(spans: Iterable[SpanRecord], round_index: int) -> list[ScheduleBar]:
    """The spans of round ``round_index`` as bars from that round's first start (seconds), ordered by start."""
    mine = [s for s in spans if s.round == round_index]
    if not mine:
        return []
    start = min(s.start for s in mine)
    nodes_of: dict[str, set[str]] = {}
    for s in mine:
        nodes_of.setdefault(s.lane, set()).add(s.node)
    return [ScheduleBar(lane=(s.lane if len(nodes_of[s.lane]) == 1 else f"{s.lane} ({s.node})")[:128],
                        name=s.name, cat=s.cat, start_s=max(0.0, s.start - start), dur_s=s.dur_s,
                        source="measured", micro_batch=s.micro_batch)
            for s in sorted(mine, key=lambda s: s.start)]


def timeline_bars(timeline: Timeline) -> list[ScheduleBar]:
    """A simulated HPP round as planned bars: exec step 2p on "stage p" (forward, backward, allreduce), comm step
    2p+1 on "link p→p+1" (activation forward, gradient backward)."""
    bars = []
    for op in timeline.operations:
        comm = op.step % 2 == 1
        p = op.step // 2
        lane = f"link {p}→{p + 1}" if comm else f"stage {p}"
        if op.kind == "AR":
            name, cat = "allreduce", "collective"
        elif comm:
            name, cat = ("activation" if op.kind == "F" else "gradient"), "transfer"
        else:
            name, cat = ("forward" if op.kind == "F" else "backward"), "compute"
        bars.append(ScheduleBar(lane=lane, name=name, cat=cat, start_s=max(0.0, op.start_s),  # type: ignore[arg-type]
                                dur_s=max(0.0, op.duration_s), source="planned", micro_batch=op.micro_batch))
    return bars


def schedule_view(job_id: str, round_index: int, measured: Sequence[ScheduleBar],
                  planned: Sequence[ScheduleBar]) -> ScheduleView:
    """Round ``round_index`` of ``job_id`` with both sets of bars; lanes in the order of their numbers ("stage 0",
    "link 0→1", "stage 1", ...), a device's lane right after its stage's."""
    lanes = sorted({b.lane for b in (*planned, *measured)}, key=lane_key)
    return ScheduleView(job_id=job_id, round=round_index, lanes=tuple(lanes), bars=(*planned, *measured),
                        measured_s=_extent(measured), planned_s=_extent(planned))


def _extent(bars: Sequence[ScheduleBar]) -> float:
    if not bars:
        return 0.0
    return max(b.start_s + b.dur_s for b in bars) - min(b.start_s for b in bars)

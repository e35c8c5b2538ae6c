"""Draw a Plan as a PNG: the stage-to-device map above, one simulated 1F1B round as a timeline below.

Uses matplotlib's Agg canvas on a bare Figure, so nothing touches pyplot's global state or opens a window.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from edgeswarm.extras import missing_extra

try:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
except ModuleNotFoundError:  # matplotlib is the `plot` extra
    raise missing_extra("plot") from None

from edgeswarm.planning.hpp.schedule import Operation, Timeline, plan_timeline
from edgeswarm.planning.hpp.types import CommStepPlan, Plan, StagePlan
from edgeswarm.values.schedule import ScheduleBar, lane_key

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "AR": "#55a868"}
_DPI = 110
_OP_FONT = 6.5
# Average glyph width as a fraction of the font size; decides whether a micro-batch number fits inside its bar.
_GLYPH_EM = 0.62
_TIMELINE_AXES_FRACTION = 0.78
_NAME_CHARS = 16
_ROW_LABEL_DEVICES = 3


def render_plan_png(plan: Plan, path: pathlib.Path, *, title: str = "",
                    measured: MeasuredRound | None = None, measured_note: str = "") -> None:
    """Write ``plan`` as a PNG at ``path`` (the parent folder must exist).

    Top panel: one box per stage with its units [start, end), warm-up K, per-micro-batch times, and per device its
    share of every micro-batch and memory used over budget. Middle panel: ``plan_timeline(plan)``, one row per step
    (exec steps "stage p (devices)", comm steps "link p→p+1"), forward, backward and AllReduce bars, x axis in seconds.
    With ``measured`` (a round's measured bars, ``tracing.schedule.measured_bars``), a bottom panel draws that round
    as the workers recorded it, on the same time axis; without, ``measured_note`` (why there is none) is said under
    the planned timeline. Raises OSError when the file cannot be written and ScheduleError when the plan cannot be
    simulated.
    """
    timeline = plan_timeline(plan)
    stages = len(plan.stages)
    most_devices = max(len(stage.devices) for stage in plan.stages)
    width_in = max(12.0, 2.7 * stages)
    map_in = 0.7 + 0.15 * (most_devices + 3)
    gantt_in = 1.3 + 0.42 * timeline.steps
    lanes = sorted({b.lane for b in measured.bars}, key=lane_key) if measured is not None else []
    measured_in = 1.4 + 0.42 * len(lanes) if lanes else 0.0
    fig = Figure(figsize=(width_in, map_in + gantt_in + measured_in + 0.4), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    # Separate subfigures so the map spans the full width instead of aligning with the timeline's row labels.
    map_fig, gantt_fig = fig.subfigures(2, 1, height_ratios=[map_in, gantt_in + measured_in])
    span = max(timeline.makespan_s, plan.round_latency_s, _measured_end(measured))
    _draw_stage_map(map_fig.subplots(), plan, width_in)
    if measured is not None and lanes:
        # One grid, one shared x axis: the measured round lines up under the planned one, second for second.
        planned_ax, measured_ax = gantt_fig.subplots(2, 1, sharex=True, height_ratios=[gantt_in, measured_in])
        _draw_timeline(planned_ax, plan, timeline, width_in, span_s=span)
        _draw_measured(measured_ax, measured, lanes, plan.round_latency_s, span)
    else:
        _draw_timeline(gantt_fig.subplots(), plan, timeline, width_in, span_s=span, note=measured_note)
    fig.suptitle(title or _default_title(plan, timeline, measured), fontsize=11)
    fig.savefig(path, format="png")


@dataclass(frozen=True)
class MeasuredRound:
    """One round as measured: its ``round`` and its bars (``tracing.schedule.ScheduleBar``, times from the round's
    start in seconds)."""

    round: int
    bars: tuple[ScheduleBar, ...]

    @property
    def makespan_s(self) -> float:
        return max((b.start_s + b.dur_s for b in self.bars), default=0.0)


def _measured_end(measured: MeasuredRound | None) -> float:
    return 0.0 if measured is None else measured.makespan_s


_MEASURED_COLOURS = {"forward": _COLOURS["F"], "backward": _COLOURS["B"], "allreduce": _COLOURS["AR"],
                     "step": _COLOURS["AR"]}
_CAT_COLOURS = {"transfer": "#8172b3", "wait": "#c7c7c7", "collective": _COLOURS["AR"], "compute": "#937860",
                "other": "#999999"}


def _draw_measured(ax: Axes, measured: MeasuredRound, lanes: Sequence[str], predicted_s: float, span: float) -> None:
    row = {lane: i for i, lane in enumerate(lanes)}
    for bar in measured.bars:
        colour = _MEASURED_COLOURS.get(bar.name, _CAT_COLOURS[bar.cat])
        height = 0.45 if bar.cat in ("transfer", "wait") else 0.7
        ax.broken_barh([(bar.start_s, bar.dur_s)], (row[bar.lane] - height / 2, height), facecolors=colour,
                       edgecolors="white", linewidth=0.4, alpha=0.8 if bar.cat in ("transfer", "wait") else 1.0)
    ax.axvline(predicted_s, color="#c44e52", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(lanes)), [_short(lane, 28) for lane in lanes])
    ax.tick_params(axis="y", labelsize=7.5)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01 if span > 0 else 1.0)
    ax.set_xlabel("time in the round (s)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(f"measured: round {measured.round} as the workers recorded it ({measured.makespan_s:.3g} s)",
                 fontsize=9, loc="left")
    handles = [Patch(color=_COLOURS["F"], label="forward"), Patch(color=_COLOURS["B"], label="backward"),
               Patch(color=_COLOURS["AR"], label="AllReduce / step"),
               Patch(color=_CAT_COLOURS["transfer"], label="transfer"),
               Patch(color=_CAT_COLOURS["wait"], label="waiting for a peer")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2 - 0.35 / max(len(lanes), 1)), ncols=5,
              fontsize=7.5, frameon=False)


def _default_title(plan: Plan, timeline: Timeline, measured: MeasuredRound | None = None) -> str:
    o = plan.options
    return (
        f"{plan.strategy} plan, epoch {plan.epoch}: P={len(plan.stages)}, M={o.micro_batches} × B={o.micro_batch_size}"
        f" | predicted round {plan.round_latency_s:.3g} s ({plan.throughput_sps:.3g} samples/s),"
        f" simulated {timeline.makespan_s + plan.round_overhead_s:.3g} s"
        + (f", measured {measured.makespan_s:.3g} s" if measured is not None and measured.bars else "")
    )


def _draw_stage_map(ax: Axes, plan: Plan, width_in: float) -> None:
    stages = len(plan.stages)
    ax.set_xlim(0, stages)
    ax.set_ylim(0, 1)
    ax.axis("off")
    box_w = 0.78
    column_in = width_in * 0.97 / stages
    texts = [_stage_text(stage) for stage in plan.stages]
    box_font = min(7.5, _fitting_font(texts, column_in * (box_w - 0.06)))
    links = [_link_text(link) for link in plan.comm_steps]
    link_font = min(6.5, _fitting_font(links, column_in * (1 - box_w) * 0.95))
    for p, text in enumerate(texts):
        x = p + (1 - box_w) / 2
        ax.add_patch(
            FancyBboxPatch((x, 0.03), box_w, 0.94, boxstyle="round,pad=0.0,rounding_size=0.03",
                           facecolor="#eef2f8", edgecolor="#4c72b0", linewidth=1.2)
        )
        ax.text(x + 0.03, 0.92, text, ha="left", va="top", fontsize=box_font, family="monospace")
        if p < len(links):
            ax.add_patch(
                FancyArrowPatch((x + box_w, 0.5), (p + 1 + (1 - box_w) / 2, 0.5), arrowstyle="<|-|>",
                                mutation_scale=9, color="#555555")
            )
            ax.text(p + 1, 0.54, links[p], ha="center", va="bottom", fontsize=link_font, color="#333333")
    ax.set_title("stage-to-device map", fontsize=9, loc="left")


def _fitting_font(texts: Sequence[str], width_in: float) -> float:
    # The largest font (points) at which the longest line of any text fits in width_in, for monospace-ish glyphs.
    longest = max((len(line) for text in texts for line in text.splitlines()), default=1)
    return width_in * 72 / (max(longest, 1) * _GLYPH_EM)


def _stage_text(stage: StagePlan) -> str:
    lines = [
        f"stage {stage.index}  units [{stage.start}, {stage.end})",
        f"K={stage.warmup}  Ef {_fmt_s(stage.forward_s)}  Eb {_fmt_s(stage.backward_s)}",
    ]
    if stage.allreduce_s > 0:
        lines.append(f"AllReduce {_fmt_s(stage.allreduce_s)}")
    pad = min(_NAME_CHARS, max(len(name) for name in stage.devices))
    for name, share, used, budget in zip(
        stage.devices, stage.shares, stage.memory_bytes, stage.memory_budget_bytes, strict=True
    ):
        fraction = f"{used / budget:.0%}" if budget > 0 else "n/a"
        lines.append(f"{_short(name, pad):<{pad}}  y={share:<3d} mem {fraction} of {_fmt_bytes(budget)}")
    return "\n".join(lines)


def _link_text(link: CommStepPlan) -> str:
    return (
        f"link {link.after}→{link.after + 1}\n{_fmt_bytes(link.bytes_per_microbatch)}/µb"
        f"\n{link.bandwidth_bps / 1e6:.3g} Mbit/s\nF {_fmt_s(link.forward_s)}\nB {_fmt_s(link.backward_s)}"
    )


def _draw_timeline(ax: Axes, plan: Plan, timeline: Timeline, width_in: float, *, span_s: float = 0.0,
                   note: str = "") -> None:
    span = max(timeline.makespan_s, plan.round_latency_s, span_s)
    inches_per_s = width_in * _TIMELINE_AXES_FRACTION / span if span > 0 else 0.0
    by_step: dict[int, list[Operation]] = {s: [] for s in range(timeline.steps)}
    for op in timeline.operations:
        by_step[op.step].append(op)
    for step, ops in by_step.items():
        comm = step % 2 == 1
        height = 0.45 if comm else 0.7
        for kind in ("F", "B", "AR"):
            bars = [(op.start_s, op.duration_s) for op in ops if op.kind == kind]
            if bars:
                ax.broken_barh(bars, (step - height / 2, height), facecolors=_COLOURS[kind],
                               edgecolors="white", linewidth=0.4, alpha=0.7 if comm else 1.0)
        for op in ops:
            label = "AR" if op.kind == "AR" else str(op.micro_batch)
            if op.duration_s * inches_per_s >= _label_width_in(label):
                ax.text(op.start_s + op.duration_s / 2, step, label, ha="center", va="center",
                        fontsize=_OP_FONT, color="white")
    ax.axvline(plan.round_latency_s, color="#c44e52", linestyle="--", linewidth=1)
    ax.set_yticks(range(timeline.steps), _row_labels(plan))
    ax.tick_params(axis="y", labelsize=7.5)
    ax.set_ylim(timeline.steps - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01 if span > 0 else 1.0)
    ax.set_xlabel("time in the round (s)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(f"planned: 1F1B schedule of one round (K = {list(timeline.warmups)})"
                 + (f"; {note}" if note else ""), fontsize=9, loc="left")
    handles = [
        Patch(color=_COLOURS["F"], label="forward (micro-batch)"),
        Patch(color=_COLOURS["B"], label="backward (micro-batch)"),
        Patch(color=_COLOURS["AR"], label="AllReduce"),
        Patch(facecolor="none", edgecolor="#c44e52", linestyle="--", label="predicted latency"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.35 / timeline.steps),
              ncols=4, fontsize=7.5, frameon=False)


def _row_labels(plan: Plan) -> list[str]:
    labels: list[str] = []
    for p, stage in enumerate(plan.stages):
        labels.append(f"stage {p} ({_device_list(stage.devices)})")
        if p < len(plan.comm_steps):
            labels.append(f"link {p}→{p + 1}")
    return labels


def _device_list(devices: Sequence[str]) -> str:
    shown = [_short(d, 12) for d in devices[:_ROW_LABEL_DEVICES]]
    extra = len(devices) - len(shown)
    return ", ".join(shown) + (f", +{extra}" if extra else "")


def _label_width_in(label: str) -> float:
    return (len(label) * _GLYPH_EM + 0.6) * _OP_FONT / 72


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _fmt_bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"

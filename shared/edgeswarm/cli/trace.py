"""``edgeswarm trace JOB --out trace.json``: a job's measured spans as Chrome trace format (Perfetto opens it); and
``edgeswarm explain JOB``: its planned operations beside those spans, the largest gap first (``tracing.explain``).

The spans come from the dashboard service on the hub (its trace collector holds every worker's spans, per job),
asked with a TraceRequest (``tracing.client.fetch_trace``, which HPP's ``train --timeline-png`` uses too).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console
from edgeswarm.errors import ConfigError
from edgeswarm.messages.jobs import JobState
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings
from edgeswarm.tracing.chrome import chrome_trace_bytes
from edgeswarm.tracing.client import NoTraceError, fetch_trace, submission_spans
from edgeswarm.tracing.explain import Explanation, explain
from edgeswarm.workloads.commands import report_file


def add_trace_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm trace``."""
    p = sub.add_parser("trace", help="write a job's measured spans (forward, backward, transfers, waits) as Chrome "
                                     "trace format, for Perfetto or chrome://tracing")
    p.add_argument("job", help="the job's name")
    p.add_argument("--out", type=report_file, required=True, help="the JSON file to write (replaced if it exists)")
    add_hub_arg(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the dashboard's answer")
    p = sub.add_parser("explain", help="a job's planned operations (compute, transfers, collectives) beside its "
                                       "measured spans, per round or item, the largest gap first")
    p.add_argument("job", help="the job's name")
    p.add_argument("--top", type=int, default=15, help="operations shown (default 15; 0: all)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the whole explanation as JSON")
    add_hub_arg(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the dashboard's answer")


def run_trace(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; name the file to write, e.g. {out / (args.job + '.json')}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
    bus = client_bus(Settings(hub_url=hub_url(args.hub) or "mqtt://127.0.0.1:1883"), role="trace")
    try:
        reply = fetch_trace(bus, args.job, args.timeout)
    finally:
        bus.stop()
    if not reply.found:
        held = ", ".join(reply.jobs) or "none"
        raise NoTraceError(f"the dashboard holds no spans of job {args.job} (jobs with spans: {held}); spans are "
                           "kept from when the dashboard started, for its most recent jobs")
    out.write_bytes(chrome_trace_bytes(reply.spans, job_id=args.job))
    spans = reply.spans
    rounds = sorted({s.round for s in spans if s.round is not None})
    nodes = sorted({s.node for s in spans})
    round_text = (f"rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else f"round {rounds[0]}" if rounds
                  else "no rounds")
    dropped = f", {reply.dropped} dropped on the way" if reply.dropped else ""
    console.print(f"wrote {out}: {len(spans)} spans of job {args.job} on {len(nodes)} nodes ({', '.join(nodes)}), "
                  f"{round_text}{dropped}; open it at https://ui.perfetto.dev", markup=False, highlight=False,
                  soft_wrap=True)  # one line however long the path: scripts read it
    return 0


def run_explain(args: argparse.Namespace) -> int:
    from edgeswarm.workloads import installed_workload
    from edgeswarm.workloads.client import job_states

    if args.top < 0:
        raise ConfigError("--top is a count of operations (0: all)")
    bus = client_bus(Settings(hub_url=hub_url(args.hub) or "mqtt://127.0.0.1:1883"), role="trace")
    try:
        state = next((s for s in job_states(bus) if s.job_id == args.job), None)
        if state is None:
            raise ConfigError(f"no job {args.job} on this cluster (`edgeswarm jobs` lists them)")
        reply = fetch_trace(bus, args.job, args.timeout)
    finally:
        bus.stop()
    work = installed_workload(state.kind)
    if work is None:
        raise ConfigError(f"job {args.job} is of kind {state.kind}, which is not installed here")
    spans = submission_spans(reply.spans, state.submitted_at)
    if not spans:
        raise NoTraceError(f"the dashboard holds no spans of job {args.job}: spans are kept from when the dashboard "
                           "started, for its most recent jobs")
    spans, units = work.explained_spans(state, spans)
    predicted, reported = work.unit_seconds(state)
    result = explain(args.job, work.planned_schedule(state), spans, work.schedule_unit, units,
                     predicted_s=predicted, reported_s=reported)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(result.model_dump(mode="json"), indent=2))
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: cannot write it ({exc.strerror or exc})") from None
    _print_explanation(result, state, args.top)
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def _print_explanation(result: Explanation, state: JobState, top: int) -> None:
    unit = result.unit
    if not result.units:
        why = (" (an item is lined up with the plan when it fills the plan's micro-batch: send requests of that "
               "many samples, `edgeswarm infer --rows`)" if unit == "item" else "")
        console.print(f"job {result.job_id}: no complete {unit} measured yet{why}")
        return
    count = len(result.units)
    head = f"job {result.job_id} ({state.kind}), {count} {unit}{'s' if count > 1 else ''} measured: "
    if result.predicted_s and result.reported_s:
        head += (f"predicted {result.predicted_s * 1000:.1f} ms a {unit}, measured {result.reported_s * 1000:.1f} ms "
                 f"({result.reported_s / result.predicted_s:.2f}x); ")
    head += f"the spans cover {result.spans_s * 1000:.1f} ms a {unit}"
    if result.planned_s:
        head += f", the planned schedule {result.planned_s * 1000:.1f} ms"
    console.print(escape(head), highlight=False)
    table = Table(title=f"per {unit}, the largest gap first (ms)")
    for col in ("lane", "operation", "planned", "measured", "gap", "measured / planned", "one planned",
                "one measured"):
        table.add_column(col, justify="left" if col in ("lane", "operation") else "right")
    rows = result.operations[:top] if top else result.operations
    for op in rows:
        table.add_row(escape(op.lane), escape(op.name), _ms(op.planned_s if op.planned_each_s is not None else None),
                      _ms(op.measured_s), f"{op.gap_s * 1000:+.2f}", f"{op.ratio:.2f}x" if op.ratio else "-",
                      _ms(op.planned_each_s), _ms(op.measured_each_s))
    console.print(table)
    if len(rows) < len(result.operations):
        console.print(f"{len(result.operations) - len(rows)} more operations: --top 0 shows all")
    if not any(op.planned_each_s is not None for op in result.operations):
        console.print(f"kind {state.kind} plans no per-operation schedule: measured spans only")

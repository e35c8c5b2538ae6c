"""``edgeswarm train JOB``, ``edgeswarm jobs`` and ``edgeswarm cancel JOB``: training jobs on a running cluster.

``train`` submits the spec to the coordinator, which validates it and runs it (profile, plan, deploy, rounds,
checkpoints). With ``--wait`` the command follows the job's state and events to its end, and ``--compare``
then runs the same job for a few rounds under other strategies, so the prediction against the baselines is
measured too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from edgeswarm.bus import Bus
from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console
from edgeswarm.errors import ConfigError
from edgeswarm.messages.jobs import JobEvent, JobState
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings

if TYPE_CHECKING:  # torch: imported only when a job starts from a file
    pass
from edgeswarm.plugins import load_target
from edgeswarm.workloads import installed_workload, parse_spec_text, workload
from edgeswarm.workloads.client import JobFollower, cancel_job, job_states, submit_job, write_run_json
from edgeswarm.workloads.views import PlanView


def add_train_parser(sub: argparse._SubParsersAction, *, kind_options: bool = True) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm train``, ``edgeswarm jobs`` and ``edgeswarm cancel``; with ``kind_options``, every
    installed kind's own ``train`` options too (its ``train_arguments``: finding them imports every kind)."""
    p = sub.add_parser("train", help="submit a training job (YAML or JSON spec) to the cluster's coordinator")
    p.add_argument("job", help="the job spec file")
    add_hub_arg(p)
    p.add_argument("--wait", action="store_true", help="follow the job to its end with a progress bar")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits for the job (and each compare)")
    p.add_argument("--json", default=None, metavar="FILE", help="with --wait: write the final state and rounds to FILE")
    if kind_options:
        from edgeswarm.cli.kind_commands import add_kind_arguments

        add_kind_arguments(p, "train_arguments")

    jobs = sub.add_parser("jobs", help="every job the coordinator knows, with its state; or one job and its plan")
    jobs.add_argument("job_id", nargs="?", default=None, help="show this job only, with its plan device by device")
    add_hub_arg(jobs)
    jobs.add_argument("--json", action="store_true", help="print the states as JSON, each with its plan view")

    cancel = sub.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id", help="the job's name")
    add_hub_arg(cancel)


def job_bus(args: argparse.Namespace) -> Bus:
    """A client bus on the hub of ``--hub`` (the jobs commands' connection)."""
    return client_bus(Settings(hub_url=hub_url(args.hub) or "mqtt://127.0.0.1:1883"))


def read_spec(path: Path) -> str:
    """The text of a job spec file. Raises ConfigError when it cannot be read."""
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the job spec {path}: {exc}") from None


def run_train(args: argparse.Namespace) -> int:
    """``edgeswarm train SPEC``: the kind's own way (its ``train_cli``), or submitted and, with ``--wait``, followed
    the common way."""
    path = Path(args.job)
    text = read_spec(path)
    job = parse_spec_text(text, source=str(path))  # the coordinator checks again; this fails before connecting
    work = workload(job.kind)  # type: ignore[attr-defined]
    if work.command != "train":
        raise ConfigError(f"{path} is a {work.kind} job: `edgeswarm {work.command}` runs it")
    if work.train_cli:
        from edgeswarm.cli.kind_commands import command_tools

        train = load_target(work.train_cli, f"the train command of {work.kind}")
        return int(train(args, job, text, command_tools(args)))
    return run_job_spec(args, job.name, text)  # type: ignore[attr-defined]


def run_jobs(args: argparse.Namespace) -> int:
    bus = job_bus(args)
    try:
        states = job_states(bus)
    finally:
        bus.stop()
    if args.job_id is not None:
        states = [s for s in states if s.job_id == args.job_id]
        if not states:
            raise ConfigError(f"no job {args.job_id} on this cluster (`edgeswarm jobs` lists them)")
    if args.json:
        # The whole plan is long; its devices per stage say where the job runs, its view what each one does.
        console.print_json(json.dumps([{**s.model_dump(mode="json", exclude={"plan"}),
                                         "stages": _stage_devices(s), "plan_view": _plan_view_json(s)}
                                        for s in states]))
        return 0
    if args.job_id is not None:
        print_job(states[0])
        return 0
    if not states:
        console.print("no jobs")
        return 0
    table = Table(title="jobs")
    for col in ("job", "kind", "status", "model", "progress", "figures", "detail"):
        table.add_column(col)
    for s in states:
        table.add_row(s.job_id, s.kind, s.status, escape(s.model), *_progress_cells(s), escape(s.detail[:80]))
    console.print(table)
    return 0


def _plan_view(state: JobState) -> PlanView | None:
    """The job's plan as its kind draws it (the dashboard's), None without a plan or the kind installed here."""
    work = installed_workload(state.kind)
    return work.plan_view(state) if work is not None else None


def _plan_view_json(state: JobState) -> dict[str, object] | None:
    view = _plan_view(state)
    return view.model_dump(mode="json") if view is not None else None


def print_job(state: JobState) -> None:
    """One job: its state in a line, then its plan group by group, each device with its share of the work."""
    progress, figures = _progress_cells(state)
    console.print(f"job {escape(state.job_id)} ({state.kind}, model {escape(state.model)}): {state.status}; "
                  f"{escape(progress)}; {escape(figures)}" + (f" ({escape(state.detail)})" if state.detail else ""))
    view = _plan_view(state)
    if view is None:
        console.print("no plan yet")
        return
    table = Table(title=f"plan (epoch {view.epoch}): {view.summary}" if view.summary else f"plan (epoch {view.epoch})")
    for col in ("group", "device", "share", "what it does"):
        table.add_column(col)
    for group in view.groups:
        for i, block in enumerate(group.blocks):
            table.add_row(escape(group.label) if i == 0 else "", escape(block.device), f"{block.share:.0%}",
                          escape(block.detail))
        if group.detail:
            table.add_row("", "", "", escape(group.detail))
    console.print(table)


def _stage_devices(state: JobState) -> list[list[str]]:
    """Every stage's devices of the job's plan (none for a kind not installed here)."""
    work = installed_workload(state.kind)
    return work.stage_devices(state.plan) if work is not None and state.plan is not None else []


def _progress_cells(state: JobState) -> tuple[str, str]:
    """How far a job is, and its latest figures, for the jobs table: its workload's summary."""
    work = installed_workload(state.kind)
    if work is None:
        return f"(job kind {state.kind} is not installed here)", "-"
    summary = work.summary(state)
    return summary.progress, summary.figures


def submit_printing_events(bus: Bus, name: str, text: str) -> JobFollower:
    """Submit the spec ``text`` of job ``name`` with a follower that prints each of its events; returns it."""
    def on_event(event: JobEvent) -> None:
        console.print(f"[dim]{event.kind}[/dim] {escape(event.detail)}", highlight=False)

    follower = JobFollower(bus, name, on_event=on_event)
    accepted = submit_job(bus, text, submission=follower.submission)
    console.print(f"job {name} submitted: {accepted.detail}")
    return follower


def run_job_spec(args: argparse.Namespace, name: str, text: str) -> int:
    """Submit the spec ``text`` of job ``name`` (of any kind) and, with ``--wait``, print its events and follow it
    to its end: 0 when it succeeded."""
    bus = job_bus(args)
    try:
        follower = submit_printing_events(bus, name, text)
        if not args.wait:
            return 0
        final = follower.wait(args.timeout)
    finally:
        bus.stop()
    progress, figures = _progress_cells(final)
    console.print(f"job {name} {final.status}: {escape(progress)}; {escape(figures)}" +
                  (f" ({escape(final.detail)})" if final.detail else ""))
    if args.json:
        write_run_json(Path(args.json), final, follower)
        console.print(f"the job's final state and rounds written to {args.json}")
    return 0 if final.status == "succeeded" else 1


def run_cancel(args: argparse.Namespace) -> int:
    bus = job_bus(args)
    try:
        accepted = cancel_job(bus, args.job_id)
    finally:
        bus.stop()
    console.print(f"job {accepted.job_id}: {accepted.detail}")
    return 0

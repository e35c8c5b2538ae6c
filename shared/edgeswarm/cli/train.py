"""``edgeswarm train JOB``, ``edgeswarm jobs`` and ``edgeswarm cancel JOB``: training jobs on a running cluster.

``train`` submits the spec to the coordinator, which validates it and runs it (profile, plan, deploy, rounds,
checkpoints). With ``--wait`` the command follows the job's state and events to its end, and ``--compare``
then runs the same job for a few rounds under other strategies, so the prediction against the baselines is
measured too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgeswarm.bus import Bus
from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console, err_console
from edgeswarm.cli.plan import plan_table
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.extras import require_extra
from edgeswarm.hpp.spec import JobSpec, TrainProgress
from edgeswarm.messages.jobs import JobEvent, JobState
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings

if TYPE_CHECKING:  # torch: imported only when a job starts from a file
    from edgeswarm.hpp.model_file import ModelFile
    from edgeswarm.planning.hpp.render import MeasuredRound
from edgeswarm.workloads import installed_workload, parse_spec_text, workload
from edgeswarm.workloads.client import JobFollower, cancel_job, job_states, submit_job
from edgeswarm.workloads.views import PlanView

STRATEGIES = ("hpp", "dp", "pp", "single")


def add_train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm train``, ``edgeswarm jobs`` and ``edgeswarm cancel``."""
    p = sub.add_parser("train", help="submit a training job (YAML or JSON spec) to the cluster's coordinator")
    p.add_argument("job", help="the job spec file")
    add_hub_arg(p)
    p.add_argument("--wait", action="store_true", help="follow the job to its end with a progress bar")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits for the job (and each compare)")
    p.add_argument("--json", default=None, metavar="FILE", help="with --wait: write the final state and rounds to FILE")
    p.add_argument("--loss-png", default=None, metavar="FILE", help="with --wait: write the loss curve to FILE")
    p.add_argument("--timeline-png", default=None, metavar="FILE",
                   help="with --wait: write the plan and its schedule timeline to FILE")
    p.add_argument("--compare", default="", metavar="STRATEGIES",
                   help="with --wait: then run the job under these strategies too (comma-separated: dp,pp,single) "
                        "and print predicted against measured for each")
    p.add_argument("--compare-rounds", type=int, default=3, help="rounds of each --compare run")
    p.add_argument("--recovery", choices=("light", "heavy", "none"), default=None,
                   help="override the spec's recovery: how a lost device is replaced (none: the job fails)")

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
    path = Path(args.job)
    text = read_spec(path)
    job = parse_spec_text(text, source=str(path))  # the coordinator checks again; this fails before connecting
    work = workload(job.kind)  # type: ignore[attr-defined]
    if work.command != "train":
        raise ConfigError(f"{path} is a {work.kind} job: `edgeswarm {work.command}` runs it")
    if not isinstance(job, JobSpec):  # another kind that trains: submitted and followed the common way
        return run_job_spec(args, job.name, text)  # type: ignore[attr-defined]
    if args.recovery is not None:
        job = job.model_copy(update={"recovery": args.recovery})
        text = job.model_dump_json()
    compare = [s.strip() for s in args.compare.split(",") if s.strip()]
    unknown = [s for s in compare if s not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--compare: unknown strategies {', '.join(unknown)}; known: {', '.join(STRATEGIES)}")
    if args.loss_png or args.timeline_png:
        require_extra("plot")  # now, not after the whole training run
    initial = _read_initial(job, path) if job.init is not None else None
    bus = job_bus(args)
    try:
        if initial is not None:
            job, text = _upload_initial(bus, job, initial)
        if not args.wait:
            accepted = submit_job(bus, text)
            console.print(f"job {job.name} submitted: {accepted.detail}; follow it with `edgeswarm jobs`")
            return 0
        final, follower = _follow(bus, job, text, args.timeout, verbose=True)
        _report(job, final, follower, args, bus)
        if final.status != "succeeded":
            return 1
        measured = {job.strategy: _measured_round_s(follower)}
        for strategy in compare:
            variant = job.model_copy(update={"name": f"{job.name}-{strategy}", "strategy": strategy,
                                             "rounds": args.compare_rounds, "epochs": None, "checkpoint_interval": 0})
            console.print(f"measuring {strategy}: {args.compare_rounds} rounds as job {variant.name} ...")
            variant_text = variant.model_dump_json()
            if initial is not None:  # every strategy starts from the same weights
                variant, variant_text = _upload_initial(bus, variant, initial)
            state, run = _follow(bus, variant, variant_text, args.timeout, verbose=False)
            measured[strategy] = _measured_round_s(run) if state.status == "succeeded" else None
            if state.status != "succeeded":
                err_console.print(f"  {strategy}: {state.status}: {escape(state.detail)}")
        if compare:
            _print_comparison(final, measured, job.global_batch)
        return 0
    finally:
        bus.stop()


def _read_initial(job: JobSpec, spec_path: Path) -> ModelFile:
    """The weights file of ``job.init`` (a relative path is taken from the spec file's folder), checked against the
    job's model: ConfigError listing every problem, before anything is sent."""
    from edgeswarm.hpp.initial import check_initial
    from edgeswarm.hpp.model_file import read_model_file

    assert job.init is not None
    file_path = Path(job.init.file).expanduser()
    if not file_path.is_absolute():
        file_path = spec_path.parent / file_path
    initial = read_model_file(file_path, max_bytes=Settings().checkpoint_max_bytes)
    check_initial(job, initial)
    return initial


def _upload_initial(bus: Bus, job: JobSpec, initial: ModelFile) -> tuple[JobSpec, str]:
    """Store the job's initial weights as version 0 of its checkpoints; returns the job and its text with the
    file's SHA-256 filled in, for the coordinator to check."""
    from edgeswarm.hpp.initial import upload_initial

    assert job.init is not None
    upload_initial(bus, "hub", job, initial)
    console.print(f"uploaded {job.init.file} ({initial.file_bytes} bytes, sha256 {initial.sha256[:16]}...) as "
                  f"version 0 of job {job.name}")
    job = job.model_copy(update={"init": job.init.model_copy(update={"sha256": initial.sha256})})
    return job, job.model_dump_json()


def _follow(bus, job: JobSpec, text: str, timeout_s: float, *, verbose: bool) -> tuple[JobState, JobFollower]:  # type: ignore[no-untyped-def]
    progress = Progress(TextColumn("round {task.completed}/{task.total}"), BarColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("", total=None)
    shown_plan = False

    def on_state(state: JobState) -> None:
        nonlocal shown_plan
        if isinstance(state.plan, Plan) and not shown_plan and verbose:
            shown_plan = True
            progress.console.print(plan_table(state.plan, []))
            progress.console.print(f"predicted {state.plan.round_latency_s:.3f} s per round, "
                                   f"{state.plan.throughput_sps:.1f} samples/s")
        t = state.progress_as(TrainProgress)
        if t.round_s is not None and t.predicted_round_s and t.loss is not None and t.accuracy is not None and \
                t.samples_per_s is not None:
            progress.update(task, completed=t.round, total=t.total_rounds or None, description=(
                f"loss {t.loss:.4f}  accuracy {t.accuracy:.1%}  {t.samples_per_s:.1f} samples/s  "
                f"round {t.round_s:.3f} s = {t.round_s / t.predicted_round_s:.2f}x predicted"))

    def on_event(event: JobEvent) -> None:
        if verbose and event.kind != "round":
            progress.console.print(f"[dim]{event.kind}[/dim] {escape(event.detail)}", highlight=False)

    follower = JobFollower(bus, job.name, on_state=on_state, on_event=on_event)
    accepted = submit_job(bus, text, submission=follower.submission)
    if verbose:
        console.print(f"job {job.name} submitted: {accepted.detail}")
    progress.start()
    try:
        final = follower.wait(timeout_s)
    finally:
        progress.stop()
    return final, follower


def _measured_round_s(follower: JobFollower) -> float | None:
    """Mean wall time of the rounds after the first (which also warms up every device), or of the only one."""
    rounds = [s.progress_as(TrainProgress) for _, s in sorted(follower.rounds.items())]
    times = [t.round_s for t in rounds if t.round_s is not None]
    if not times:
        return None
    return statistics.fmean(times[1:] if len(times) > 1 else times)


def _report(job: JobSpec, final: JobState, follower: JobFollower, args: argparse.Namespace, bus: Bus) -> None:
    rounds = sorted(follower.rounds.items())
    if final.status != "succeeded":
        err_console.print(f"job {job.name} {final.status}: {escape(final.detail)}")
    measured = _measured_round_s(follower)
    t = final.progress_as(TrainProgress)
    if rounds and measured is not None and t.predicted_round_s:
        first, last = rounds[0][1].progress_as(TrainProgress), rounds[-1][1].progress_as(TrainProgress)
        console.print(f"job {job.name} {final.status}: {len(rounds)} rounds, loss {first.loss:.4f} -> "
                      f"{last.loss:.4f}, accuracy {first.accuracy:.1%} -> {last.accuracy:.1%}; measured "
                      f"{measured:.3f} s per round against {t.predicted_round_s:.3f} s predicted "
                      f"({measured / t.predicted_round_s:.2f}x), {job.global_batch / measured:.1f} samples/s")
    if t.checkpoint_version is not None:
        console.print(f"final model in the checkpoint store as job {job.name} version {t.checkpoint_version}")
    if t.test_accuracy is not None:
        console.print(f"held-out accuracy of the saved model: {t.test_accuracy:.1%}")
    if args.json:
        write_run_json(Path(args.json), final, follower)
    if args.loss_png and rounds:
        from edgeswarm.hpp.curves import render_loss_png

        figures = [s.progress_as(TrainProgress) for _, s in rounds]
        render_loss_png([r for r, _ in rounds], [f.loss or 0.0 for f in figures],
                        [f.accuracy or 0.0 for f in figures], Path(args.loss_png),
                        title=f"{job.name}: {job.model.name}, {job.strategy}, global batch {job.global_batch}")
        console.print(f"loss curve written to {args.loss_png}")
    if args.timeline_png and isinstance(final.plan, Plan):
        from edgeswarm.planning.hpp.render import render_plan_png

        measured, note = measured_round(bus, final)
        render_plan_png(final.plan, Path(args.timeline_png), measured=measured, measured_note=note)
        console.print(f"plan and schedule timeline written to {args.timeline_png}"
                      + (f", with round {measured.round} as measured" if measured is not None else f" ({note})"))


SKEW_S = 2.0  # how far a device's clock may be behind the hub's when spans are matched to a submission


def measured_round(bus: Bus, final: JobState) -> tuple[MeasuredRound | None, str]:
    """The job's last round whose spans are all in, from the dashboard's trace collector, or None and why not."""
    from edgeswarm.cli.trace import NoTraceError, fetch_trace
    from edgeswarm.planning.hpp.render import MeasuredRound
    from edgeswarm.tracing.schedule import complete_rounds, measured_bars

    assert isinstance(final.plan, Plan)
    nodes = [d for stage in final.plan.stages for d in stage.devices]
    rounds: list[int] = []
    for attempt in range(2):  # the last round's spans follow its end by up to a publishing interval
        try:
            reply = fetch_trace(bus, final.job_id, timeout_s=5.0)
        except NoTraceError:
            return None, "no measured round: the dashboard service did not answer"
        except EdgeswarmError as exc:  # refused (the ACL, say): the planned timeline is still worth drawing
            return None, f"no measured round: {exc}"
        # Spans of an earlier job of the same name are left out.
        spans = [s for s in reply.spans if s.start >= final.submitted_at - SKEW_S]
        rounds = complete_rounds(spans, nodes)
        if not reply.found or (rounds and rounds[-1] >= final.progress_as(TrainProgress).round - 1) or attempt:
            break
        time.sleep(1.0)
    if not rounds:
        return None, "no measured round: the dashboard holds no complete round of the job"
    return MeasuredRound(round=rounds[-1], bars=tuple(measured_bars(spans, rounds[-1]))), ""


def _print_comparison(final: JobState, measured: dict[str, float | None], global_batch: int) -> None:
    table = Table(title="strategies on this cluster: predicted by the planner, measured on the stage-workers")
    for col in ("strategy", "predicted round (s)", "measured round (s)", "measured / predicted", "measured samples/s",
                "HPP speed-up (measured)"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    predicted = {p.strategy: p for p in final.progress_as(TrainProgress).predictions}
    hpp = measured.get("hpp")
    for strategy, seconds in measured.items():
        p = predicted.get(strategy)
        pred = p.round_s if p is not None else None
        table.add_row(strategy, f"{pred:.3f}" if pred else (p.error or "-") if p else "-",
                      f"{seconds:.3f}" if seconds else "failed",
                      f"{seconds / pred:.2f}x" if seconds and pred else "-",
                      f"{global_batch / seconds:.1f}" if seconds else "-",
                      f"{seconds / hpp:.2f}x" if seconds and hpp else "-")
    console.print(table)


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
        _print_job(states[0])
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


def _print_job(state: JobState) -> None:
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
    return 0 if final.status == "succeeded" else 1


def write_run_json(path: Path, final: JobState, follower: JobFollower) -> None:
    """Write a followed job's record to ``path``: ``state`` (its final state) and ``rounds`` (its kind's progress
    after each round, in order; the per-strategy predictions left out, the final state has them). Raises
    ConfigError when the file cannot be written."""
    rounds = [s.progress.model_dump(mode="json", exclude={"predictions"}) for _, s in sorted(follower.rounds.items())]
    try:
        path.write_text(json.dumps({"state": final.model_dump(mode="json"), "rounds": rounds}, indent=2))
    except OSError as exc:
        raise ConfigError(f"cannot write --json {path}: {exc}") from None
    console.print(f"the job's final state and rounds written to {path}")


def run_cancel(args: argparse.Namespace) -> int:
    bus = job_bus(args)
    try:
        accepted = cancel_job(bus, args.job_id)
    finally:
        bus.stop()
    console.print(f"job {accepted.job_id}: {accepted.detail}")
    return 0

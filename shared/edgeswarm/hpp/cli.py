"""What HPP training adds to the command line: ``edgeswarm export JOB`` (a verb of its own, the kind's ``commands``),
how ``edgeswarm train`` runs its jobs (``train_cli``: initial weights, a progress bar, the loss curve, the timeline
beside a measured round, ``--compare``'s strategies predicted against measured) and how ``edgeswarm plan`` shows its
plan beside single, DP and PP (``plan_cli``).

``export`` writes a training job's checkpoint as one standard safetensors file: the whole model's state dict under
the plain torch model's names (``load_state_dict`` takes it as is) with the model, its config, the job and the
version in its metadata; docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgeswarm.bus import Bus
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.extras import require_extra
from edgeswarm.hpp.spec import JobSpec, StrategyPrediction, TrainProgress
from edgeswarm.messages.jobs import JobEvent, JobState
from edgeswarm.planning.hpp.compare import Comparison, compare
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.settings import Settings
from edgeswarm.values.profiles import ClusterProfile
from edgeswarm.workloads.client import JobFollower, submit_job, write_run_json
from edgeswarm.workloads.commands import Command, CommandTools, report_file

if TYPE_CHECKING:  # torch: imported only when a job starts from a file
    from edgeswarm.hpp.model_file import ModelFile
    from edgeswarm.planning.hpp.render import MeasuredRound

STORE_NODE = "hub"
STRATEGIES = ("hpp", "dp", "pp", "single")


class ExportCommand(Command):
    name = "export"
    help = "write a training job's checkpoint as one safetensors file (plain torch and Hugging Face tools load it)"
    hub = True

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("job", help="the training job's name")
        p.add_argument("--version", type=int, default=None,
                       help="the checkpoint version (default: the latest complete)")
        p.add_argument("--out", type=report_file, required=True,
                       help="the safetensors file to write (replaced if it exists)")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each part of the checkpoint")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        from edgeswarm.checkpoints.client import loader_status
        from edgeswarm.hpp.export import export_model
        from edgeswarm.hpp.model_file import write_model_file

        out = Path(args.out)
        if out.is_dir():
            raise ConfigError(f"--out {out} is a folder; name the file to write, e.g. "
                              f"{out / (args.job + '.safetensors')}")
        if not out.parent.is_dir():
            raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
        if args.version is not None and args.version < 0:
            raise ConfigError(f"--version {args.version}: versions are 0 or more")
        bus = tools.hub_bus("export")
        try:
            with loader_status(bus):
                exported = export_model(bus, STORE_NODE, args.job, args.version, timeout_s=args.timeout)
        finally:
            bus.stop()
        size, sha256 = write_model_file(out, exported.state, exported.metadata())
        params = sum(t.numel() for t in exported.state.values())
        tools.console.print(f"wrote {out}: {exported.model.name}, version {exported.version} of job "
                            f"{exported.job_id}, {len(exported.state)} tensors ({params} values), {size} bytes, "
                            f"sha256 {sha256[:16]}...")
        return 0


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """HPP's options of ``edgeswarm train`` (the kind's ``train_arguments``; ``--wait``, ``--timeout`` and ``--json``
    are every kind's)."""
    p.add_argument("--loss-png", default=None, metavar="FILE", help="with --wait: write the loss curve to FILE")
    p.add_argument("--timeline-png", default=None, metavar="FILE",
                   help="with --wait: write the plan and its schedule timeline to FILE")
    p.add_argument("--compare", default="", metavar="STRATEGIES",
                   help="with --wait: then run the job under these strategies too (comma-separated: dp,pp,single) "
                        "and print predicted against measured for each")
    p.add_argument("--compare-rounds", type=int, default=3, help="rounds of each --compare run")
    p.add_argument("--recovery", choices=("light", "heavy", "none"), default=None,
                   help="override the spec's recovery: how a lost device is replaced (none: the job fails)")


def run_train(args: argparse.Namespace, job: BaseModel, text: str, tools: CommandTools) -> int:
    """``edgeswarm train`` for an HPP job (the kind's ``train_cli``): its initial weights uploaded first, then with
    ``--wait`` followed with a progress bar to its end (the loss curve, the plan's timeline beside a measured round,
    the run as JSON), and ``--compare``'s strategies run after it, predicted against measured."""
    assert isinstance(job, JobSpec)
    path = Path(args.job)
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
    bus = tools.hub_bus("cli")
    try:
        if initial is not None:
            job, text = _upload_initial(bus, job, initial, tools)
        if not args.wait:
            accepted = submit_job(bus, text)
            tools.console.print(f"job {job.name} submitted: {accepted.detail}; follow it with `edgeswarm jobs`")
            return 0
        final, follower = _follow(bus, job, text, args.timeout, tools, verbose=True)
        _report(job, final, follower, args, bus, tools)
        if final.status != "succeeded":
            return 1
        measured = {job.strategy: _measured_round_s(follower)}
        refitted = {job.strategy: final.progress_as(TrainProgress).refitted_round_s}
        predicted = {job.strategy: _own_prediction(final)}
        for strategy in compare:
            variant = job.model_copy(update={"name": f"{job.name}-{strategy}", "strategy": strategy,
                                             "rounds": args.compare_rounds, "epochs": None, "checkpoint_interval": 0})
            tools.console.print(f"measuring {strategy}: {args.compare_rounds} rounds as job {variant.name} ...")
            variant_text = variant.model_dump_json()
            if initial is not None:  # every strategy starts from the same weights
                variant, variant_text = _upload_initial(bus, variant, initial, tools)
            state, run = _follow(bus, variant, variant_text, args.timeout, tools, verbose=False)
            measured[strategy] = _measured_round_s(run) if state.status == "succeeded" else None
            refitted[strategy] = state.progress_as(TrainProgress).refitted_round_s
            predicted[strategy] = _own_prediction(state)
            if state.status != "succeeded":
                tools.err_console.print(f"  {strategy}: {state.status}: {escape(state.detail)}")
        if compare:
            _print_comparison(predicted, measured, refitted, job.global_batch, tools)
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


def _upload_initial(bus: Bus, job: JobSpec, initial: ModelFile, tools: CommandTools) -> tuple[JobSpec, str]:
    """Store the job's initial weights as version 0 of its checkpoints; returns the job and its text with the
    file's SHA-256 filled in, for the coordinator to check."""
    from edgeswarm.hpp.initial import upload_initial

    assert job.init is not None
    upload_initial(bus, "hub", job, initial)
    tools.console.print(f"uploaded {job.init.file} ({initial.file_bytes} bytes, sha256 {initial.sha256[:16]}...) as "
                        f"version 0 of job {job.name}")
    job = job.model_copy(update={"init": job.init.model_copy(update={"sha256": initial.sha256})})
    return job, job.model_dump_json()


def _follow(bus: Bus, job: JobSpec, text: str, timeout_s: float, tools: CommandTools, *, verbose: bool
            ) -> tuple[JobState, JobFollower]:
    progress = Progress(TextColumn("round {task.completed}/{task.total}"), BarColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(), console=tools.console)
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
                f"round {t.round_s:.3f} s = {t.round_s / t.predicted_round_s:.2f}x predicted"
                + (f", {t.round_s / t.refitted_round_s:.2f}x refitted" if t.refitted_round_s else "")))

    def on_event(event: JobEvent) -> None:
        if verbose and event.kind != "round":
            progress.console.print(f"[dim]{event.kind}[/dim] {escape(event.detail)}", highlight=False)

    follower = JobFollower(bus, job.name, on_state=on_state, on_event=on_event)
    accepted = submit_job(bus, text, submission=follower.submission)
    if verbose:
        tools.console.print(f"job {job.name} submitted: {accepted.detail}")
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


def _report(job: JobSpec, final: JobState, follower: JobFollower, args: argparse.Namespace, bus: Bus,
            tools: CommandTools) -> None:
    rounds = sorted(follower.rounds.items())
    if final.status != "succeeded":
        tools.err_console.print(f"job {job.name} {final.status}: {escape(final.detail)}")
    measured = _measured_round_s(follower)
    t = final.progress_as(TrainProgress)
    if rounds and measured is not None and t.predicted_round_s:
        first, last = rounds[0][1].progress_as(TrainProgress), rounds[-1][1].progress_as(TrainProgress)
        tools.console.print(f"job {job.name} {final.status}: {len(rounds)} rounds, loss {first.loss:.4f} -> "
                            f"{last.loss:.4f}, accuracy {first.accuracy:.1%} -> {last.accuracy:.1%}; measured "
                            f"{measured:.3f} s per round against {t.predicted_round_s:.3f} s predicted "
                            f"({measured / t.predicted_round_s:.2f}x"
                            + (f"; {measured / t.refitted_round_s:.2f}x the last refitted prediction, "
                               f"{t.refitted_round_s:.3f} s" if t.refitted_round_s else "")
                            + f"), {job.global_batch / measured:.1f} samples/s")
    if t.checkpoint_version is not None:
        tools.console.print(f"final model in the checkpoint store as job {job.name} version {t.checkpoint_version}")
    if t.test_accuracy is not None:
        tools.console.print(f"held-out accuracy of the saved model: {t.test_accuracy:.1%}")
    if args.json:
        write_run_json(Path(args.json), final, follower)
        tools.console.print(f"the job's final state and rounds written to {args.json}")
    if args.loss_png and rounds:
        from edgeswarm.hpp.curves import render_loss_png

        figures = [s.progress_as(TrainProgress) for _, s in rounds]
        render_loss_png([r for r, _ in rounds], [f.loss or 0.0 for f in figures],
                        [f.accuracy or 0.0 for f in figures], Path(args.loss_png),
                        title=f"{job.name}: {job.model.name}, {job.strategy}, global batch {job.global_batch}")
        tools.console.print(f"loss curve written to {args.loss_png}")
    if args.timeline_png and isinstance(final.plan, Plan):
        from edgeswarm.planning.hpp.render import render_plan_png

        measured, note = measured_round(bus, final)
        render_plan_png(final.plan, Path(args.timeline_png), measured=measured, measured_note=note)
        tools.console.print(f"plan and schedule timeline written to {args.timeline_png}"
                            + (f", with round {measured.round} as measured" if measured is not None else f" ({note})"))


def measured_round(bus: Bus, final: JobState) -> tuple[MeasuredRound | None, str]:
    """The job's last round whose spans are all in, from the dashboard's trace collector, or None and why not."""
    from edgeswarm.planning.hpp.render import MeasuredRound
    from edgeswarm.tracing.client import NoTraceError, fetch_trace, submission_spans
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
        spans = submission_spans(reply.spans, final.submitted_at)
        rounds = complete_rounds(spans, nodes)
        if not reply.found or (rounds and rounds[-1] >= final.progress_as(TrainProgress).round - 1) or attempt:
            break
        time.sleep(1.0)
    if not rounds:
        return None, "no measured round: the dashboard holds no complete round of the job"
    return MeasuredRound(round=rounds[-1], bars=tuple(measured_bars(spans, rounds[-1]))), ""


def _own_prediction(state: JobState) -> StrategyPrediction | None:
    """What the planner predicted for the plan the job ran (its own strategy's entry in its comparison). Not the
    first job's comparison: each job plans on the speeds saved by the jobs before it, and a baseline's layout can
    move with them (PP balances compute alone, so a small change of speed can move a cut to a tensor 20x larger)."""
    progress = state.progress_as(TrainProgress)
    return next((p for p in progress.predictions if p.strategy == progress.strategy), None)


def _print_comparison(predicted: dict[str, StrategyPrediction | None], measured: dict[str, float | None],
                      refitted: dict[str, float | None], global_batch: int, tools: CommandTools) -> None:
    """Each strategy's measured round beside what the planner predicted for the plan its job ran and the last
    refitted prediction (that plan priced on each device's compute as the job measured it)."""
    table = Table(title="strategies on this cluster: predicted by the planner, measured on the stage-workers")
    for col in ("strategy", "predicted round (s)", "measured round (s)", "measured / predicted",
                "measured / refitted", "measured samples/s", "HPP speed-up (measured)"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    hpp = measured.get("hpp")
    for strategy, seconds in measured.items():
        p = predicted.get(strategy)
        pred = p.round_s if p is not None else None
        again = refitted.get(strategy)
        table.add_row(strategy, f"{pred:.3f}" if pred else (p.error or "-") if p else "-",
                      f"{seconds:.3f}" if seconds else "failed",
                      f"{seconds / pred:.2f}x" if seconds and pred else "-",
                      f"{seconds / again:.2f}x" if seconds and again else "-",
                      f"{global_batch / seconds:.1f}" if seconds else "-",
                      f"{seconds / hpp:.2f}x" if seconds and hpp else "-")
    tools.console.print(table)


def run_plan(args: argparse.Namespace, cluster: ClusterProfile, tools: CommandTools) -> int:
    """Print HPP training's plan for ``cluster`` beside single, DP and PP (and draw it with ``--png``)."""
    spec = cluster.model.model
    comparison = compare(cluster, args.global_batch, micro_batches=args.micro_batches, optimizer=args.optimizer)
    if args.json:
        tools.console.out(comparison.model_dump_json(indent=2), highlight=False)
    else:
        print_comparison(comparison, cluster, tools)
    if args.png:
        from edgeswarm.planning.hpp.render import render_plan_png

        render_plan_png(comparison.hpp, Path(args.png), title=f"{spec.name} on {len(cluster.devices)} devices")
        tools.err_console.print(f"plan drawn to {args.png}")
    return 0


def print_comparison(c: Comparison, cluster: ClusterProfile, tools: CommandTools) -> None:
    """The HPP plan as a table, then its prediction next to every baseline's."""
    plan = c.hpp
    names = [u.name for u in cluster.model.units]
    tools.console.print(f"[bold]{cluster.model.model.name}[/bold]: {plan.units} units, {len(cluster.devices)} devices, "
                        f"global batch {plan.options.global_batch} = {plan.options.micro_batches} micro-batches of "
                        f"{plan.options.micro_batch_size}, optimizer {plan.options.optimizer}; "
                        f"planned in {c.planning_s:.2f} s")
    tools.console.print(plan_table(plan, names))
    tools.console.print(f"predicted round latency [bold]{plan.round_latency_s:.3f} s[/bold], "
                        f"[bold]{plan.throughput_sps:.1f} samples/s[/bold] (dominant step {plan.dominant_step})")
    table = Table(title="against the baselines (same cost model)")
    for col in ("strategy", "stages", "M x B", "round (s)", "samples/s", "HPP speed-up"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    table.add_row("hpp", str(len(plan.stages)), f"{plan.options.micro_batches} x {plan.options.micro_batch_size}",
                  f"{plan.round_latency_s:.3f}", f"{plan.throughput_sps:.1f}", "1.00x")
    for b in c.baselines:
        if b.plan is None:
            table.add_row(b.strategy, "-", "-", "does not fit", "-", "-")
            continue
        p = b.plan
        table.add_row(b.strategy, str(len(p.stages)), f"{p.options.micro_batches} x {p.options.micro_batch_size}",
                      f"{p.round_latency_s:.3f}", f"{p.throughput_sps:.1f}", f"{b.speedup:.2f}x")
    tools.console.print(table)


def plan_table(plan: Plan, unit_names: list[str]) -> Table:
    """One row per stage: units, devices with their micro-batch shares, memory used of budget."""
    table = Table(title=f"{plan.strategy} plan, epoch {plan.epoch}")
    for col in ("stage", "units", "layers", "devices (samples per micro-batch)", "K", "fwd+bwd (s)", "allreduce (s)",
                "memory used / budget"):
        table.add_column(col)
    for s in plan.stages:
        layers = f"{unit_names[s.start]} .. {unit_names[s.end - 1]}" if unit_names else "-"
        devices = ", ".join(f"{d} ({y})" for d, y in zip(s.devices, s.shares, strict=True))
        memory = ", ".join(f"{m / 2**20:.0f}/{b / 2**20:.0f} MiB" for m, b in
                           zip(s.memory_bytes, s.memory_budget_bytes, strict=True))
        table.add_row(str(s.index), f"[{s.start}, {s.end})", layers, devices, str(s.warmup),
                      f"{s.forward_s + s.backward_s:.4f}", f"{s.allreduce_s:.3f}", memory)
    return table

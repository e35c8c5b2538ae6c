"""The ``train`` workload: hybrid pipeline-parallel training (Asteroid), run by ``lifecycle.run_job``."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from edgeswarm.hpp.coordinator import JobObserver, Resume, run_job
from edgeswarm.hpp.driver import RoundReport
from edgeswarm.hpp.recovery import RecoveryReport
from edgeswarm.hpp.spec import JobSpec, StrategyPrediction, TrainProgress
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import JobEventKind, JobState
from edgeswarm.messages.training import StageSaved
from edgeswarm.planning.hpp.compare import Comparison
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.runtime.detection import Detection
from edgeswarm.values.schedule import ScheduleBar
from edgeswarm.workloads.base import JobContext, JobSummary, Workload, figures_line
from edgeswarm.workloads.checks import model_problems
from edgeswarm.workloads.views import (
    PlanBlock,
    PlanGroup,
    PlanView,
    Series,
    SeriesPoint,
    finite,
    human_bytes,
)

log = logging.getLogger(__name__)

NOT_STARTED = frozenset({"queued", "profiling", "planning", "deploying"})  # nothing trained yet: start again


def predictions(comparison: Comparison | None, global_batch: int) -> list[StrategyPrediction]:
    """Every strategy's predicted seconds per round and samples per second from the planner's comparison."""
    if comparison is None:
        return []
    out = [StrategyPrediction(strategy="hpp", round_s=comparison.hpp.round_latency_s,
                              samples_per_s=global_batch / comparison.hpp.round_latency_s)]
    for b in comparison.baselines:
        out.append(StrategyPrediction(strategy=b.strategy, error=b.error) if b.plan is None else StrategyPrediction(
            strategy=b.strategy, round_s=b.plan.round_latency_s, samples_per_s=global_batch / b.plan.round_latency_s))
    return out


class _Publisher(JobObserver):
    """Turns what ``run_job`` reports into the job's retained state and its events."""

    def __init__(self, ctx: JobContext, spec: JobSpec) -> None:
        self.ctx = ctx
        self.spec = spec
        self._refitted_round_s: float | None = None

    def profiling(self, nodes: list[str]) -> None:
        self.ctx.update("profiling", event=("profiling", f"profiling {self.spec.model.name} on {', '.join(nodes)}"))

    def planned(self, plan: Plan, comparison: Comparison | None, total_rounds: int) -> None:
        self.ctx.update("deploying", plan=plan, total_rounds=total_rounds, predicted_round_s=plan.round_latency_s,
                        predictions=predictions(comparison, self.spec.global_batch),
                        event=("planned", f"{plan.strategy}: {len(plan.stages)} stages on {len(plan.devices)} "
                                          f"devices, {plan.round_latency_s:.3f} s per round predicted"))

    def deployed(self) -> None:
        self.ctx.update("running", event=("deployed", "every stage-worker holds its stage"))

    def refitted_round(self, seconds: float) -> None:
        self._refitted_round_s = seconds  # published with the round's figures, in one state

    def round_done(self, report: RoundReport) -> None:
        self.ctx.update("running", round=report.round + 1, loss=report.loss, accuracy=report.accuracy,
                        round_s=report.round_s, samples_per_s=self.spec.global_batch / report.round_s,
                        refitted_round_s=self._refitted_round_s,
                        event=("round", f"loss {report.loss:.4f}, accuracy {report.accuracy:.1%}, "
                                        f"{report.round_s:.3f} s"))

    def device_lost(self, failures: dict[str, Detection], round_index: int) -> None:
        lost = "; ".join(f"{d.detail} ({d.how.replace('_', ' ')}, {d.detection_s:.2f} s after it was last heard)"
                         for d in failures.values())
        self.ctx.update("recovering", event=("device_lost", f"during round {round_index}: {lost}"))

    def recovered(self, report: RecoveryReport) -> None:
        self._replanned(report, "recovered", f"{report.mode} recovery without {', '.join(report.failed)}"
                        if report.failed else "replayed from the devices' snapshots after an interruption")

    def joined(self, report: RecoveryReport) -> None:
        self._replanned(report, "joined", f"{', '.join(report.joined)} joined")

    def refitted(self, detail: str) -> None:
        self.ctx.update(self.ctx.state().status, event=("refit", detail))

    def rebalanced(self, report: RecoveryReport, detail: str) -> None:
        self._replanned(report, "rebalanced", f"re-planned on measured speeds ({detail})")

    def _replanned(self, report: RecoveryReport, kind: JobEventKind, what: str) -> None:
        plan = report.plan
        stages = " | ".join(",".join(s.devices) for s in plan.stages)
        done = self.ctx.state().progress_as(TrainProgress).reconfigurations
        self.ctx.update("running", plan=plan, predicted_round_s=plan.round_latency_s, round=report.resume_round,
                        reconfigurations=done + 1,
                        event=(kind, f"{what}: plan epoch {plan.epoch}, stages {stages}, "
                                     f"{plan.round_latency_s:.3f} s per round predicted; resumed at round "
                                     f"{report.resume_round} after {report.recovery_s:.2f} s, "
                                     f"{report.moved_bytes} bytes of state moved"))

    def evaluated(self, test_accuracy: float) -> None:
        self.ctx.update("running", test_accuracy=test_accuracy,
                        event=("evaluated", f"held-out accuracy of the saved model {test_accuracy:.1%}"))

    def saved(self, version: int, saved: list[StageSaved]) -> None:
        self.ctx.update("running", checkpoint_version=version,
                        event=("checkpoint", f"version {version}: {sum(s.nbytes for s in saved)} bytes in "
                                             f"{len(saved)} stages"))


class TrainWorkload(Workload):
    """Training jobs run one at a time: every device's stage-worker takes part in a job's rounds."""

    kind = "train-hpp"  # also accepted as "train" (workloads.ALIASES), the name every spec had before
    spec_type: ClassVar[type[JobSpec]] = JobSpec
    progress_type = TrainProgress
    plan_type = Plan
    plan_cli = "edgeswarm.hpp.cli:run_plan"
    train_cli = "edgeswarm.hpp.cli:run_train"
    train_arguments = "edgeswarm.hpp.cli:add_train_arguments"
    planner = "edgeswarm.hpp.planner:PLANNER"
    commands = ("edgeswarm.hpp.cli:ExportCommand",)
    benches = ("edgeswarm.hpp.bench:TrainingBench", "edgeswarm.hpp.bench:RecoveryBench",
               "edgeswarm.hpp.bench:PlannerBench", "edgeswarm.hpp.bench:ComputeBench")
    peers = ("edgeswarm.hpp.peers:PipelinePeers",)
    command = "train"
    exclusive = True
    example = ("name: {name}\nmodel: {name: mlp, config: {image_size: 4, hidden: 32, layers: 2}}\n"
               "data: {kind: teacher, size: 256, test_size: 64}\nglobal_batch: 16\nmicro_batches: 2\nrounds: 400\n"
               "checkpoint_interval: 50\n")
    worker_program = "edgeswarm.hpp.worker:TrainingProgram"

    def problems(self, spec: Any, members: list[NodeView]) -> list[str]:
        return model_problems(spec.model, members, spec.optimizer.name)

    def initial_progress(self, spec: Any) -> TrainProgress:
        assert isinstance(spec, JobSpec)
        return TrainProgress(strategy=spec.strategy)

    def describe(self, spec: Any) -> str:
        return f"{spec.model.name}, {spec.strategy}, global batch {spec.global_batch}"

    def summary(self, state: JobState) -> JobSummary:
        t = state.progress_as(TrainProgress)
        figures = figures_line(f"loss {t.loss:.4f}" if t.loss is not None else "",
                               f"accuracy {t.accuracy:.1%}" if t.accuracy is not None else "",
                               f"{t.samples_per_s:.1f} samples/s" if t.samples_per_s is not None else "")
        return JobSummary(progress=f"{t.strategy} round {t.round}/{t.total_rounds or '?'}", figures=figures,
                          round=t.round, round_measured=t.round_s is not None)

    def stage_devices(self, plan: Any) -> list[list[str]]:
        assert isinstance(plan, Plan)
        return [list(st.devices) for st in plan.stages]

    def plan_view(self, state: JobState) -> PlanView | None:
        plan = state.plan
        if not isinstance(plan, Plan):
            return None
        groups = []
        for st in plan.stages:
            total = sum(st.shares) or 1
            groups.append(PlanGroup(label=f"stage {st.index}: units {st.start}-{st.end - 1}", detail=(
                f"forward {st.forward_s * 1000:.1f} ms, backward {st.backward_s * 1000:.1f} ms per micro-batch"),
                blocks=tuple(PlanBlock(device=d, share=min(1.0, share / total), detail=f"{share} samples, "
                                       f"{human_bytes(mem)} of {human_bytes(budget)}")
                             for d, share, mem, budget in zip(st.devices, st.shares, st.memory_bytes,
                                                              st.memory_budget_bytes, strict=False))))
        return PlanView(layout="chain", groups=tuple(groups), epoch=plan.epoch, summary=(
            f"{plan.strategy}: predicted {plan.round_latency_s:.3f} s a round, {plan.throughput_sps:.1f} samples/s"))

    def series(self, state: JobState) -> list[Series]:
        t = state.progress_as(TrainProgress)
        if t.round_s is None or t.round < 1:
            return []  # the latest round's figures are not in yet
        out = []
        for name, unit, value, predicted in (("loss", "", t.loss, None), ("accuracy", "", t.accuracy, None),
                                             ("round time", "s", t.round_s, t.predicted_round_s),
                                             ("refitted round time", "s", t.refitted_round_s, None)):
            if finite(value):
                out.append(Series(name=name, unit=unit, points=(SeriesPoint(x=t.round, y=value),),
                                  predicted=predicted if finite(predicted) else None))
        return out

    def planned_schedule(self, state: JobState) -> list[ScheduleBar]:
        """The plan's simulated 1F1B round (``plan_timeline``): stages' forwards, backwards and AllReduce, links'
        transfers."""
        if not isinstance(state.plan, Plan):
            return []
        from edgeswarm.planning.hpp.schedule import plan_timeline
        from edgeswarm.tracing.schedule import timeline_bars

        return timeline_bars(plan_timeline(state.plan))

    def unit_seconds(self, state: JobState) -> tuple[float | None, float | None]:
        progress = state.progress_as(TrainProgress)
        return progress.predicted_round_s, progress.round_s

    def run(self, ctx: JobContext, spec: Any) -> tuple[JobEventKind, str] | None:
        assert isinstance(spec, JobSpec)
        previous, resume = ctx.previous, None
        if previous is not None and previous.plan is not None and previous.status not in NOT_STARTED:
            assert isinstance(previous.plan, Plan)
            progress = previous.progress_as(TrainProgress)
            log.info("job %s: taking it over from an earlier coordinator at round %d", spec.name, progress.round)
            ctx.update("recovering", event=("resumed", f"a restarted coordinator takes the job over at round "
                                                       f"{progress.round}, plan epoch {previous.plan.epoch}"))
            resume = Resume(plan=previous.plan, rounds_done=progress.round,
                            saved_version=progress.checkpoint_version or 0)
        elif previous is not None:
            ctx.update("queued", event=("resumed", f"a restarted coordinator starts the job again (it was "
                                                   f"{previous.status})"))
        run_job(ctx.bus, spec, store_node=ctx.store_node, observer=_Publisher(ctx, spec), cancel=ctx.cancel,
                timeout_s=ctx.timeout_s, resume=resume, worker_service=self.worker_service)
        progress = ctx.state().progress_as(TrainProgress)
        return ("succeeded", f"{progress.round} rounds, final loss {progress.loss:.4f}"
                if progress.loss is not None else "")

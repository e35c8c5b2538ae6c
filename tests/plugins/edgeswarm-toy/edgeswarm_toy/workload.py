"""The toy job kind: one registry entry, found through the ``edgeswarm.workloads`` entry point."""

from __future__ import annotations

from typing import Any

from edgeswarm.messages.jobs import JobState
from edgeswarm.workloads.base import JobContext, JobSummary, Workload
from edgeswarm_toy.coordinator import run_toy
from edgeswarm_toy.spec import KIND, WORKER, ToyPlan, ToyProgress, ToySpec


class ToyWorkload(Workload):
    kind = KIND
    spec_type = ToySpec
    progress_type = ToyProgress
    plan_type = ToyPlan
    planner = "edgeswarm_toy.planner:PLANNER"
    worker_service = WORKER
    worker_program = "edgeswarm_toy.worker:ToyProgram"
    benches = ("edgeswarm_toy.bench:ToyBench",)
    command = "train"
    exclusive = False
    # Two minutes: the contract tests cancel it, and a loaded CI machine must never see it finish first.
    example = "kind: toy\nname: {name}\nsteps: 600\nstep_s: 0.2\n"

    def model_name(self, spec: Any) -> str:
        return "toy"

    def initial_progress(self, spec: Any) -> ToyProgress:
        return ToyProgress(total=spec.steps)

    def describe(self, spec: Any) -> str:
        return f"double 1..{spec.steps}"

    def summary(self, state: JobState) -> JobSummary:
        p = state.progress_as(ToyProgress)
        return JobSummary(progress=f"step {p.steps_done}/{p.total}", figures=f"doubled sum {p.doubled_sum}",
                          round=p.steps_done, round_measured=p.steps_done > 0)

    def stage_devices(self, plan: Any) -> list[list[str]]:
        return [[d] for d in plan.devices]

    def run(self, ctx: JobContext, spec: Any) -> tuple[str, str] | None:
        return run_toy(ctx, spec)

"""The ``serve-pipeline`` workload: serving a model as a pipeline, planned for throughput (see ``pipeline``)."""

from __future__ import annotations

from typing import Any, ClassVar

from edgeswarm.bus import Bus, Inbound
from edgeswarm.coordination.serving import refuse_unserved
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import JobEventKind, JobState
from edgeswarm.messages.serving import InferRequest, ServeTensor
from edgeswarm.pipeline_serve.spec import ServeProgress, ServeSpec
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.workloads.base import JobContext, JobSummary, Workload, figures_line
from edgeswarm.workloads.checks import model_problems
from edgeswarm.workloads.views import PlanBlock, PlanGroup, PlanView, Series, SeriesPoint, finite


class ServePipelineWorkload(Workload):
    """Serving jobs run side by side (and beside a training job): each holds one stage per device it uses."""

    kind = "serve-pipeline"
    spec_type: ClassVar[type[ServeSpec]] = ServeSpec
    progress_type = ServeProgress
    plan_type = ServePlan
    plan_cli = "edgeswarm.pipeline_serve.cli:run_plan"
    plan_arguments = "edgeswarm.pipeline_serve.cli:add_plan_arguments"
    infer_cli = "edgeswarm.pipeline_serve.cli:run_infer"
    planner = "edgeswarm.pipeline_serve.planner:PLANNER"
    benches = ("edgeswarm.pipeline_serve.bench:ServingBench",)
    command = "serve"
    exclusive = False
    example = ("kind: serve-pipeline\nname: {name}\n"
               "model: {name: mlp, config: {image_size: 4, hidden: 32, layers: 2}}\nmicro_batch_size: 2\n")
    data_schemas = (InferRequest, ServeTensor)
    worker_program = "edgeswarm.pipeline_serve.worker:ServeStageProgram"

    def problems(self, spec: Any, members: list[NodeView]) -> list[str]:
        return model_problems(spec.model, members, None)

    def describe(self, spec: Any) -> str:
        weights = (f"weights of job {spec.weights.job} version {spec.weights.version}" if spec.weights else
                   "fresh weights")
        return f"serve {spec.model.name} ({weights}), micro-batches of {spec.micro_batch_size}, window {spec.window}"

    def summary(self, state: JobState) -> JobSummary:
        p = state.progress_as(ServeProgress)
        return JobSummary(progress=f"{p.answered} answered, {p.errors} errors", figures=figures_line(
            f"{p.throughput_per_s:.1f} samples/s" if p.throughput_per_s is not None else "",
            f"p50 {p.latency_p50_s * 1000:.1f} ms" if p.latency_p50_s is not None else "",
            f"p99 {p.latency_p99_s * 1000:.1f} ms" if p.latency_p99_s is not None else ""))

    def stage_devices(self, plan: Any) -> list[list[str]]:
        assert isinstance(plan, ServePlan)
        return [[st.device] for st in plan.stages]

    def plan_view(self, state: JobState) -> PlanView | None:
        plan = state.plan
        if not isinstance(plan, ServePlan):
            return None
        return PlanView(layout="chain", epoch=plan.epoch, summary=(
            f"{plan.method}: capacity {plan.throughput_per_s:.1f} samples/s, compute {plan.latency_s * 1000:.1f} ms "
            "a micro-batch"
            + (f", bottleneck {plan.bottleneck}" if plan.bottleneck else "")), groups=tuple(
            PlanGroup(label=f"stage {st.index}: units {st.start}-{st.end - 1}", blocks=(PlanBlock(
                device=st.device, detail=f"{st.compute_s * 1000:.1f} ms a micro-batch"),))
            for st in plan.stages))

    def series(self, state: JobState) -> list[Series]:
        # Measured only: the plan's latency is one micro-batch's compute (no messages, no queueing) and its throughput
        # the pipeline's capacity, not the offered load's, so neither is a prediction of what is charted here.
        p = state.progress_as(ServeProgress)
        x = max(0.0, state.updated_at - state.submitted_at)
        return [Series(name=name, unit=unit, x_label="s", points=(SeriesPoint(x=x, y=value),))
                for name, unit, value in (("latency p50", "s", p.latency_p50_s), ("latency p99", "s", p.latency_p99_s),
                                          ("throughput", "samples/s", p.throughput_per_s)) if finite(value)]

    def run(self, ctx: JobContext, spec: Any) -> tuple[JobEventKind, str] | None:
        from edgeswarm.pipeline_serve.coordinator import PipelineRunner  # torch: only when a job actually runs

        assert isinstance(spec, ServeSpec)
        if ctx.previous is not None:
            ctx.update("queued", event=("resumed", f"a restarted coordinator deploys the job again (it was "
                                                   f"{ctx.previous.status}); requests it held were answered by no one"))
        PipelineRunner(ctx, spec, worker_service=self.worker_service).run()
        return None  # run ends only by cancellation or failure

    def refuse_data(self, bus: Bus, msg: Inbound, state: JobState | None) -> None:
        body = msg.body
        if isinstance(body, InferRequest):  # outputs of a job that ended: nobody waits for them
            refuse_unserved(bus, msg, body.job_id, body.request_id, state)

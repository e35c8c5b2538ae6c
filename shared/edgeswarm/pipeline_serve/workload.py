"""The ``serve-pipeline`` workload: serving a model as a pipeline, planned for throughput (see ``pipeline``)."""

from __future__ import annotations

from typing import Any, ClassVar

from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.serving import InferRequest, ServeTensor
from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.pipeline_serve.spec import ServeProgress, ServeSpec
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.values.schedule import ScheduleBar
from edgeswarm.workloads.checks import model_problems
from edgeswarm.workloads.serving import ServingWorkload
from edgeswarm.workloads.views import PlanBlock, PlanGroup, PlanView


class ServePipelineWorkload(ServingWorkload):
    """Serving jobs run side by side (and beside a training job): each holds one stage per device it uses."""

    kind = "serve-pipeline"
    spec_type: ClassVar[type[ServeSpec]] = ServeSpec
    progress_type = ServeProgress
    plan_type = ServePlan
    plan_cli = "edgeswarm.pipeline_serve.cli:run_plan"
    plan_arguments = "edgeswarm.pipeline_serve.cli:add_plan_arguments"
    infer_cli = "edgeswarm.pipeline_serve.cli:run_infer"
    infer_arguments = "edgeswarm.pipeline_serve.cli:add_infer_arguments"
    planner = "edgeswarm.pipeline_serve.planner:PLANNER"
    benches = ("edgeswarm.pipeline_serve.bench:ServingBench",)
    example = ("kind: serve-pipeline\nname: {name}\n"
               "model: {name: mlp, config: {image_size: 4, hidden: 32, layers: 2}}\nmicro_batch_size: 2\n")
    data_schemas = (InferRequest, ServeTensor)
    worker_program = "edgeswarm.pipeline_serve.worker:ServeStageProgram"
    request_type = InferRequest
    schedule_unit = "item"
    program = "edgeswarm.pipeline_serve.coordinator:PipelineRunner"

    def problems(self, spec: Any, members: list[NodeView]) -> list[str]:
        return model_problems(spec.model, members, None)

    def describe(self, spec: Any) -> str:
        weights = (f"weights of job {spec.weights.job} version {spec.weights.version}" if spec.weights else
                   "fresh weights")
        return f"serve {spec.model.name} ({weights}), micro-batches of {spec.micro_batch_size}, window {spec.window}"

    def measured(self, progress: Any) -> list[tuple[str, str, float | None]]:
        assert isinstance(progress, ServeProgress)
        return [("latency p50", "s", progress.latency_p50_s), ("latency p99", "s", progress.latency_p99_s),
                ("throughput", "samples/s", progress.throughput_per_s)]

    def predicted_at_load(self, progress: Any) -> dict[str, float]:
        assert isinstance(progress, ServeProgress)
        load = progress.at_load
        if load is None:
            return {}
        out = {"throughput": load.throughput_per_s}
        if load.latency_s is not None:
            out["latency p50"] = load.latency_s
        return out

    def planned_schedule(self, state: JobState) -> list[ScheduleBar]:
        """One micro-batch through the pipeline as planned: each stage's forward, then the activation's transfer to
        the next stage."""
        plan = state.plan
        if not isinstance(plan, ServePlan):
            return []
        bars, t = [], 0.0
        for st in plan.stages:
            if st.index > 0:
                bars.append(ScheduleBar(lane=f"link {st.index - 1}→{st.index}", name="activation", cat="transfer",
                                        start_s=t, dur_s=st.transfer_in_s, source="planned"))
                t += st.transfer_in_s
            bars.append(ScheduleBar(lane=f"stage {st.index}", name="forward", cat="compute", start_s=t,
                                    dur_s=st.compute_s, source="planned"))
            t += st.compute_s
        return bars

    def explained_spans(self, state: JobState, spans: list[SpanRecord]) -> tuple[list[SpanRecord], list[int]]:
        """The spans as they are, and the items that filled the plan's micro-batch (the plan prices one of
        ``micro_batch_size`` samples; an item of one sample forwards in a fraction of that): those whose stage
        forward says it carried that many samples. None of them when no item was full."""
        plan = state.plan
        if not isinstance(plan, ServePlan):
            return super().explained_spans(state, spans)
        full = {s.micro_batch for s in spans if s.samples == plan.micro_batch_size and s.micro_batch is not None}
        return spans, sorted(full)

    def unit_seconds(self, state: JobState) -> tuple[float | None, float | None]:
        plan = state.plan
        return (plan.latency_s if isinstance(plan, ServePlan) else None,
                state.progress_as(ServeProgress).latency_p50_s)

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

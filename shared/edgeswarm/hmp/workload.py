"""The ``serve-hmp`` workload: a Transformer served with every layer split across devices (Galaxy's HMP)."""

from __future__ import annotations

from typing import Any, ClassVar

from edgeswarm.bus import Bus, Inbound
from edgeswarm.coordination.serving import refuse_unserved
from edgeswarm.errors import EdgeswarmError
from edgeswarm.hmp.spec import HmpProgress, HmpSpec
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.hmp import HmpRequest, ShardResult
from edgeswarm.messages.jobs import JobEventKind, JobState
from edgeswarm.planning.hmp.plan import HmpPlan
from edgeswarm.service_registry import TENSOR_SHARD_WORKER
from edgeswarm.workloads.base import JobContext, JobSummary, Workload, figures_line
from edgeswarm.workloads.views import (
    PlanBlock,
    PlanGroup,
    PlanView,
    Series,
    SeriesPoint,
    finite,
    human_bytes,
)

MIB = 1 << 20


class HmpWorkload(Workload):
    """Tensor-parallel serving jobs run side by side (and beside training and pipelined serving): each holds one
    shard per device it uses, on the devices' tensor-shard-workers."""

    kind = "serve-hmp"
    spec_type: ClassVar[type[HmpSpec]] = HmpSpec
    progress_type = HmpProgress
    plan_type = HmpPlan
    planner = "edgeswarm.hmp.planner:PLANNER"
    benches = ("edgeswarm.hmp.bench:HmpBench",)
    plan_cli = "edgeswarm.hmp.cli:run_plan"
    plan_arguments = "edgeswarm.hmp.cli:add_plan_arguments"
    plan_profiles_zoo = False
    command = "serve"
    exclusive = False
    example = ("kind: serve-hmp\nname: {name}\nmodel: {preset: gpt2-tiny}\nseq_len: 16\nmax_tokens: 64\n"
               "max_new_tokens: 4\n")
    data_schemas = (HmpRequest, ShardResult)
    worker_service = TENSOR_SHARD_WORKER
    worker_program = "edgeswarm.hmp.worker:ShardProgram"
    infer_cli = "edgeswarm.hmp.cli:run_infer"

    def problems(self, spec: Any, members: list[NodeView]) -> list[str]:
        assert isinstance(spec, HmpSpec)
        try:
            from edgeswarm.models.text.hf import source_config  # torch and safetensors: only when checked

            cfg = source_config(spec.model)
        except EdgeswarmError as exc:
            return [str(exc)]
        found = []
        if not cfg.rotary and spec.max_tokens > cfg.max_positions:
            found.append(f"max_tokens {spec.max_tokens} passes {spec.model.name}'s {cfg.max_positions} positions")
        if spec.seq_len > spec.max_tokens:
            found.append(f"seq_len {spec.seq_len} passes max_tokens {spec.max_tokens}")
        layers_bytes = cfg.layers * (cfg.attention_params() + cfg.mlp_params()) * cfg.dtype_bytes
        total = sum(m.memory_budget_bytes for m in members)
        if members and layers_bytes > total:
            found.append(f"model: {spec.model.name}'s layers need {layers_bytes / MIB:.1f} MiB, but the "
                         f"{len(members)} online devices have {total / MIB:.1f} MiB of memory budget together: add "
                         "devices or pick a smaller model")
        return found

    def model_name(self, spec: Any) -> str:
        return str(spec.model.name)

    def describe(self, spec: Any) -> str:
        assert isinstance(spec, HmpSpec)
        return (f"serve {spec.model.name} split by {spec.mode}{' with tile overlap' if spec.overlap else ''}, "
                f"planned for {spec.seq_len} tokens, at most {spec.max_tokens} per request")

    def summary(self, state: JobState) -> JobSummary:
        p = state.progress_as(HmpProgress)
        return JobSummary(progress=f"{p.answered} answered, {p.errors} errors", figures=figures_line(
            f"latency p50 {p.latency_p50_s * 1000:.1f} ms" if p.latency_p50_s is not None else "",
            f"TTFT {p.ttft_p50_s * 1000:.1f} ms" if p.ttft_p50_s is not None else "",
            f"TPOT {p.tpot_p50_s * 1000:.1f} ms" if p.tpot_p50_s is not None else ""))

    def stage_devices(self, plan: Any) -> list[list[str]]:
        assert isinstance(plan, HmpPlan)
        return [[d] for d in plan.shares.devices]

    def plan_view(self, state: JobState) -> PlanView | None:
        plan = state.plan
        if not isinstance(plan, HmpPlan):
            return None
        sh = plan.shares
        heads, cols = sum(sh.heads) or 1, sum(sh.columns) or 1
        blocks = tuple(PlanBlock(device=d, share=min(1.0, (h / heads + c / cols) / 2), detail=(
            f"{h} heads, {c} columns, {human_bytes(plan.memory_bytes[i])}" if i < len(plan.memory_bytes) else
            f"{h} heads, {c} columns")) for i, (d, h, c) in enumerate(zip(sh.devices, sh.heads, sh.columns,
                                                                           strict=False)))
        return PlanView(layout="parallel", epoch=plan.epoch, groups=(PlanGroup(
            label=f"{sh.mode}: every layer", blocks=blocks,
            detail="left out: " + ", ".join(plan.left_out) if plan.left_out else ""),),
            summary=f"{sh.mode} over {len(sh.devices)} devices, predicted {plan.model.total_s * 1000:.1f} ms a pass")

    def series(self, state: JobState) -> list[Series]:
        # Measured only: the plan prices a pass's compute and collectives, not a request's messages and queueing, so
        # it is not a prediction of a request's latency.
        p = state.progress_as(HmpProgress)
        x = max(0.0, state.updated_at - state.submitted_at)
        return [Series(name=name, unit=unit, x_label="s", points=(SeriesPoint(x=x, y=value),))
                for name, unit, value in (("latency p50", "s", p.latency_p50_s), ("TTFT p50", "s", p.ttft_p50_s),
                                          ("TPOT p50", "s", p.tpot_p50_s), ("tokens/s", "tokens/s", p.tokens_per_s))
                if finite(value)]

    def run(self, ctx: JobContext, spec: Any) -> tuple[JobEventKind, str] | None:
        from edgeswarm.hmp.coordinator import HmpRunner  # torch: only when a job actually runs

        assert isinstance(spec, HmpSpec)
        if ctx.previous is not None:
            ctx.update("queued", event=("resumed", f"a restarted coordinator deploys the job again (it was "
                                                   f"{ctx.previous.status}); the request under way was answered "
                                                   "by no one"))
        HmpRunner(ctx, spec, worker_service=self.worker_service).run()
        return None

    def refuse_data(self, bus: Bus, msg: Inbound, state: JobState | None) -> None:
        body = msg.body
        if isinstance(body, HmpRequest):  # results of a job that ended: nobody waits for them
            refuse_unserved(bus, msg, body.job_id, body.request_id, state)

"""The ``serve-hmp`` workload: a Transformer served with every layer split across devices (Galaxy's HMP)."""

from __future__ import annotations

from typing import Any, ClassVar

from edgeswarm.errors import EdgeswarmError
from edgeswarm.hmp.spec import PREFILL, HmpProgress, HmpSpec
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.hmp import HmpCancel, HmpRequest, ShardResult
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.planning.hmp.plan import HmpPlan
from edgeswarm.service_registry import TENSOR_SHARD_WORKER
from edgeswarm.values.schedule import ScheduleBar
from edgeswarm.workloads.serving import ServingWorkload
from edgeswarm.workloads.views import PlanBlock, PlanGroup, PlanView, human_bytes

# How a shard's spans line up with the plan's split of a pass: computing, and the rest of the layers' time, which is
# the communication not hidden behind computing (collective bookkeeping and waiting for a peer's tensor).
_EXPOSED = "exposed communication"
_PLANNED_AS = {"compute": "compute", "collective": _EXPOSED, "wait": _EXPOSED}

MIB = 1 << 20


class HmpWorkload(ServingWorkload):
    """Tensor-parallel serving jobs run side by side (and beside training and pipelined serving): each holds one
    shard per device it uses, on the devices' tensor-shard-workers."""

    kind = "serve-hmp"
    spec_type: ClassVar[type[HmpSpec]] = HmpSpec
    progress_type = HmpProgress
    plan_type = HmpPlan
    planner = "edgeswarm.hmp.planner:PLANNER"
    benches = ("edgeswarm.hmp.bench:HmpBench", "edgeswarm.hmp.bench:LlmBench")
    peers = ("edgeswarm.hmp.peers:TensorParallelPeers",)
    plan_cli = "edgeswarm.hmp.cli:run_plan"
    plan_arguments = "edgeswarm.hmp.cli:add_plan_arguments"
    plan_profiles_zoo = False
    example = ("kind: serve-hmp\nname: {name}\nmodel: {preset: gpt2-tiny}\nseq_len: 16\nmax_tokens: 64\n"
               "max_new_tokens: 4\n")
    data_schemas = (HmpRequest, HmpCancel, ShardResult)
    worker_service = TENSOR_SHARD_WORKER
    worker_program = "edgeswarm.hmp.worker:ShardProgram"
    infer_cli = "edgeswarm.hmp.cli:run_infer"
    request_type = HmpRequest
    program = "edgeswarm.hmp.coordinator:HmpRunner"
    lost_on_restart = "the request under way"
    infer_arguments = "edgeswarm.hmp.cli:add_infer_arguments"
    text_models = "edgeswarm.hmp.text_models:text_models"

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
        layers_bytes = cfg.layers * (cfg.attention_bytes() + cfg.mlp_bytes())
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
        split = "the parallelism predicted fastest" if spec.mode == "auto" else spec.mode
        return (f"serve {spec.model.name} split by {split}{' with tile overlap' if spec.overlap else ''}, "
                f"planned for {spec.seq_len} tokens, at most {spec.max_tokens} per request")

    def measured(self, progress: Any) -> list[tuple[str, str, float | None]]:
        assert isinstance(progress, HmpProgress)
        return [("latency p50", "s", progress.latency_p50_s), ("TTFT p50", "s", progress.ttft_p50_s),
                ("TPOT p50", "s", progress.tpot_p50_s), ("decode", "tokens/s", progress.tokens_per_s)]

    def planned_schedule(self, state: JobState) -> list[ScheduleBar]:
        """One prefill of ``seq_len`` tokens as planned, on every shard: the pass, its compute and its exposed
        communication."""
        plan = state.plan
        if not isinstance(plan, HmpPlan):
            return []
        m = plan.model
        return [bar for rank in range(len(plan.shares.devices)) for bar in (
            ScheduleBar(lane=f"shard {rank}", name=PREFILL, cat="other", start_s=0.0, dur_s=m.total_s,
                        source="planned"),
            ScheduleBar(lane=f"shard {rank}", name="compute", cat="compute", start_s=0.0, dur_s=m.compute_s,
                        source="planned"),
            ScheduleBar(lane=f"shard {rank}", name=_EXPOSED, cat="wait", start_s=m.compute_s, dur_s=m.exposed_s,
                        source="planned"))]

    def explained_spans(self, state: JobState, spans: list[SpanRecord]) -> tuple[list[SpanRecord], list[int]]:
        """The prefill passes (the plan prices a prefill; a decode pass is a token's), each layer's spans summed
        into compute and exposed communication; the transfers, which overlap them, left out. Every prefill whose
        pass span is in counts: it is recorded when the pass has ended."""
        prefills = sorted({s.round for s in spans if s.name == PREFILL and s.round is not None})
        wanted = set(prefills)
        kept = [s if s.name == PREFILL else s.model_copy(update={"name": _PLANNED_AS[s.cat]})
                for s in spans if s.round in wanted and (s.name == PREFILL or s.cat in _PLANNED_AS)]
        return kept, prefills

    def unit_seconds(self, state: JobState) -> tuple[float | None, float | None]:
        """The predicted prefill, its logits included where the job's requests generate a token (the progress's
        ``predicted_latency_s``), beside the measured time to the first token."""
        plan, progress = state.plan, state.progress_as(HmpProgress)
        if not isinstance(plan, HmpPlan):
            return None, progress.ttft_p50_s
        planned = progress.predicted_latency_s if progress.predicted_latency_s is not None else plan.model.total_s
        return planned, progress.ttft_p50_s

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

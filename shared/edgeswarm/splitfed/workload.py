"""The ``train-splitfed`` workload: SmartSplit's split federated learning, devices training the first and last
layers of a model, edge servers (MECs) the middle, the coordinator averaging the reassembled models."""

from __future__ import annotations

from statistics import fmean
from typing import Any, ClassVar

from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import JobEventKind, JobState
from edgeswarm.messages.splitfed import SplitUpdate
from edgeswarm.messages.tracing import SpanRecord
from edgeswarm.planning.splitfed.types import SplitSelection
from edgeswarm.service_registry import MEC_MANAGER, STAGE_WORKER
from edgeswarm.splitfed.spec import RoundRecord, SplitfedProgress, SplitfedSpec
from edgeswarm.tracing.explain import OUTSIDE
from edgeswarm.values.schedule import ScheduleBar
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
# The lanes a device's spans are on (splitfed.worker), and the operations the plan prices: a device's computes
# (its front's forward and backward, the tail, a local step) are one, its waits for the MEC's half another, its
# sends of activations and gradients a third.
DEVICE_LANE, LINK_LANE = "device", "link device→mec"
COMPUTE, WAIT_MEC, SEND = "compute", "wait for the MEC", "send"
_PLANNED_AS = {"forward": COMPUTE, "tail": COMPUTE, "backward": COMPUTE, "local step": COMPUTE,
               "wait middle": WAIT_MEC, "wait cut gradient": WAIT_MEC, "activation": SEND, "tail gradient": SEND}


def _trained(record: RoundRecord) -> set[tuple[str, int]]:
    return {(p.node, p.cut) for p in record.participants if p.outcome == "trained"}


def _like_last(history: list[RoundRecord]) -> list[RoundRecord]:
    """The finished rounds whose devices trained at the cuts the last round's did, round 0 left out (the devices
    build their halves in it) unless it is the only one."""
    if not history:
        return []
    last = _trained(history[-1])
    alike = [r for r in history if _trained(r) == last]
    later = [r for r in alike if r.round > 0]
    return later or alike


class SplitfedWorkload(Workload):
    """Split federated learning jobs: each round the central manager picks participants and cuts, the devices'
    stage-workers train their halves with the MECs' mec-managers, and the coordinator aggregates."""

    kind = "train-splitfed"
    spec_type: ClassVar[type[SplitfedSpec]] = SplitfedSpec
    progress_type = SplitfedProgress
    plan_type = SplitSelection
    planner = "edgeswarm.splitfed.planner:PLANNER"
    benches = ("edgeswarm.splitfed.bench:SplitfedBench",)
    peers = ("edgeswarm.splitfed.peers:FederatedPeers",)
    command = "train"
    exclusive = False
    # Rounds of a second or two each: the contract tests list, take over and cancel it while it runs, and on an idle
    # machine 2 rounds were over before two `edgeswarm jobs` had listed it.
    # Memory-starved devices (2 MB: only LeNet-5's first cut fits at batch 32), so the example splits wherever it
    # runs: on fast devices with room, SmartSplit trains each one alone (no tensor is worth its messages).
    example = ("kind: train-splitfed\nname: {name}\nrounds: 40\nparticipants: 2\npartition: {devices: 4}\n"
               "training: {epochs: 1, batch_size: 32}\nwait_s: 20\nmemory_budget_bytes: 2000000\n")
    data_schemas = (SplitUpdate,)
    worker_service = STAGE_WORKER
    worker_program = "edgeswarm.splitfed.worker:DeviceProgram"
    # The MEC's half runs on the edge servers' mec-manager.
    other_programs: ClassVar[dict[str, str]] = {MEC_MANAGER: "edgeswarm.splitfed.mec:MecProgram"}

    def problems(self, spec: Any, members: list[NodeView]) -> list[str]:
        assert isinstance(spec, SplitfedSpec)
        found = []
        if members and len(members) < spec.participants:
            found.append(f"participants: {spec.participants} devices train per round, but {len(members)} "
                         f"stage-workers are online; lower participants or start more devices")
        return found

    def describe(self, spec: Any) -> str:
        assert isinstance(spec, SplitfedSpec)
        return (f"train {spec.model.name} on {spec.data.kind} split {spec.partition.kind} over "
                f"{spec.partition.devices} devices by {spec.mode}, {spec.participants} per round, "
                f"{spec.rounds} rounds")

    def summary(self, state: JobState) -> JobSummary:
        p = state.progress_as(SplitfedProgress)
        last = p.history[-1] if p.history else None
        peak = max((x.peak_bytes for x in last.participants), default=0) if last else 0
        return JobSummary(progress=f"round {p.rounds_done}/{p.rounds_total or '?'}", round=p.rounds_done,
                          round_measured=last is not None, figures=figures_line(
                              f"accuracy {100 * p.accuracy:.1f}%" if p.accuracy is not None else "",
                              f"loss {p.loss:.4f}" if p.loss is not None else "",
                              f"device peak {peak / MIB:.1f} MiB" if peak else ""))

    def planned_schedule(self, state: JobState) -> list[ScheduleBar]:
        """The plan's slowest device that trained in the last round (the one that sets the predicted round), as
        planned: its own compute, then its wait for the MEC (the tensors' transfers and the MEC's half for it), its
        sends on its link, and the round's other predicted seconds (its part's weights down and up, its setup, the
        coordinator's requests) as ``outside spans``, which no span covers."""
        plan = state.plan
        if not isinstance(plan, SplitSelection) or not plan.selected:
            return []
        history = state.progress_as(SplitfedProgress).history
        trained = {node for node, _cut in _trained(history[-1])} if history else set()
        device = max([c for c in plan.selected if c.node in trained] or plan.selected, key=lambda c: c.round_s)
        waited = device.transfer_s + device.mec_s
        predicted = history[-1].predicted_s if history and history[-1].predicted_s > 0 else device.round_s
        bars = [ScheduleBar(lane=DEVICE_LANE, name=COMPUTE, cat="compute", start_s=0.0, dur_s=device.compute_s,
                            source="planned")]
        if waited > 0:
            bars += [ScheduleBar(lane=DEVICE_LANE, name=WAIT_MEC, cat="wait", start_s=device.compute_s,
                                 dur_s=waited, source="planned"),
                     # Half of the iterations' transfers are the device's own sends, on its link's lane.
                     ScheduleBar(lane=LINK_LANE, name=SEND, cat="transfer", start_s=device.compute_s,
                                 dur_s=device.transfer_s / 2, source="planned")]
        end = device.compute_s + waited
        return [*bars, ScheduleBar(lane="job", name=OUTSIDE, cat="other", start_s=end,
                                   dur_s=max(0.0, predicted - end), source="planned")]

    def explained_spans(self, state: JobState, spans: list[SpanRecord]) -> tuple[list[SpanRecord], list[int]]:
        """The devices' spans named as the plan prices them (a device's computes, its waits for the MEC, its sends);
        the finished rounds in which the last round's devices trained at the last round's cuts (each round plans its
        own participants, and the planned schedule is the last one's), but the first (the devices build their halves
        in it) unless it is the only one."""
        alike = {r.round for r in _like_last(state.progress_as(SplitfedProgress).history)}
        named = [s.model_copy(update={"name": _PLANNED_AS[s.name]}) if s.name in _PLANNED_AS else s for s in spans]
        return named, sorted({s.round for s in spans if s.round in alike})

    def unit_seconds(self, state: JobState) -> tuple[float | None, float | None]:
        """The last round's predicted seconds (the planned schedule's), and the mean measured seconds of the rounds
        ``explained_spans`` lines up (the last round's participants at its cuts)."""
        history = state.progress_as(SplitfedProgress).history
        alike = _like_last(history)
        if not alike:
            return None, None
        return history[-1].predicted_s, fmean(r.round_s for r in alike)

    def stage_devices(self, plan: Any) -> list[list[str]]:
        assert isinstance(plan, SplitSelection)
        return [[d.node] for d in plan.selected]

    def plan_view(self, state: JobState) -> PlanView | None:
        plan = state.plan
        if not isinstance(plan, SplitSelection):
            return None
        groups = tuple(PlanGroup(label=f"{d.node} via {d.mec}", blocks=(
            PlanBlock(device=d.node, detail=f"units 0-{d.cut - 1} and the last, {human_bytes(d.memory_bytes)}"),
            PlanBlock(device=d.mec, detail=f"units {d.cut}- (server half)")),
            detail=f"cut {d.cut}, predicted {d.round_s:.2f} s") for d in plan.selected)
        return PlanView(layout="parallel", groups=groups, summary=(
            f"{len(plan.selected)} participants ({plan.solver}), predicted {plan.t_system_s:.2f} s a round"
            + (f"; no cut fits {', '.join(plan.infeasible)}" if plan.infeasible else "")))

    def series(self, state: JobState) -> list[Series]:
        p = state.progress_as(SplitfedProgress)
        out = []
        for name, unit, pick in (("loss", "", lambda r: r.loss), ("accuracy", "", lambda r: r.accuracy),
                                 ("round time", "s", lambda r: r.round_s if r.round_s > 0 else None),
                                 ("refitted round time", "s", lambda r: r.refitted_s)):
            points = tuple(SeriesPoint(x=r.round + 1, y=v) for r in p.history if finite(v := pick(r)))
            if points:
                last = p.history[-1]
                out.append(Series(name=name, unit=unit, points=points,
                                  predicted=last.predicted_s if name == "round time" and last.predicted_s else None))
        return out

    def run(self, ctx: JobContext, spec: Any) -> tuple[JobEventKind, str] | None:
        from edgeswarm.splitfed.coordinator import SplitfedRunner  # torch: only when a job actually runs

        assert isinstance(spec, SplitfedSpec)
        SplitfedRunner(ctx, spec).run()
        return None

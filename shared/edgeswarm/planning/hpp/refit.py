"""HPP's side of the closed loop (planning.refit holds the fit and the rebalancer every kind shares): what a plan
predicts for each device's share of a micro-batch (``predicted_compute_s``, the fit's denominator) and what a running
plan takes on a refitted profile (``reprice``: its layout and shares kept, its compute, transfers and AllReduces
priced anew, its round the event simulation of its own 1F1B schedule).
"""

from __future__ import annotations

from edgeswarm.planning.hpp.assemble import comm_step, scheduled_round, stage_allreduce_s
from edgeswarm.planning.hpp.costmodel import CostModel
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.values.profiles import ClusterProfile


def predicted_compute_s(plan: Plan, cluster: ClusterProfile, cold: bool = True) -> dict[str, float]:
    """Each device of ``plan``: the forward plus backward seconds of its share of one micro-batch on its stage, as
    ``cluster`` prices it; its units' alone, without the calls' cold costs, when not ``cold`` (``ScaleFit.add``'s
    ``units``)."""
    cm = CostModel(cluster, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    out: dict[str, float] = {}
    for stage in plan.stages:
        for node, share in zip(stage.devices, stage.shares, strict=True):
            i = index[node]
            out[node] = float(cm.compute_s(i, share, stage.start, stage.end, cold))
    return out


def reprice(plan: Plan, cluster: ClusterProfile) -> Plan:
    """``plan`` as it stands (each stage's units, devices and shares of a micro-batch) priced on ``cluster``: what
    the running plan takes if its devices compute and its links carry as ``cluster`` says. Its round is simulated
    as every plan's is (``scheduled_round``), with its per-round overhead kept."""
    cm = CostModel(cluster, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    groups = [[index[node] for node in s.devices] for s in plan.stages]
    stages = []
    for s, group in zip(plan.stages, groups, strict=True):
        held = list(zip(group, s.shares, strict=True))
        stages.append(s.model_copy(update={
            "forward_s": max(float(cm.forward_s(i, y, s.start, s.end)) for i, y in held),
            "backward_s": max(float(cm.backward_s(i, y, s.start, s.end)) for i, y in held),
            "allreduce_s": stage_allreduce_s(cm, s.start, s.end, group)}))
    comms = [comm_step(cm, p, plan.stages[p].end, groups[p], groups[p + 1]) for p in range(len(groups) - 1)]
    latency, dominant = scheduled_round(stages, comms, plan.options.micro_batches, plan.round_overhead_s)
    return plan.model_copy(update={"stages": stages, "comm_steps": comms, "round_latency_s": latency,
                                   "dominant_step": dominant,
                                   "throughput_sps": plan.options.global_batch / latency})



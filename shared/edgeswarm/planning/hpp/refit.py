"""HPP's side of the closed loop (planning.refit holds the fit and the rebalancer every kind shares): what a plan
predicts for each device's share of a micro-batch (``predicted_compute_s``, the fit's denominator) and what a running
plan takes on a refitted profile (``reprice``: its layout and shares kept, its compute priced anew).
"""

from __future__ import annotations

from edgeswarm.planning.hpp.costmodel import CostModel, round_latency
from edgeswarm.planning.hpp.types import Plan, chain_steps
from edgeswarm.values.profiles import ClusterProfile


def predicted_compute_s(plan: Plan, cluster: ClusterProfile) -> dict[str, float]:
    """Each device of ``plan``: the forward plus backward seconds of its share of one micro-batch on its stage, as
    ``cluster`` prices it."""
    cm = CostModel(cluster, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    out: dict[str, float] = {}
    for stage in plan.stages:
        for node, share in zip(stage.devices, stage.shares, strict=True):
            i = index[node]
            out[node] = float(cm.both[i, share, stage.end] - cm.both[i, share, stage.start])
    return out


def reprice(plan: Plan, cluster: ClusterProfile) -> Plan:
    """``plan`` as it stands (each stage's units, devices and shares of a micro-batch, its transfers and AllReduces)
    with its compute priced on ``cluster``: what the running plan takes if its devices compute as ``cluster`` says."""
    cm = CostModel(cluster, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    stages = []
    for s in plan.stages:
        held = [(index[node], share) for node, share in zip(s.devices, s.shares, strict=True)]
        stages.append(s.model_copy(update={
            "forward_s": max(float(cm.fwd[i, y, s.end] - cm.fwd[i, y, s.start]) for i, y in held),
            "backward_s": max(float(cm.bwd[i, y, s.end] - cm.bwd[i, y, s.start]) for i, y in held)}))
    ef, eb, ta = chain_steps(stages, plan.comm_steps)
    latency, dominant = round_latency(ef, eb, plan.options.micro_batches, ta)
    latency += plan.round_overhead_s
    return plan.model_copy(update={"stages": stages, "round_latency_s": latency, "dominant_step": dominant,
                                   "throughput_sps": plan.options.global_batch / latency})



"""HPP training's planning in the planner service: a plan (optionally with the baselines) and re-plans."""

from __future__ import annotations

from edgeswarm.messages.planning import PlanReply, PlanRequest, ReplanRequest
from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.entry import PlannerEntry
from edgeswarm.planning.hpp.budget import estimate_plan, estimate_replan
from edgeswarm.planning.hpp.compare import compare, plan_best
from edgeswarm.planning.hpp.replan import heavy_replan, light_replan


def estimate(req: PlanRequest | ReplanRequest) -> WorkEstimate:
    """The planning work ``req`` asks for."""
    if isinstance(req, PlanRequest):
        return estimate_plan(req.cluster, req.global_batch, micro_batches=req.micro_batches, strategy=req.strategy,
                             compare=req.compare)
    return estimate_replan(req.plan, req.cluster, req.failed, heavy=req.heavy)


def plan(req: PlanRequest | ReplanRequest, deadline: Deadline) -> PlanReply:
    """The plan (with the baselines when asked) or the re-plan ``req`` asks for, stamped with its epoch."""
    if isinstance(req, ReplanRequest):
        replan = heavy_replan if req.heavy else light_replan
        return PlanReply(plan=replan(req.plan, req.cluster, req.failed, deadline=deadline), planning_s=0.0)
    if req.compare:
        comparison = compare(req.cluster, req.global_batch, micro_batches=req.micro_batches,
                             optimizer=req.optimizer, deadline=deadline)
        best, extra = comparison.hpp, comparison
    else:
        best = plan_best(req.strategy, req.cluster, req.global_batch, micro_batches=req.micro_batches,
                         optimizer=req.optimizer, deadline=deadline)
        extra = None
    return PlanReply(plan=best.model_copy(update={"epoch": req.epoch}), comparison=extra, planning_s=0.0)


def describe(req: PlanRequest | ReplanRequest, reply: PlanReply, seconds: float) -> str:
    """The log line of an answered request."""
    p = reply.plan
    if isinstance(req, PlanRequest):
        return (f"planned {p.strategy} for {req.cluster.model.model.name} on {len(req.cluster.devices)} devices in "
                f"{seconds:.2f} s: {len(p.stages)} stages, {p.round_latency_s:.3f} s per round (epoch {p.epoch})")
    return (f"re-planned without {req.failed} ({'heavy' if req.heavy else 'light'}) in {seconds:.3f} s: epoch "
            f"{p.epoch}, {len(p.stages)} stages")


PLANNER = PlannerEntry(requests=(PlanRequest, ReplanRequest), estimate=estimate, plan=plan, describe=describe,
                       counter=lambda req: "plans" if isinstance(req, PlanRequest) else "replans")

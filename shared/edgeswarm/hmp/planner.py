"""Galaxy's planning (``serve-hmp``) in the planner service: heads, columns and rows per device, and the
predicted latency of every parallelism."""

from __future__ import annotations

from edgeswarm.messages.hmp_planning import HmpPlanReply, HmpPlanRequest
from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.entry import PlannerEntry
from edgeswarm.planning.hmp.budget import estimate_hmp_plan
from edgeswarm.planning.hmp.plan import compare, plan_hmp


def estimate(req: HmpPlanRequest) -> WorkEstimate:
    """The planning work ``req`` asks for."""
    return estimate_hmp_plan(req.cluster, req.options, req.compare)


def plan(req: HmpPlanRequest, deadline: Deadline) -> HmpPlanReply:
    """The plan for ``req`` stamped with its epoch (and the comparison when asked). Raises HmpPlanError (an
    InfeasiblePlanError) or ProfileError, which the service answers as PlanFailed. Planning is milliseconds
    (O(D^3)), so ``deadline`` is not consulted."""
    made = plan_hmp(req.cluster, req.options).model_copy(update={"epoch": req.epoch})
    comparison = compare(req.cluster, req.options) if req.compare else None
    return HmpPlanReply(plan=made, comparison=comparison, planning_s=0.0)


def describe(req: HmpPlanRequest, reply: HmpPlanReply, seconds: float) -> str:
    """The log line of an answered request."""
    p = reply.plan
    return (f"planned {p.mode} for {req.cluster.model_name or req.cluster.model.family} on "
            f"{len(p.shares.devices)} of {len(req.cluster.devices)} devices in {seconds:.3f} s: heads "
            f"{p.shares.heads}, {p.model.total_s:.3f} s predicted (epoch {req.epoch})")


PLANNER = PlannerEntry(requests=(HmpPlanRequest,), estimate=estimate, plan=plan, describe=describe,
                       counter=lambda req: "hmp_plans")

"""The toy's planner, run by edgeswarm's planner service: every online node, sorted, takes steps in turn."""

from __future__ import annotations

from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.entry import PlannerEntry
from edgeswarm_toy.messages import ToyPlanReply, ToyPlanRequest
from edgeswarm_toy.spec import ToyPlan


def estimate(req: ToyPlanRequest) -> WorkEstimate:
    return WorkEstimate(what=f"a toy plan over {len(req.nodes)} nodes", cells=len(req.nodes))


def plan(req: ToyPlanRequest, deadline: Deadline) -> ToyPlanReply:
    return ToyPlanReply(plan=ToyPlan(devices=sorted(set(req.nodes)), epoch=req.epoch), planning_s=0.0)


PLANNER = PlannerEntry(requests=(ToyPlanRequest,), estimate=estimate, plan=plan,
                       describe=lambda req, reply, s: f"planned toy job {req.job_id} on {reply.plan.devices}",
                       counter=lambda req: "toy_plans")

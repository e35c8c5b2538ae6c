"""Pipelined serving's planning in the planner service: partition and placement for throughput."""

from __future__ import annotations

from edgeswarm.messages.planning import ServePlanReply, ServePlanRequest
from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.entry import PlannerEntry
from edgeswarm.planning.serve.budget import estimate_serve_plan
from edgeswarm.planning.serve.plan import plan_serving


def estimate(req: ServePlanRequest) -> WorkEstimate:
    """The planning work ``req`` asks for."""
    return estimate_serve_plan(req.cluster, req.options)


def plan(req: ServePlanRequest, deadline: Deadline) -> ServePlanReply:
    """The serving plan for ``req``, stamped with its epoch. (The planner checks its own work against the budget
    when it is priced: ``deadline`` is not needed.)"""
    served = plan_serving(req.cluster, req.options)
    return ServePlanReply(plan=served.model_copy(update={"epoch": req.epoch}), planning_s=0.0)


def describe(req: ServePlanRequest, reply: ServePlanReply, seconds: float) -> str:
    """The log line of an answered request."""
    p = reply.plan
    return (f"planned serving {req.cluster.model.model.name} on {len(req.cluster.devices)} devices in {seconds:.2f} s: "
            f"{len(p.stages)} stages, {p.throughput_per_s:.1f} samples/s predicted (epoch {req.epoch})")


PLANNER = PlannerEntry(requests=(ServePlanRequest,), estimate=estimate, plan=plan, describe=describe,
                       counter=lambda req: "serve_plans")

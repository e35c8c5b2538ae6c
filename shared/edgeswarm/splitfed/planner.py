"""SmartSplit's central manager (``train-splitfed``) in the planner service: each round's participants and cuts."""

from __future__ import annotations

from edgeswarm.messages.splitfed import SplitPlanReply, SplitPlanRequest
from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.entry import PlannerEntry
from edgeswarm.planning.splitfed.plan import plan_round


def estimate(req: SplitPlanRequest) -> WorkEstimate:
    """The planning work ``req`` asks for: the objective evaluated at most at every (cut, count) point, each a pass
    over the devices."""
    cuts = len(req.model.units)
    return WorkEstimate(cells=cuts * len(req.devices) * max(req.options.bo_budget, 1),
                        what=f"{len(req.devices)} devices x {cuts} cuts",
                        advice=("lower options.bo_budget", "plan for fewer devices"))


def plan(req: SplitPlanRequest, deadline: Deadline) -> SplitPlanReply:
    """The selection of round ``req.round``. Raises SplitPlanError (an InfeasiblePlanError) when no device fits,
    which the service answers as PlanFailed. Planning is milliseconds to a second, so ``deadline`` is not
    consulted."""
    return SplitPlanReply(selection=plan_round(req.model, req.devices, req.mecs, req.options), planning_s=0.0)


def describe(req: SplitPlanRequest, reply: SplitPlanReply, seconds: float) -> str:
    """The log line of an answered request."""
    s = reply.selection
    return (f"selected {len(s.selected)} of {len(req.devices)} devices for round {req.round} of {req.model.name} "
            f"in {seconds:.3f} s ({s.solver}, {s.evaluations} points): cuts "
            f"{[d.cut for d in s.selected]}, {s.t_system_s:.2f} s predicted")


PLANNER = PlannerEntry(requests=(SplitPlanRequest,), estimate=estimate, plan=plan, describe=describe,
                       counter=lambda req: "splitfed_plans")

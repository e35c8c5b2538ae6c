"""Messages of the HMP planner (``serve-hmp``): a plan request and its answer.

Requests go to the planner service's request topic like every planning request; the planner answers with an
HmpPlanReply or a PlanFailed (``infeasible`` with what to change when nothing fits). The request carries the
whole planner input (model config, sequence length, block profiles, links), bounded by its schema.
"""

from __future__ import annotations

from pydantic import Field

from edgeswarm.planning.hmp.types import HmpCluster, HmpComparison, HmpOptions, HmpPlan
from edgeswarm.values.limits import MAX_EPOCH
from edgeswarm.wire.schema import MIB, Message, schema


@schema("edgeswarm.plan.hmp_request", 1)
class HmpPlanRequest(Message):
    """Request: plan ``cluster``'s model with ``options`` (mode galaxy, megatron, sp, local or auto; devices to
    exclude; overlap; shift mode; ...). ``compare`` asks for every parallelism's verdict beside the plan.
    ``epoch`` is stamped on the plan. Answered with HmpPlanReply, or PlanFailed."""

    MAX_BYTES = 4 * MIB

    cluster: HmpCluster
    options: HmpOptions = Field(default_factory=HmpOptions)
    compare: bool = False
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)


@schema("edgeswarm.plan.hmp_reply", 1)
class HmpPlanReply(Message):
    """A plan with its predicted latency, communication and memory (and, when asked, the comparison);
    ``planning_s`` is the planner's time."""

    MAX_BYTES = 1 * MIB

    plan: HmpPlan
    comparison: HmpComparison | None = None
    planning_s: float = Field(ge=0.0)

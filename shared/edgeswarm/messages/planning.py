"""Messages of the planner: plan and re-plan requests and their answers.

Requests go to ``edgeswarm/node/{node}/planner/request``; the planner replies with a PlanReply or a
PlanFailed. Times are seconds; the plan's ``epoch`` versions a job's plans (a re-plan returns the old
epoch plus one). Requests are bounded in size by their schemas (edgeswarm.values.limits) and in work by
the planner's time budget (edgeswarm.planning.budget).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeswarm.planning.hpp.compare import Comparison
from edgeswarm.planning.hpp.types import Plan, Strategy
from edgeswarm.planning.serve.types import ServeOptions, ServePlan
from edgeswarm.values.limits import MAX_EPOCH, MAX_GLOBAL_BATCH
from edgeswarm.values.profiles import ClusterProfile, Optimizer
from edgeswarm.wire.schema import MIB, Message, Name, schema


@schema("edgeswarm.plan.request", 1)
class PlanRequest(Message):
    """Request: plan training of ``cluster``'s model on its devices, ``global_batch`` samples per round.

    ``micro_batches`` fixes M (it must divide the global batch); absent, the planner picks the best power
    of two. ``strategy`` ``hpp`` is Asteroid's planner; ``dp``, ``pp`` and ``single`` are the baselines.
    ``compare`` asks for every baseline next to the HPP plan as well. ``epoch`` is stamped on the plan.
    """

    MAX_BYTES = 16 * MIB

    cluster: ClusterProfile
    global_batch: int = Field(ge=1, le=MAX_GLOBAL_BATCH)
    micro_batches: int | None = Field(default=None, ge=1, le=MAX_GLOBAL_BATCH)
    optimizer: Optimizer = "sgd"
    strategy: Strategy = "hpp"
    compare: bool = False
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)


@schema("edgeswarm.plan.replan_request", 1)
class ReplanRequest(Message):
    """Request: the lightweight re-plan of ``plan`` without device ``failed`` (spec 5.4). ``cluster`` is the
    profile the plan was made from. ``heavy`` re-runs the full planner on the survivors instead."""

    MAX_BYTES = 16 * MIB

    plan: Plan
    cluster: ClusterProfile
    failed: Name
    heavy: bool = False


@schema("edgeswarm.plan.reply", 1)
class PlanReply(Message):
    """A plan (and, when asked, the comparison with the baselines); ``planning_s`` is the planner's time."""

    MAX_BYTES = 4 * MIB

    plan: Plan
    comparison: Comparison | None = None
    planning_s: float = Field(ge=0.0)


PlanFailureReason = Literal["infeasible", "bad_profile", "bad_request", "too_large", "busy", "error"]


@schema("edgeswarm.plan.failed", 1)
class PlanFailed(Message):
    """The answer to a request that has no plan: ``infeasible`` (nothing fits in memory), ``bad_profile``
    (the profiles miss a batch size, a device or a link), ``bad_request``, ``too_large`` (planning it would
    take longer than the planner's time budget, EDGESWARM_PLAN_TIME_BUDGET_S: the detail gives the estimate
    and what to change), ``busy`` (the planner's queue is full: ask again later) or ``error``, with
    ``detail``."""

    reason: PlanFailureReason
    detail: str = Field(max_length=4096)


@schema("edgeswarm.plan.serve_request", 1)
class ServePlanRequest(Message):
    """Request: plan serving ``cluster``'s model as a pipeline over its devices (workload ``serve-pipeline``),
    for throughput. Answered with ServePlanReply, or PlanFailed."""

    MAX_BYTES = 16 * MIB

    cluster: ClusterProfile
    options: ServeOptions
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)


@schema("edgeswarm.plan.serve_reply", 1)
class ServePlanReply(Message):
    """A serving plan with its predicted throughput, latency and memory; ``planning_s`` is the planner's time."""

    MAX_BYTES = 1 * MIB

    plan: ServePlan
    planning_s: float = Field(ge=0.0)

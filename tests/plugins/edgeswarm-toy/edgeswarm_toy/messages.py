"""The toy's messages: a plan request to the planner service, and the requests its coordinator program sends to the
devices' toy-workers."""

from __future__ import annotations

from pydantic import Field

from edgeswarm.wire.schema import Message, Name, schema
from edgeswarm_toy.spec import ToyPlan


@schema("toy.plan.request", 1)
class ToyPlanRequest(Message):
    """Plan job ``job_id`` over the nodes ``nodes`` (their toy-workers are online)."""

    job_id: Name
    nodes: list[Name] = Field(min_length=1, max_length=64)
    epoch: int = Field(default=0, ge=0)


@schema("toy.plan.reply", 1)
class ToyPlanReply(Message):
    plan: ToyPlan
    planning_s: float = Field(ge=0.0)


@schema("toy.assign", 1)
class ToyAssign(Message):
    """Hold job ``job_id`` (epoch ``epoch``): steps of it follow."""

    job_id: Name
    epoch: int = Field(ge=0)


@schema("toy.ready", 1)
class ToyReady(Message):
    job_id: Name


@schema("toy.step", 1)
class ToyStep(Message):
    """Double ``value`` for job ``job_id``."""

    job_id: Name
    step: int = Field(ge=0)
    value: int = Field(ge=0, le=1_000_000)


@schema("toy.step.done", 1)
class ToyStepDone(Message):
    job_id: Name
    step: int = Field(ge=0)
    doubled: int = Field(ge=0)


@schema("toy.release", 1)
class ToyRelease(Message):
    """Forget job ``job_id``."""

    job_id: Name

"""What a user submits (``kind: toy``), the plan the planner makes and the job's progress."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.wire.schema import NAME_PATTERN

KIND = "toy"
WORKER = "toy-worker"  # the service that hosts the toy's worker program (registered in service.py)


class ToySpec(BaseModel):
    """A toy job: ``steps`` numbers doubled, one every ``step_s`` seconds at most."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["toy"]
    name: str = Field(pattern=NAME_PATTERN)
    steps: int = Field(default=10, ge=1, le=10_000)
    step_s: float = Field(default=0.0, ge=0.0, le=5.0)


class ToyPlan(BaseModel):
    """The devices that double the numbers, in turn; ``epoch`` counts re-plans."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: Literal["toy"] = "toy"
    devices: list[str] = Field(min_length=1, max_length=64)
    epoch: int = Field(default=0, ge=0)


class ToyProgress(BaseModel):
    """Steps done out of ``total`` and the sum of the doubled numbers so far."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps_done: int = Field(default=0, ge=0)
    total: int = Field(default=0, ge=0)
    doubled_sum: int = Field(default=0, ge=0)

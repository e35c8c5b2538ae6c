"""The serve-pipeline planner's options and its plan (contract shared with the serving runtime)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.profiling.limits import MAX_BATCH_SIZE, MAX_DEVICES, MAX_EPOCH, MAX_ID_CHARS, MAX_UNITS
from edgeswarm.wire.schema import Name


class ServeOptions(BaseModel):
    """What a serving plan is for: ``micro_batch_size`` samples per pipeline item."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(default=1, ge=1, le=MAX_BATCH_SIZE)
    max_stages: int | None = Field(default=None, ge=1, le=MAX_DEVICES)
    method: Literal["auto", "kpath", "greedy", "optimal"] = "auto"
    exclude: list[Name] = Field(default_factory=list, max_length=MAX_DEVICES)
    seed: int = 0


class ServeStagePlan(BaseModel):
    """Stage ``index``: units [start, end) on ``device``."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    index: int = Field(ge=0, lt=MAX_DEVICES)
    start: int = Field(ge=0, lt=MAX_UNITS)
    end: int = Field(ge=1, le=MAX_UNITS)
    device: Name
    compute_s: float = Field(ge=0)
    transfer_in_s: float = Field(ge=0)
    input_bytes: int = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    memory_budget_bytes: int = Field(ge=0)


class ServePlan(BaseModel):
    """A pipelined-inference plan and its prediction (seconds, samples per second)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    workload: Literal["serve-pipeline"] = "serve-pipeline"
    model_fingerprint: str = Field(max_length=MAX_ID_CHARS)
    micro_batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    stages: list[ServeStagePlan] = Field(min_length=1, max_length=MAX_DEVICES)
    bottleneck_s: float = Field(gt=0)
    throughput_per_s: float = Field(gt=0)
    latency_s: float = Field(gt=0)
    method: str = Field(default="", max_length=MAX_ID_CHARS)
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)

    @model_validator(mode="after")
    def _structure(self) -> ServePlan:
        if self.stages[0].start != 0:
            raise ValueError("the first stage must start at unit 0")
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            if a.end != b.start:
                raise ValueError(f"stage {a.index} ends at {a.end} but stage {b.index} starts at {b.start}")
        if len({s.device for s in self.stages}) != len(self.stages):
            raise ValueError("every stage needs a device of its own")
        return self

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

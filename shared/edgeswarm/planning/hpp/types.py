"""The planner's input options and its output, the plan: pydantic models (JSON, MQTT, CLI).

Times in seconds, sizes in bytes, throughput in samples per second. Plans travel in re-plan requests, replies
and job states, so their lists are bounded like the profiles they come from (edgeswarm.values.limits).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.values.limits import MAX_BATCH_SIZE, MAX_DEVICES, MAX_EPOCH, MAX_GLOBAL_BATCH, MAX_ID_CHARS, MAX_UNITS
from edgeswarm.values.profiles import Optimizer
from edgeswarm.wire.schema import Name

Strategy = Literal["hpp", "dp", "pp", "single"]

# One entry per device of a stage.
PerDevice = Annotated[list[int], Field(max_length=MAX_DEVICES)]


class PlanOptions(BaseModel):
    """What a plan is for: B samples per micro-batch, M micro-batches per round (mini-batch = M*B)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    micro_batches: int = Field(ge=1, le=MAX_GLOBAL_BATCH)
    optimizer: Optimizer = "sgd"

    @model_validator(mode="after")
    def _global_batch(self) -> PlanOptions:
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise ValueError(f"a global batch of {self.micro_batches} x {self.micro_batch_size} samples is more "
                             f"than {MAX_GLOBAL_BATCH}")
        return self

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches


class StagePlan(BaseModel):
    """Stage p: units [start, end) data-parallel over ``devices`` with ``shares[i]`` samples of every
    micro-batch on ``devices[i]``; ``warmup`` is K_p (forwards before the first backward)."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0, lt=MAX_DEVICES)
    start: int = Field(ge=0, lt=MAX_UNITS)
    end: int = Field(ge=1, le=MAX_UNITS)
    devices: list[Name] = Field(min_length=1, max_length=MAX_DEVICES)
    shares: PerDevice
    warmup: int = Field(ge=1)
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)
    allreduce_s: float = Field(ge=0)
    memory_bytes: PerDevice
    memory_budget_bytes: PerDevice

    @model_validator(mode="after")
    def _lengths(self) -> StagePlan:
        n = len(self.devices)
        if not (len(self.shares) == len(self.memory_bytes) == len(self.memory_budget_bytes) == n):
            raise ValueError("shares, memory_bytes and memory_budget_bytes need one entry per device")
        if self.end <= self.start:
            raise ValueError("a stage needs at least one unit (end > start)")
        return self


class CommStepPlan(BaseModel):
    """The link step between stage ``after`` and stage ``after + 1``: bytes per micro-batch each way, and the
    messages they are sent as (the slowest device's count; each costs the link's per-message seconds)."""

    model_config = ConfigDict(frozen=True)

    after: int = Field(ge=0, lt=MAX_DEVICES)
    bytes_per_microbatch: int = Field(ge=0)
    bandwidth_bps: float = Field(gt=0)
    messages: int = Field(default=1, ge=0, le=2**31)
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)


class Plan(BaseModel):
    """A training plan and its prediction. ``epoch`` versions a job's plans (a re-plan increments it).

    ``round_latency_s`` is the simulated 1F1B round (Appendix A) plus ``round_overhead_s``, the coordinator's
    requests of a round (a round trip through the hub), which the schedule's steps do not hold."""

    model_config = ConfigDict(frozen=True)

    workload: Literal["train"] = "train"
    strategy: Strategy
    model_fingerprint: str = Field(max_length=MAX_ID_CHARS)
    units: int = Field(ge=1, le=MAX_UNITS)
    options: PlanOptions
    stages: list[StagePlan] = Field(min_length=1, max_length=MAX_DEVICES)
    comm_steps: list[CommStepPlan] = Field(max_length=MAX_DEVICES)
    dominant_step: int = Field(ge=0)
    round_latency_s: float = Field(gt=0)
    round_overhead_s: float = Field(default=0.0, ge=0)
    throughput_sps: float = Field(gt=0)
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)

    @model_validator(mode="after")
    def _structure(self) -> Plan:
        if len(self.comm_steps) != len(self.stages) - 1:
            raise ValueError("a plan with P stages has P-1 communication steps")
        if self.stages[0].start != 0 or self.stages[-1].end != self.units:
            raise ValueError("stages must cover units 0..units")
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            if a.end != b.start:
                raise ValueError(f"stage {a.index} ends at {a.end} but stage {b.index} starts at {b.start}")
        return self

    @property
    def devices(self) -> list[str]:
        return [d for s in self.stages for d in s.devices]

    def step_times(self) -> tuple[list[float], list[float], list[float]]:
        """Per step (exec 0, comm 0, exec 1, ...): forward, backward and AllReduce seconds."""
        return chain_steps(self.stages, self.comm_steps)


def chain_steps(stages: list[StagePlan],
                comm_steps: list[CommStepPlan]) -> tuple[list[float], list[float], list[float]]:
    """Forward, backward and AllReduce seconds per step of the chain exec 0, comm 0, exec 1, ..., exec P-1."""
    ef: list[float] = []
    eb: list[float] = []
    ta: list[float] = []
    for p, stage in enumerate(stages):
        ef.append(stage.forward_s)
        eb.append(stage.backward_s)
        ta.append(stage.allreduce_s)
        if p < len(comm_steps):
            ef.append(comm_steps[p].forward_s)
            eb.append(comm_steps[p].backward_s)
            ta.append(0.0)
    return ef, eb, ta

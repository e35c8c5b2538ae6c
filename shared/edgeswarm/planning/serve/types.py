"""The serve-pipeline plan contract: options in, plan out (pydantic, JSON and MQTT safe).

Times in seconds, sizes in bytes, throughput in samples per second. Plans travel in MQTT messages and job
states, so every list is bounded and every float finite.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.values.limits import MAX_BATCH_SIZE, MAX_DEVICES, MAX_EPOCH, MAX_ID_CHARS, MAX_UNITS
from edgeswarm.wire.schema import Name

ServeMethod = Literal["auto", "kpath", "greedy", "optimal"]


class ServeOptions(BaseModel):
    """What to plan for.

    ``micro_batch_size`` samples travel together through the pipeline; ``max_stages`` caps the number of
    stages (devices used); ``method``: ``kpath`` (the paper's partition DP then class-ordered k-path
    placement, compute-aware evaluation), ``greedy`` (same partition, nearest-neighbour placement),
    ``optimal`` (exact compute-aware search over contiguous partitions x injective placements on the
    fastest devices), ``auto`` (every method that applies; the best predicted bottleneck wins).
    ``exclude`` names devices not to use. ``seed`` seeds the randomised parts (colour-coding).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    micro_batch_size: int = Field(default=1, ge=1, le=MAX_BATCH_SIZE)
    max_stages: int | None = Field(default=None, ge=1, le=MAX_DEVICES)
    method: ServeMethod = "auto"
    exclude: list[Name] = Field(default_factory=list, max_length=MAX_DEVICES)
    seed: int = 0


class ServeStagePlan(BaseModel):
    """Stage ``index`` runs units [start, end) on ``device``.

    ``compute_s``: forward seconds of one micro-batch on that device. ``transfer_in_s``: seconds to receive
    the stage's input micro-batch from the previous stage's device (bytes / bandwidth + link latency; 0 for
    stage 0, whose input is already on its device). ``input_bytes``: bytes of one micro-batch entering the
    stage. ``memory_bytes``: weights + buffers + the largest live activation at the micro-batch size.
    """

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
    """A pipelined-inference plan and its prediction.

    ``bottleneck_s`` (beta) is the slowest stage or link per micro-batch; ``throughput_per_s`` =
    micro_batch_size / bottleneck_s samples per second; ``latency_s`` is one micro-batch through the whole
    pipeline (sum of computes and transfers). ``method`` names the search that produced it.
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    workload: Literal["serve-pipeline"] = "serve-pipeline"
    model_fingerprint: str = Field(max_length=MAX_ID_CHARS)
    micro_batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    stages: list[ServeStagePlan] = Field(min_length=1, max_length=MAX_DEVICES)
    bottleneck_s: float = Field(gt=0)
    throughput_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    method: str = Field(max_length=MAX_ID_CHARS)
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)
    # Where beta comes from: "compute:<device>" or "link:<src>-><dst>".
    bottleneck: str = Field(default="", max_length=3 * MAX_ID_CHARS)
    units: int = Field(default=0, ge=0, le=MAX_UNITS)

    @model_validator(mode="after")
    def _shape(self) -> ServePlan:
        self.validate_stages(self.units or None)
        return self

    def validate_stages(self, units: int | None = None) -> None:
        """Raise ValueError unless the stages are numbered 0.., contiguous from unit 0 (to ``units`` when
        given) and on distinct devices."""
        expect = 0
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise ValueError(f"stage {i} is numbered {s.index}")
            if s.start != expect or s.end <= s.start:
                raise ValueError(f"stage {i} covers units [{s.start}, {s.end}) but must start at {expect}")
            expect = s.end
        if units is not None and expect != units:
            raise ValueError(f"the stages cover units [0, {expect}) but the model has {units}")
        names = [s.device for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"a device holds two stages: {names}")

    @property
    def devices(self) -> list[str]:
        """The devices in pipeline order."""
        return [s.device for s in self.stages]

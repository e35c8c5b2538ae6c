"""What a user submits to serve a model: ``kind: serve-pipeline`` and these fields (YAML or JSON)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.serve.load import LoadPrediction
from edgeswarm.planning.serve.types import ServeOptions
from edgeswarm.values.limits import MAX_BATCH_SIZE
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.wire.schema import NAME_PATTERN, Name


class WeightsSpec(BaseModel):
    """Serve the weights a training job saved: checkpoint ``version`` of job ``job`` (``latest``: its newest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: Name
    version: int | Literal["latest"] = "latest"


class ServeSpec(BaseModel):
    """A serving job. ``micro_batch_size`` is the most samples one pipeline item carries (requests are batched up to
    it); ``window`` the most items in the pipeline at once (a full window holds requests back, up to ``queue``
    waiting requests; beyond that a request is answered ``busy``). Weights come from ``weights`` or, absent, from
    the model's seed. ``planner`` tunes the plan (method, most stages, devices to leave out)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["serve-pipeline"]
    name: str = Field(pattern=NAME_PATTERN)
    model: ModelSpec
    weights: WeightsSpec | None = None
    micro_batch_size: int = Field(default=4, ge=1, le=MAX_BATCH_SIZE)
    window: int = Field(default=8, ge=1, le=256)
    queue: int = Field(default=256, ge=1, le=4096)
    planner: ServeOptions = ServeOptions()

    def options(self) -> ServeOptions:
        """The planner's options for this job (its micro-batch size wins over the planner section's)."""
        return self.planner.model_copy(update={"micro_batch_size": self.micro_batch_size})


class ServeProgress(BaseModel):
    """How a serving job serves. ``answered`` requests got outputs and ``errors`` an InferError; ``replayed``
    pipeline items were sent through again after a device was lost (each still answered once); ``in_flight`` items
    are in the pipeline and ``queued`` requests wait for room in its window. ``throughput_per_s`` (samples per
    second) and the latency percentiles (seconds from a request's arrival to its answer) are measured over the
    recent requests, beside the plan's predictions and ``refitted_throughput_per_s``, the running plan's throughput
    priced on each stage device's forward as measured so far (the closed loop's fit). ``offered_per_s``: samples a
    second that arrived over the recent requests; ``at_load``: what the plan predicts at that load and the requests
    the coordinator holds (``planning.serve.load.at_measured_load``), the measured latency's and throughput's
    counterparts. ``weights`` says where the weights came from."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["serve-pipeline"] = "serve-pipeline"
    answered: int = Field(default=0, ge=0)
    samples: int = Field(default=0, ge=0)
    errors: int = Field(default=0, ge=0)
    replayed: int = Field(default=0, ge=0)
    in_flight: int = Field(default=0, ge=0)
    queued: int = Field(default=0, ge=0)
    throughput_per_s: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    predicted_throughput_per_s: float | None = None
    predicted_latency_s: float | None = None
    refitted_throughput_per_s: float | None = None
    offered_per_s: float | None = Field(default=None, ge=0)
    at_load: LoadPrediction | None = None
    reconfigurations: int = Field(default=0, ge=0)
    weights: str = Field(default="", max_length=256)

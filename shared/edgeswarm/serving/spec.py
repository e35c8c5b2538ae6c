"""What a user submits to serve a model: ``kind: serve-pipeline`` and these fields (YAML or JSON)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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

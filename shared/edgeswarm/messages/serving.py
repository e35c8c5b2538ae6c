"""Messages of the serve-pipeline workload: deploying a model as a pipeline, its tensors, and inference requests.

The coordinator assigns each stage of a ServePlan to a device's stage-worker (ServeAssign, answered ServeReady or
StageFailed) and releases it when the job ends (ServeRelease). Pipeline items travel as ServeTensor frames on the
data topics: from the coordinator to stage 0, from stage k to stage k+1, and from the last stage back to the
coordinator. Anyone allowed to send the coordinator tensors (hub and client members) asks for inferences with an
InferRequest frame on the coordinator's data topic, carrying ``reply_to`` and a correlation id in its envelope;
the answer is an InferReply frame with the outputs, or an InferError, on that reply topic.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.values.limits import MAX_BATCH_SIZE, MAX_DEVICES, MAX_EPOCH, MAX_UNITS
from edgeswarm.values.profiles import LinkSample, ModelSpec
from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_ITEM = 1 << 40  # pipeline item numbers per epoch: far beyond any stream, small enough for every decoder
MAX_STAGE_S = 3600.0  # one stage's forward of one item, at most (seconds)


class WeightsSource(BaseModel):
    """Where a serving stage takes its weights from: ``version`` of training job ``job_id``'s checkpoint on the
    store of ``store_node``, whose checkpoint stage ``stage-k`` holds units ``stages[k]`` ([start, end))."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store_node: Name
    job_id: Name
    version: int = Field(ge=0)
    stages: list[tuple[int, int]] = Field(min_length=1, max_length=MAX_DEVICES)


@schema("edgeswarm.serve.assign", 1)
class ServeAssign(Message):
    """Request to a stage-worker: hold units [start, end) of ``model`` as stage ``stage`` of serving job ``job_id``,
    plan epoch ``epoch``. ``devices`` lists every stage's device in pipeline order; the last stage sends its outputs
    to the coordinator on ``coordinator``. Weights come from ``weights``, or (None) from the model's seed, as every
    replica of a training job starts. Answered with ServeReady, or StageFailed (``memory`` when the stage does not
    fit the device's budget). A newer assignment of the same job replaces the old one; other jobs are untouched."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    stage: int = Field(ge=0, lt=MAX_DEVICES)
    model: ModelSpec
    start: int = Field(ge=0, lt=MAX_UNITS)
    end: int = Field(ge=1, le=MAX_UNITS)
    devices: list[Name] = Field(min_length=1, max_length=MAX_DEVICES)
    coordinator: Name
    micro_batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    weights: WeightsSource | None = None


@schema("edgeswarm.serve.ready", 1)
class ServeReady(Message):
    """The stage of ``job_id`` at ``epoch`` is built and loaded: ``parameters`` weights, ``memory_bytes`` of weights
    and buffers, ``load_s`` seconds to build and load it."""

    job_id: Name
    epoch: int = Field(ge=0)
    stage: int = Field(ge=0)
    parameters: int = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    load_s: float = Field(ge=0)


@schema("edgeswarm.serve.release", 1)
class ServeRelease(Message):
    """Command to a stage-worker, not answered: drop serving job ``job_id``'s stage."""

    job_id: Name


@schema("edgeswarm.serve.tensor", 1)
class ServeTensor(Message):
    """Frames of pipeline item ``item`` (numbered from 0 in each plan epoch) of ``job_id``, entering stage
    ``stage``; ``stage`` equal to the number of stages marks the outputs on their way back to the coordinator.
    ``compute_s`` are the seconds each stage before took for the item's forward, in stage order, and ``arrivals``
    how the item's tensors of several chunks reached each stage before (at most one a stage, from the node that sent
    it: the coordinator or the stage before); both the closed loop's measurements (planning.refit)."""

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    item: int = Field(ge=0, le=MAX_ITEM)
    stage: int = Field(ge=0, le=MAX_DEVICES)
    compute_s: list[Annotated[float, Field(ge=0, le=MAX_STAGE_S, allow_inf_nan=False)]] = Field(
        default_factory=list, max_length=MAX_DEVICES)
    arrivals: list[LinkSample] = Field(default_factory=list, max_length=MAX_DEVICES)


@schema("edgeswarm.infer.request", 1)
class InferRequest(Message):
    """Frames of inputs for serving job ``job_id``: a tensor [rows, *sample shape] of the model's input dtype, rows
    at most the job's micro-batch size. ``request_id`` is the caller's, echoed in the answer."""

    job_id: Name
    request_id: str = Field(default="", max_length=64)


@schema("edgeswarm.infer.reply", 1)
class InferReply(Message):
    """Frames of the outputs for ``request_id``: [rows, *output shape], float32. ``latency_s`` is the time from the
    request's arrival at the coordinator to this answer; ``epoch`` the plan epoch that computed it; ``replayed`` says
    it was sent through the pipeline again after a device was lost."""

    job_id: Name
    request_id: str = Field(default="", max_length=64)
    latency_s: float = Field(ge=0)
    epoch: int = Field(ge=0)
    replayed: bool = False


InferErrorReason = Literal["unknown_job", "not_serving", "no_tensor", "bad_dtype", "bad_shape", "too_large", "busy",
                           "failed", "cancelled"]


@schema("edgeswarm.infer.error", 1)
class InferError(Message):
    """The request ``request_id`` was not answered with outputs: ``unknown_job``, ``not_serving`` (the job is not
    running, or stopped), ``no_tensor``, ``bad_dtype``, ``bad_shape``, ``too_large`` (more rows than a micro-batch),
    ``busy`` (the job's queue is full: send again later), ``failed`` or ``cancelled`` (its caller cancelled it);
    ``detail`` says what to change."""

    job_id: str = Field(max_length=64)
    request_id: str = Field(default="", max_length=64)
    reason: InferErrorReason
    detail: str = Field(default="", max_length=1024)

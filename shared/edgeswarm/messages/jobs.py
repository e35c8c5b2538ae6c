"""Messages of jobs of every kind (training, serving): submitting and cancelling them, and their state and events.

Requests go to the coordinator, ``edgeswarm/node/hub/coordinator/request``. A job's state is retained on
``edgeswarm/job/{job}/state`` (so any client that subscribes sees where it is at once) and every event goes
to ``edgeswarm/job/{job}/events``. Times are seconds; ``*_at`` are Unix times.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.hpp.types import Plan, Strategy
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_SPEC_CHARS = 65536

JobKind = Literal["train", "serve-pipeline"]
JobStatus = Literal["queued", "profiling", "planning", "deploying", "running", "recovering", "succeeded", "failed",
                    "cancelled"]
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


@schema("edgeswarm.job.submit", 1)
class JobSubmit(Message):
    """Request: run the job that ``spec`` (the text of a YAML or JSON job spec) describes. ``submission`` is the
    submitter's id for this submission, copied into the job's state so it can tell its job from an earlier one
    of the same name. Answered with JobAccepted, or JobRejected naming the invalid field and why."""

    MAX_BYTES = 128 * 1024

    spec: str = Field(max_length=MAX_SPEC_CHARS)
    submission: str = Field(default="", max_length=64)


@schema("edgeswarm.job.cancel", 1)
class JobCancel(Message):
    """Request: stop job ``job_id`` at its next step boundary (the round in flight is aborted). Answered with
    JobAccepted, or JobRejected when no such job is running."""

    job_id: Name


@schema("edgeswarm.job.accepted", 1)
class JobAccepted(Message):
    """The coordinator took the submission or cancellation of ``job_id``; ``detail`` says what happens next."""

    job_id: Name
    detail: str = Field(default="", max_length=1024)


JobRejection = Literal["invalid", "duplicate", "unknown_job", "finished"]


@schema("edgeswarm.job.rejected", 1)
class JobRejected(Message):
    """The coordinator refused: ``invalid`` spec (detail lists each field and its problem), ``duplicate`` name of
    a job still running, ``unknown_job`` or ``finished`` for a cancellation."""

    reason: JobRejection
    detail: str = Field(max_length=4096)


class StrategyPrediction(BaseModel):
    """What the planner predicts for one strategy on this job's cluster: seconds per round and samples per
    second, or why the strategy has no plan (it does not fit in memory)."""

    strategy: Strategy
    round_s: float | None = None
    samples_per_s: float | None = None
    error: str | None = None

    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainProgress(BaseModel):
    """How far a training job is. ``round`` counts the rounds done out of ``total_rounds``; ``loss`` and
    ``accuracy`` are the last round's over its mini-batch; ``round_s`` its wall time, against the plan's
    ``predicted_round_s``; ``samples_per_s`` is the global batch over ``round_s``. ``test_accuracy`` is the final
    model's, loaded back from the checkpoint store, on the held-out split. ``reconfigurations`` counts re-plans
    after a device left or joined, and ``predictions`` are every strategy's predicted figures. After a recovery
    ``round`` goes back to the round the job resumed from: those rounds run again."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # a diverged loss is NaN

    kind: Literal["train"] = "train"
    strategy: Strategy = "hpp"
    round: int = Field(default=0, ge=0)
    total_rounds: int = Field(default=0, ge=0)
    loss: float | None = None
    accuracy: float | None = None
    round_s: float | None = None
    predicted_round_s: float | None = None
    samples_per_s: float | None = None
    checkpoint_version: int | None = None
    test_accuracy: float | None = None
    predictions: list[StrategyPrediction] = Field(default_factory=list, max_length=8)
    reconfigurations: int = Field(default=0, ge=0)


class ServeProgress(BaseModel):
    """How a serving job serves. ``answered`` requests got outputs and ``errors`` an InferError; ``replayed``
    pipeline items were sent through again after a device was lost (each still answered once); ``in_flight`` items
    are in the pipeline and ``queued`` requests wait for room in its window. ``throughput_per_s`` (samples per
    second) and the latency percentiles (seconds from a request's arrival to its answer) are measured over the
    recent requests, beside the plan's predictions. ``weights`` says where the weights came from."""

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
    reconfigurations: int = Field(default=0, ge=0)
    weights: str = Field(default="", max_length=256)


AnyPlan = Annotated[Plan | ServePlan, Field(discriminator="workload")]
Progress = Annotated[TrainProgress | ServeProgress, Field(discriminator="kind")]


@schema("edgeswarm.job.state", 1)
class JobState(Message):
    """Where job ``job_id`` of kind ``kind`` is (retained): the fields every job has, its ``plan`` (the plan it runs
    on, re-planned after a device left or joined: see ``plan.epoch``) and the kind's ``progress``. ``detail`` says why
    a job failed. ``spec`` is the job spec as submitted: with the plan and the progress, what a restarted
    coordinator needs to take the job over."""

    MAX_BYTES = 2 * MIB

    job_id: Name
    submission: str = Field(default="", max_length=64)
    spec: str = Field(default="", max_length=MAX_SPEC_CHARS)
    kind: JobKind = "train"
    status: JobStatus
    model: str = Field(max_length=128)
    plan: AnyPlan | None = None
    progress: Progress = Field(default_factory=TrainProgress)
    detail: str = Field(default="", max_length=4096)
    submitted_at: float
    updated_at: float

    @property
    def train(self) -> TrainProgress:
        """The progress of a training job (TypeError for another kind)."""
        if not isinstance(self.progress, TrainProgress):
            raise TypeError(f"job {self.job_id} is a {self.kind} job, not a training job")
        return self.progress

    @property
    def serve(self) -> ServeProgress:
        """The progress of a serving job (TypeError for another kind)."""
        if not isinstance(self.progress, ServeProgress):
            raise TypeError(f"job {self.job_id} is a {self.kind} job, not a serving job")
        return self.progress


JobEventKind = Literal["submitted", "profiling", "planned", "deployed", "round", "checkpoint", "device_lost",
                       "recovered", "joined", "resumed", "evaluated", "succeeded", "failed", "cancelled", "serving"]


@schema("edgeswarm.job.event", 1)
class JobEvent(Message):
    """Something that happened to job ``job_id``, of the submission ``submission`` (as its state's): ``round`` is
    the rounds done when it happened; ``detail`` is for people."""

    job_id: Name
    submission: str = Field(default="", max_length=64)
    kind: JobEventKind
    round: int = Field(default=0, ge=0)
    detail: str = Field(default="", max_length=4096)

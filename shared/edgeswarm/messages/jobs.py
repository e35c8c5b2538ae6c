"""Messages of training jobs: submitting and cancelling them, and their state and events.

Requests go to the coordinator, ``edgeswarm/node/hub/coordinator/request``. A job's state is retained on
``edgeswarm/job/{job}/state`` (so any client that subscribes sees where it is at once) and every event goes
to ``edgeswarm/job/{job}/events``. Times are seconds; ``*_at`` are Unix times.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.types import Plan, Strategy
from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_SPEC_CHARS = 65536

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


@schema("edgeswarm.job.state", 1)
class JobState(Message):
    """Where job ``job_id`` is (retained). ``round`` counts the rounds done out of ``total_rounds``; ``loss``
    and ``accuracy`` are the last round's over its mini-batch; ``round_s`` its wall time, against the plan's
    ``predicted_round_s``; ``samples_per_s`` is the global batch over ``round_s``. ``test_accuracy`` is the
    final model's, loaded back from the checkpoint store, on the held-out split. ``plan`` is the plan the
    job runs on (re-planned after a device left or joined: see ``plan.epoch``), ``reconfigurations`` how many
    times that happened, and ``predictions`` every strategy's predicted figures. ``detail`` says why a job
    failed. After a recovery ``round`` goes back to the round the job resumed from: those rounds run again.
    ``spec`` is the job spec as submitted: with the plan and the rounds done, what a restarted coordinator needs
    to take the job over."""

    MAX_BYTES = 2 * MIB

    job_id: Name
    submission: str = Field(default="", max_length=64)
    spec: str = Field(default="", max_length=MAX_SPEC_CHARS)
    status: JobStatus
    model: str
    strategy: Strategy
    round: int = Field(default=0, ge=0)
    total_rounds: int = Field(default=0, ge=0)
    loss: float | None = None
    accuracy: float | None = None
    round_s: float | None = None
    predicted_round_s: float | None = None
    samples_per_s: float | None = None
    checkpoint_version: int | None = None
    test_accuracy: float | None = None
    plan: Plan | None = None
    predictions: list[StrategyPrediction] = Field(default_factory=list)
    reconfigurations: int = Field(default=0, ge=0)
    detail: str = Field(default="", max_length=4096)
    submitted_at: float
    updated_at: float


JobEventKind = Literal["submitted", "profiling", "planned", "deployed", "round", "checkpoint", "device_lost",
                       "recovered", "joined", "resumed", "evaluated", "succeeded", "failed", "cancelled"]


@schema("edgeswarm.job.event", 1)
class JobEvent(Message):
    """Something that happened to job ``job_id``, of the submission ``submission`` (as its state's): ``round`` is
    the rounds done when it happened; ``detail`` is for people."""

    job_id: Name
    submission: str = Field(default="", max_length=64)
    kind: JobEventKind
    round: int = Field(default=0, ge=0)
    detail: str = Field(default="", max_length=4096)

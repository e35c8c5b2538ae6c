"""Messages of jobs of every kind (training, serving): submitting and cancelling them, and their state and events.

Requests go to the coordinator, ``edgeswarm/node/hub/coordinator/request``. A job's state is retained on
``edgeswarm/job/{job}/state`` (so any client that subscribes sees where it is at once) and every event goes
to ``edgeswarm/job/{job}/events``. Times are seconds; ``*_at`` are Unix times.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_SPEC_CHARS = 65536
DEFAULT_KIND = "train"  # a spec without ``kind`` (every spec before there were other kinds)
P = TypeVar("P", bound=BaseModel)

# A job kind is a name in the workload registry (``edgeswarm.workloads``), built in or from a plug-in; this layer
# never looks it up.
JobKind = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9-]*$")]
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


class OpaqueValue(BaseModel):
    """The plan or progress of a job as it came off the wire: a JSON object kept as it came, until the workload
    registry's ``typed_state`` parses it with the kind's own types; for a kind not installed here (a plug-in's, seen
    by a client without it) it stays so, shown as it is, never interpreted."""

    model_config = ConfigDict(extra="allow", frozen=True)


def _as_value(value: object) -> object:
    return OpaqueValue.model_validate(value) if isinstance(value, dict) else value  # anything else: the field says why


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
    kind: JobKind = DEFAULT_KIND
    status: JobStatus
    model: str = Field(max_length=128)
    plan: SerializeAsAny[BaseModel] | None = None
    progress: SerializeAsAny[BaseModel] = Field(default_factory=OpaqueValue)
    detail: str = Field(default="", max_length=4096)
    submitted_at: float
    updated_at: float

    @model_validator(mode="before")
    @classmethod
    def _kept_as_data(cls, data: Any) -> Any:
        # The plan and the progress are the kind's own types, which this layer does not know (a message schema must
        # not depend on the plug-ins installed): from the wire they are kept as data (OpaqueValue), and the workload
        # registry's ``typed_state`` parses them with the kind's types. A typed value given here is kept as it is.
        if not isinstance(data, dict):
            return data
        out = dict(data)
        if out.get("plan") is not None:
            out["plan"] = _as_value(out["plan"])
        if "progress" in out:
            out["progress"] = _as_value(out["progress"])
        return out

    def progress_as(self, cls: type[P]) -> P:
        """The progress, as the kind's progress type ``cls`` (a state from the wire: once ``typed_state`` parsed it).
        Raises TypeError for a job of another kind, or a state whose progress was not parsed."""
        if not isinstance(self.progress, cls):
            raise TypeError(f"job {self.job_id} is a {self.kind} job, not one with {cls.__name__}")
        return self.progress


# What happened to a job. The common events are these; a workload may name its own (a plug-in's kind included), so the
# type is a short name rather than a closed list: "submitted", "profiling", "planned", "deployed", "round",
# "checkpoint", "device_lost", "recovered", "joined", "resumed", "evaluated", "succeeded", "failed", "cancelled",
# "serving".
JobEventKind = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z][a-z_]*$")]


@schema("edgeswarm.job.event", 1)
class JobEvent(Message):
    """Something that happened to job ``job_id``, of the submission ``submission`` (as its state's): ``round`` is
    the rounds done when it happened; ``detail`` is for people."""

    job_id: Name
    submission: str = Field(default="", max_length=64)
    kind: JobEventKind
    round: int = Field(default=0, ge=0)
    detail: str = Field(default="", max_length=4096)

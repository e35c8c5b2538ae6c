"""Measured spans: what a worker did and when (a forward, a backward, a transfer, a collective step, a wait).

Every worker service publishes the spans its programs recorded as ``SpanBatch`` on its own
``edgeswarm/node/{node}/{service}/spans`` topic, one batch per job; the dashboard's trace collector keeps them and
answers a ``TraceRequest`` with a ``TraceReply`` (``edgeswarm trace JOB`` writes it as Chrome trace format).
Times: ``start`` is Unix seconds (the worker's wall clock at the span's start), ``dur_s`` seconds.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.wire.schema import MIB, Message, Name, schema

SpanCat = Literal["compute", "transfer", "collective", "wait", "other"]
MAX_NAME_CHARS = 64
MAX_LANE_CHARS = 64
# A span longer than a day is no span of a round or request: a clock that jumped, or a forged one.
MAX_SPAN_S = 86_400.0
MAX_INDEX = 1 << 40  # rounds, passes, items: as the exchange scopes (messages.collectives.MAX_SCOPE)
MAX_SAMPLES = 1 << 20


class SpanRecord(BaseModel):
    """One span: ``name`` ("forward", "send activation"), its category ``cat``, the job, node and service that
    recorded it, its ``lane`` (a stage, a shard, a link: "stage 1", "shard 0", "link 0→1": one row of a timeline),
    the job's ``round`` (None outside rounds: a serving request) and ``micro_batch`` (None where there is none),
    ``samples`` the samples its item or micro-batch carried (None where the worker does not say); ``start`` in Unix
    seconds, ``dur_s`` in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    cat: SpanCat
    job_id: Name
    node: Name
    service: Name
    lane: str = Field(max_length=MAX_LANE_CHARS)
    round: int | None = Field(default=None, ge=0, le=MAX_INDEX)
    micro_batch: int | None = Field(default=None, ge=0, le=MAX_INDEX)
    samples: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)
    start: float = Field(ge=0, allow_inf_nan=False)
    dur_s: float = Field(ge=0, le=MAX_SPAN_S, allow_inf_nan=False)


@schema("edgeswarm.spans", 1)
class SpanBatch(Message):
    """Spans of one job recorded by ``service`` on ``node``, published on that node's own spans topic. Every span
    names the batch's node, service and job (a collector drops one that names another). ``dropped`` counts the
    spans the recorder dropped (its buffer was full) since its previous batch."""

    MAX_SPANS: ClassVar[int] = 1000
    MAX_BYTES = MIB

    node: Name
    service: Name
    job_id: Name
    spans: list[SpanRecord] = Field(max_length=1000)
    dropped: int = Field(default=0, ge=0)



@schema("edgeswarm.trace.request", 1)
class TraceRequest(Message):
    """Request to the dashboard: the spans it holds of job ``job_id``; answered with TraceReply."""

    job_id: Name


@schema("edgeswarm.trace.reply", 1)
class TraceReply(Message):
    """The spans held of ``job_id`` (the latest ``MAX_SPANS`` at most, oldest first); ``found`` False when none are
    held, ``jobs`` then naming the jobs that are (at most ``MAX_JOBS``). ``dropped`` counts spans of the job lost on
    the way (recorders' full buffers, the collector's per-job cap)."""

    MAX_SPANS: ClassVar[int] = 10_000
    MAX_JOBS: ClassVar[int] = 64
    MAX_BYTES = 4 * MIB

    job_id: Name
    found: bool
    spans: list[SpanRecord] = Field(default_factory=list, max_length=10_000)
    dropped: int = Field(default=0, ge=0)
    jobs: list[Name] = Field(default_factory=list, max_length=64)


"""Recording spans on a worker, cheaply, for its service to publish.

A ``SpanRecorder`` keeps what its programs did as plain tuples in a bounded ring (the oldest dropped, and counted,
when it is full); making the ``SpanRecord`` messages waits for ``drain``/``batches``, on the thread that publishes.
Durations come from ``time.perf_counter`` (monotonic, fine-grained); a span's start is placed on the wall clock
through one anchor taken when the recorder is made, so spans of one process never reorder when the wall clock is
stepped, and spans of different devices line up as well as their clocks agree.

Use ``recorder.lane(job_id, "stage 1")`` for a job's lane and ``with lane.span("forward", "compute", round=r,
micro_batch=mb): ...``; for a span whose ends are measured elsewhere, ``lane.add(name, cat, t0, t1, ...)`` with
``perf_counter`` readings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from types import TracebackType
from typing import NamedTuple

from pydantic import ValidationError

from edgeswarm.messages.tracing import (
    MAX_LANE_CHARS,
    MAX_NAME_CHARS,
    MAX_SAMPLES,
    MAX_SPAN_S,
    SpanBatch,
    SpanCat,
    SpanRecord,
)

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 20_000


class RawSpan(NamedTuple):
    """A span as recorded: ``t0`` and ``t1`` are ``perf_counter`` readings (seconds)."""

    job_id: str
    lane: str
    name: str
    cat: SpanCat
    round: int | None
    micro_batch: int | None
    t0: float
    t1: float
    samples: int | None = None


class SpanRecorder:
    """A thread-safe bounded buffer of spans recorded by ``service`` on ``node`` (see the module's docstring).
    ``capacity`` is the most spans held between two drains; past it the oldest go, counted in ``spans_dropped``."""

    def __init__(self, node: str = "", service: str = "", capacity: int = DEFAULT_CAPACITY) -> None:
        self.node = node
        self.service = service
        self.capacity = max(1, capacity)
        self._spans: deque[RawSpan] = deque(maxlen=self.capacity)
        self._lock = threading.Lock()
        self._dropped_by_job: dict[str, int] = {}
        self.spans_dropped = 0  # since the recorder was made
        # One anchor: perf_counter -> Unix seconds.
        self._epoch0 = time.time()
        self._pc0 = time.perf_counter()

    def lane(self, job_id: str, lane: str) -> Lane:
        """A handle that records spans of job ``job_id`` on ``lane``."""
        return Lane(self, job_id, lane)

    def add(self, span: RawSpan) -> None:
        """Keep ``span``; when the buffer is full the oldest span is dropped and counted."""
        with self._lock:
            if len(self._spans) == self.capacity:
                oldest = self._spans[0].job_id
                self._dropped_by_job[oldest] = self._dropped_by_job.get(oldest, 0) + 1
                self.spans_dropped += 1
            self._spans.append(span)

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)

    def wall_time(self, perf_s: float) -> float:
        """The Unix time of the ``perf_counter`` reading ``perf_s``."""
        return self._epoch0 + (perf_s - self._pc0)

    def drain(self) -> tuple[list[RawSpan], dict[str, int]]:
        """Take every span held (oldest first) and the spans dropped per job since the last drain."""
        with self._lock:
            spans = list(self._spans)
            self._spans.clear()
            dropped, self._dropped_by_job = self._dropped_by_job, {}
        return spans, dropped

    def record(self, span: RawSpan) -> SpanRecord | None:
        """``span`` as a SpanRecord of this recorder's node and service (strings cut to their caps), or None when it
        is not one (a job id that is no name: it never came from a validated message)."""
        try:
            return SpanRecord(name=span.name[:MAX_NAME_CHARS] or "?", cat=span.cat, job_id=span.job_id, node=self.node,
                              service=self.service, lane=span.lane[:MAX_LANE_CHARS], round=span.round,
                              micro_batch=span.micro_batch,
                              samples=span.samples if span.samples and span.samples <= MAX_SAMPLES else None,
                              start=max(0.0, self.wall_time(span.t0)),
                              dur_s=min(max(0.0, span.t1 - span.t0), MAX_SPAN_S))
        except ValidationError as exc:
            log.debug("dropped a span that is no SpanRecord: %s", exc)
            return None

    def batches(self) -> list[SpanBatch]:
        """Every span held, taken out, as SpanBatches: one per job (several when a job has more than a batch
        holds), in the order the jobs first appear. A job whose spans were all dropped gets an empty batch that
        says how many."""
        spans, dropped = self.drain()
        by_job: dict[str, list[SpanRecord]] = {}
        for raw in spans:
            rec = self.record(raw)
            if rec is None:
                dropped[raw.job_id] = dropped.get(raw.job_id, 0) + 1
                continue
            by_job.setdefault(rec.job_id, []).append(rec)
        out: list[SpanBatch] = []
        cap = SpanBatch.MAX_SPANS
        for job_id in [*by_job, *(j for j in dropped if j not in by_job)]:
            records = by_job.get(job_id, [])
            lost = dropped.get(job_id, 0)
            try:
                for i in range(0, max(len(records), 1), cap):
                    out.append(SpanBatch(node=self.node, service=self.service, job_id=job_id,
                                         spans=records[i:i + cap], dropped=lost if i == 0 else 0))
            except ValidationError:
                continue  # a job id that is no name (its spans already failed above)
        return out


class Lane:
    """Records spans of one job on one lane of a ``SpanRecorder``."""

    __slots__ = ("recorder", "job_id", "lane")

    def __init__(self, recorder: SpanRecorder, job_id: str, lane: str) -> None:
        self.recorder = recorder
        self.job_id = job_id
        self.lane = lane

    def span(self, name: str, cat: SpanCat, round: int | None = None, micro_batch: int | None = None) -> Span:
        """A context manager that records the time its block takes as span ``name``."""
        return Span(self, name, cat, round, micro_batch)

    def add(self, name: str, cat: SpanCat, t0: float, t1: float, round: int | None = None,
            micro_batch: int | None = None, samples: int | None = None) -> None:
        """Record span ``name`` from ``perf_counter`` reading ``t0`` to ``t1``, of an item or micro-batch of
        ``samples`` samples when given."""
        self.recorder.add(RawSpan(self.job_id, self.lane, name, cat, round, micro_batch, t0, t1, samples))

    def on(self, lane: str) -> Lane:
        """The same job's spans on another lane (a link beside a stage)."""
        return Lane(self.recorder, self.job_id, lane)


class Span:
    """One span being timed (``Lane.span``): recorded when its block ends, whether or not it raised."""

    __slots__ = ("_lane", "_name", "_cat", "_round", "_mb", "_t0")

    def __init__(self, lane: Lane, name: str, cat: SpanCat, round: int | None, micro_batch: int | None) -> None:
        self._lane, self._name, self._cat, self._round, self._mb = lane, name, cat, round, micro_batch
        self._t0 = 0.0

    def __enter__(self) -> Span:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        lane = self._lane
        lane.recorder.add(RawSpan(lane.job_id, lane.lane, self._name, self._cat, self._round, self._mb, self._t0,
                                  time.perf_counter()))

"""The hub's collector of measured spans: every worker's span batches in, per job, bounded; traces out.

It subscribes to every node's spans topic and keeps the latest ``MAX_SPANS_PER_JOB`` spans of each of the
``MAX_JOBS`` jobs that sent spans last (the least recently active job goes first). A batch is taken only from the
node and service whose topic it came on (the bus checks the node, this the service too). It answers a
``TraceRequest`` with the job's spans (``TraceReply``), writes a job's spans as Chrome trace format, and gives the
latest round of a job whose spans are all in, measured beside planned (``round_schedule``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.tracing import SpanBatch, SpanRecord, TraceReply, TraceRequest
from edgeswarm.metrics import Metrics
from edgeswarm.tracing.chrome import chrome_trace_bytes
from edgeswarm.tracing.client import submission_spans
from edgeswarm.tracing.schedule import complete_rounds, measured_bars, schedule_view
from edgeswarm.values.schedule import ScheduleView

log = logging.getLogger(__name__)

MAX_JOBS = 8  # with MAX_SPANS_PER_JOB, at most about 90 MB of spans (a SpanRecord takes about 1.1 KB)
MAX_SPANS_PER_JOB = TraceReply.MAX_SPANS


@dataclass
class _JobSpans:
    spans: deque[SpanRecord] = field(default_factory=lambda: deque(maxlen=MAX_SPANS_PER_JOB))
    dropped: int = 0
    batches: int = 0  # batches taken: a reader that drew the job at one count redraws it when the count moves


class TraceCollector:
    """Keeps the spans every worker publishes, per job, bounded; answers trace requests on ``request_topic``."""

    def __init__(self, bus: Bus, metrics: Metrics, *, max_jobs: int = MAX_JOBS,
                 max_spans_per_job: int = MAX_SPANS_PER_JOB) -> None:
        self.bus = bus
        self.metrics = metrics
        self.max_jobs = max(1, max_jobs)
        self.max_spans_per_job = max(1, min(max_spans_per_job, TraceReply.MAX_SPANS))
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, _JobSpans] = OrderedDict()
        self._limited = RateLimitedLog(log)

    def start(self, request_topic: str) -> None:
        """Subscribe to every node's span batches and answer trace requests sent to ``request_topic``."""
        self.bus.subscribe(topics.ALL_SPANS, self._on_spans, schemas=(SpanBatch,))
        self.bus.subscribe(request_topic, self._on_request, schemas=(TraceRequest,))

    # --- in -------------------------------------------------------------------------------------------

    def _on_spans(self, msg: Inbound) -> None:
        batch = msg.body
        if not isinstance(batch, SpanBatch):
            return
        parts = msg.topic.split("/")
        # edgeswarm/node/{node}/{service}/spans: the batch speaks for that node and service only.
        if len(parts) != 5 or parts[2] != batch.node or parts[3] != batch.service \
                or msg.envelope.sender_node != batch.node:
            self.metrics.count("spans_rejected.sender")
            self._limited.warning("sender", "dropped a span batch of %s/%s on %s from %s", batch.node,
                                  batch.service, msg.topic[:256], msg.envelope.sender_node)
            return
        self.add(batch)

    def add(self, batch: SpanBatch) -> None:
        """Keep ``batch``'s spans: those of the batch's own node, service and job (any other is dropped and counted:
        a node speaks only for itself)."""
        spans = [s for s in batch.spans
                 if s.node == batch.node and s.service == batch.service and s.job_id == batch.job_id]
        if len(spans) != len(batch.spans):
            self.metrics.count("spans_rejected.foreign", len(batch.spans) - len(spans))
            self._limited.warning("foreign", "dropped %d spans of other nodes, services or jobs in a span batch of "
                                  "%s/%s job %s", len(batch.spans) - len(spans), batch.node, batch.service,
                                  batch.job_id)
        with self._lock:
            job = self._jobs.get(batch.job_id)
            if job is None:
                job = self._jobs[batch.job_id] = _JobSpans(spans=deque(maxlen=self.max_spans_per_job))
                while len(self._jobs) > self.max_jobs:
                    gone, _ = self._jobs.popitem(last=False)
                    self.metrics.count("trace_jobs_dropped")
                    log.debug("dropped the spans of job %s: %d jobs are kept", gone, self.max_jobs)
            else:
                self._jobs.move_to_end(batch.job_id)
            overflow = max(0, len(job.spans) + len(spans) - self.max_spans_per_job)
            job.dropped += batch.dropped + overflow
            job.spans.extend(spans)
            job.batches += 1
        self.metrics.count("spans_received", len(spans))

    # --- out ------------------------------------------------------------------------------------------

    def _on_request(self, msg: Inbound) -> None:
        body = msg.body
        if not isinstance(body, TraceRequest):
            return
        self.metrics.count("trace_requests")
        try:
            self.bus.reply(msg, self.reply(body.job_id))
        except Exception as exc:  # noqa: BLE001 - the requester times out; this handler must not raise
            self.metrics.count("trace_reply_errors")
            self._limited.warning("reply", "could not answer a trace request for %s from %s: %s", body.job_id,
                                  msg.sender, exc)

    def reply(self, job_id: str) -> TraceReply:
        """The TraceReply for ``job_id``: its spans, or ``found`` False and the jobs held."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return TraceReply(job_id=job_id, found=False, jobs=list(self._jobs)[-TraceReply.MAX_JOBS:])
            return TraceReply(job_id=job_id, found=True, spans=list(job.spans), dropped=job.dropped)

    def jobs(self) -> list[str]:
        """The jobs it holds spans of, least recently active first."""
        with self._lock:
            return list(self._jobs)

    def arrivals(self) -> dict[str, int]:
        """How many span batches each held job has taken so far: what changed since a reader last looked."""
        with self._lock:
            return {job_id: job.batches for job_id, job in self._jobs.items()}

    def spans(self, job_id: str) -> list[SpanRecord]:
        """The spans held of ``job_id``, in arrival order. Raises KeyError for a job it holds none of."""
        with self._lock:
            return list(self._jobs[job_id].spans)

    def chrome_trace_json(self, job_id: str) -> bytes:
        """Job ``job_id``'s spans as Chrome trace format (JSON bytes). Raises KeyError for a job it holds none of."""
        return chrome_trace_bytes(self.spans(job_id), job_id=job_id)

    def round_schedule(self, state: JobState) -> ScheduleView | None:
        """The latest round of job ``state`` whose spans are all in, planned beside measured; None when none is."""
        try:
            spans = submission_spans(self.spans(state.job_id), state.submitted_at)
        except KeyError:
            return None
        from edgeswarm.workloads import installed_workload  # the kinds sit above the tracing

        work = installed_workload(state.kind)
        nodes: list[str] = []
        planned = []
        if work is not None:
            try:
                if state.plan is not None:
                    nodes = [n for group in work.stage_devices(state.plan) for n in group]
                planned = work.planned_schedule(state)
            except Exception as exc:  # noqa: BLE001 - a kind's hook failing must not take the page down
                self._limited.warning("planned", "job %s: no planned schedule: %s", state.job_id, exc)
        rounds = complete_rounds(spans, nodes)
        if not rounds:
            return None
        latest = rounds[-1]
        return schedule_view(state.job_id, latest, measured_bars(spans, latest), planned)

"""The coordinator's jobs, of every kind: accept or refuse submissions, run them, publish their state.

What is common to every job lives here: the queue, cancelling, taking jobs over after a restart, the retained
state on ``edgeswarm/job/{job}/state`` and the events on ``edgeswarm/job/{job}/events``. What a job does is its
workload's (``edgeswarm.workloads``: the spec's ``kind`` picks it). Exclusive workloads (training: every device's
stage-worker takes part) run one at a time in submission order on the job thread, a queued one waiting with
status ``queued``; the others (serving) start on a thread of their own at once. A failure of any step fails the
job with its reason; it never takes the coordinator down. A spec that cannot run (invalid, unknown kind or model,
a model that fits nowhere) is refused at submission with every problem listed.

The retained states are also how a coordinator survives its own restart: a starting coordinator reads them
first, and takes every unfinished job over (its workload sees the earlier state). A coordinator that stops leaves
its jobs unfinished for the next one rather than cancelling them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import EdgeswarmError, JobCancelled
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.cluster import NodeView
from edgeswarm.messages.jobs import (
    FINISHED,
    JobAccepted,
    JobCancel,
    JobEvent,
    JobEventKind,
    JobRejected,
    JobState,
    JobSubmit,
)
from edgeswarm.workloads import KINDS, installed_workload, parse_spec_text, typed_state, workload
from edgeswarm.workloads.base import JobContext

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

STOP = None  # put on the queue to end the job thread
RETAINED_SETTLE_S = 1.0  # how long a starting coordinator collects the retained job states before taking jobs over
TOP_LEVEL = frozenset({"plan", "detail"})  # fields of update() that are the state's own; the others are progress


def _data_schemas() -> tuple[Any, ...]:
    return tuple(s for kind in KINDS if (work := installed_workload(kind)) is not None for s in work.data_schemas)


class JobManager:
    """Owns the jobs of one coordinator: its request handlers, the job threads and the published state.
    ``members(service)`` gives the nodes where ``service`` is online (a kind's worker service, for the checks at
    submission)."""

    def __init__(self, bus: Bus, node: str, *, store_node: str | None = "hub", timeout_s: float = 600.0,
                 members: Callable[[str], list[NodeView]] | None = None) -> None:
        self.bus = bus
        self.node = node
        self.store_node = store_node
        self.timeout_s = timeout_s
        self._members = members or (lambda service: [])
        self._lock = threading.Lock()
        self._states: dict[str, JobState] = {}
        self._specs: dict[str, Any] = {}
        self._cancels: dict[str, threading.Event] = {}
        self._contexts: dict[str, JobContext] = {}  # running jobs
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._stopping = threading.Event()
        self._taking_over = True  # while the retained states of an earlier coordinator's jobs come in
        self._retained: set[str] = set()  # the jobs those states are of
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._work, name="jobs", daemon=True)
        bus.subscribe(topics.ALL_JOB_STATES, self._on_retained_state, schemas=(JobState,))
        request = topics.request(node, "coordinator")
        bus.subscribe(request, self._on_submit, schemas=(JobSubmit,))
        bus.subscribe(request, self._on_cancel, schemas=(JobCancel,))
        schemas = _data_schemas()
        if schemas:
            bus.subscribe(topics.data(node, "coordinator"), self._on_data, schemas=schemas, plane="data")
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the job threads within ``timeout_s`` seconds in all: the jobs in flight stop at once (a training round
        aborted on every device) but stay unfinished in their retained state, for the next coordinator to take
        over."""
        self._stopping.set()
        with self._lock:
            for event in self._cancels.values():
                event.set()
        self._queue.put(STOP)
        deadline = time.monotonic() + timeout_s  # in all: a SIGTERM's grace has room for one wait, not one a job
        for thread in [self._thread, *self._threads]:
            thread.join(max(0.0, deadline - time.monotonic()))

    # --- requests ----------------------------------------------------------------------------------

    def _on_submit(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, JobSubmit)
        if self._answer_again(msg, body):
            return
        try:
            spec = parse_spec_text(body.spec, source="the submitted job spec")
            work = workload(spec.kind)  # type: ignore[attr-defined]
            problems = work.problems(spec, self._members(work.worker_service))
            model = work.model_name(spec)
        except EdgeswarmError as exc:
            self.bus.reply(msg, JobRejected(reason="invalid", detail=str(exc)[:4096]))
            return
        if problems:
            self.bus.reply(msg, JobRejected(reason="invalid", detail=(
                "the submitted job spec cannot run:\n" + "\n".join(f"  {p}" for p in problems))[:4096]))
            return
        name, kind = spec.name, work.kind  # type: ignore[attr-defined]  # an alias is stored as the kind it names
        with self._lock:
            expires_at = msg.envelope.expires_at
            if expires_at is not None and time.time() > expires_at:
                # Its submitter stopped waiting and asked the job's state instead: taking it now would run a job
                # the submitter was told was not accepted. (Its retry, with the same submission, is taken.)
                _limited.warning("expired_submit", "not taking job %s from %s/%s: its submission expired %.1f s "
                                 "ago while it waited here", name[:64], msg.envelope.sender_node,
                                 msg.envelope.sender_service, time.time() - expires_at)
                return
            current = self._states.get(name)
            if current is not None and current.status not in FINISHED:
                self.bus.reply(msg, JobRejected(reason="duplicate", detail=(
                    f"job {name} is {current.status}; cancel it (edgeswarm cancel {name}) or pick another name")))
                return
            now = time.time()
            self._states[name] = JobState(job_id=name, submission=body.submission, spec=body.spec, kind=kind,
                                          status="queued", model=model, progress=work.initial_progress(spec),
                                          submitted_at=now, updated_at=now)
            self._specs[name] = spec
            self._cancels[name] = threading.Event()
            queued = sum(1 for s in self._states.values() if s.status == "queued"
                         and workload(s.kind).exclusive) - 1 if work.exclusive else 0
        self._publish(name, ("submitted", work.describe(spec)))
        self.bus.reply(msg, JobAccepted(job_id=name, detail=f"queued behind {queued} job(s)" if queued > 0 else
                                        "starting"))
        self._start(name)

    def _answer_again(self, msg: Inbound, body: JobSubmit) -> bool:
        """Answer a submission this coordinator already took (its submitter missed the reply and asked again: the
        submission id is the key) as it was answered, without running the job twice. False for a new one."""
        if not body.submission:
            return False
        with self._lock:
            taken = next((s for s in self._states.values() if s.submission == body.submission), None)
        if taken is None:
            return False
        self.bus.reply(msg, JobAccepted(job_id=taken.job_id, detail=f"already accepted ({taken.status})"))
        return True

    def _on_cancel(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, JobCancel)
        with self._lock:
            state = self._states.get(body.job_id)
            cancel = self._cancels.get(body.job_id)
        if state is None or cancel is None:
            self.bus.reply(msg, JobRejected(reason="unknown_job", detail=f"this coordinator has no job {body.job_id}"))
            return
        if state.status in FINISHED:
            self.bus.reply(msg, JobRejected(reason="finished", detail=f"job {body.job_id} already {state.status}"))
            return
        cancel.set()
        if state.status == "queued":
            self.update(body.job_id, "cancelled", event=("cancelled", "cancelled before it started"))
        self.bus.reply(msg, JobAccepted(job_id=body.job_id, detail="cancelling"))

    def _on_data(self, msg: Inbound) -> None:
        job_id = getattr(msg.body, "job_id", "")
        with self._lock:
            ctx = self._contexts.get(job_id)
            state = self._states.get(job_id)
        if ctx is not None and ctx.data_handler is not None:
            ctx.data_handler(msg)
            return
        for kind in KINDS:
            work = installed_workload(kind)
            if work is not None and isinstance(msg.body, work.data_schemas):
                work.refuse_data(self.bus, msg, state)
                return

    def _on_retained_state(self, msg: Inbound) -> None:
        # Only what the broker kept from before this coordinator started; its own states come back live.
        state = msg.body
        assert isinstance(state, JobState)
        if not msg.retained or not self._taking_over:
            return
        env = msg.envelope
        if (env.sender_node, env.sender_service) != (self.node, "coordinator") or \
                topics.job_of(msg.topic) != state.job_id:
            # Only this node's coordinator (its predecessor) writes the states it takes over; the broker's ACL
            # lets no one else write job states, and this check holds where no ACL does.
            _limited.warning("foreign_state", "not taking over the retained state on %s: it was written by %s/%s, "
                             "not by a coordinator on %s", msg.topic[:256], env.sender_node, env.sender_service,
                             self.node)
            return
        state = typed_state(state)
        with self._lock:
            if state.job_id not in self._states:
                self._states[state.job_id] = state
                self._cancels[state.job_id] = threading.Event()
                self._retained.add(state.job_id)

    # --- running -----------------------------------------------------------------------------------

    def _start(self, name: str, previous: JobState | None = None) -> None:
        """Run an exclusive job on the job thread: a new one after those queued, one taken over (``previous``) at
        once (the job thread calls this then, before it takes the queue); any other job on a thread of its own."""
        if not workload(self._states[name].kind).exclusive:
            thread = threading.Thread(target=self._run, args=(name, previous), name=f"job-{name}", daemon=True)
            self._threads.append(thread)
            thread.start()
        elif previous is None:
            self._queue.put(name)
        else:
            self._run(name, previous)

    def _work(self) -> None:
        self._stopping.wait(RETAINED_SETTLE_S)
        with self._lock:
            self._taking_over = False
            # (A job submitted meanwhile is queued; a retained unfinished one refused its name.)
            earlier = sorted((self._states[j] for j in self._retained if self._states[j].status not in FINISHED
                              and self._states[j].spec and not self._cancels[j].is_set()),
                             key=lambda s: s.submitted_at)
        for state in earlier:
            if self._stopping.is_set():
                return
            try:
                spec = parse_spec_text(state.spec, source=f"the retained spec of job {state.job_id}")
            except EdgeswarmError as exc:
                self.update(state.job_id, "failed", detail=str(exc)[:4096], event=("failed", str(exc)[:4096]))
                continue
            log.info("job %s: taking it over from an earlier coordinator", state.job_id)
            with self._lock:
                self._specs[state.job_id] = spec
            self._start(state.job_id, previous=state)
        while (name := self._queue.get()) is not STOP:
            assert name is not None
            self._run(name)

    def _run(self, name: str, previous: JobState | None = None) -> None:
        with self._lock:
            cancel, spec, state = self._cancels[name], self._specs[name], self._states[name]
        if cancel.is_set():
            return
        work = workload(state.kind)
        ctx = JobContext(bus=self.bus, node=self.node, store_node=self.store_node, timeout_s=self.timeout_s,
                         cancel=cancel, stopping=self._stopping, previous=previous,
                         update=lambda status, **fields: self.update(name, status, **fields),
                         state=lambda: self.state(name))
        with self._lock:
            self._contexts[name] = ctx
        log.info("job %s: starting (%s, %s)", name, state.kind, state.model)
        try:
            final = work.run(ctx, spec)
        except JobCancelled:
            if self._stopping.is_set():
                log.info("job %s: left unfinished for the next coordinator", name)
                return
            self.update(name, "cancelled", event=("cancelled", "cancelled by request"))
        except Exception as exc:  # noqa: BLE001 - one job's failure must not end the coordinator's job thread
            detail = str(exc) or type(exc).__name__
            log.error("job %s failed: %s", name, detail)
            self.update(name, "failed", detail=detail[:4096], event=("failed", detail[:4096]))
        else:
            self.update(name, "succeeded", event=final or ("succeeded", ""))
        finally:
            with self._lock:
                self._contexts.pop(name, None)

    # --- state -------------------------------------------------------------------------------------

    def update(self, job_id: str, status: str, *, event: tuple[JobEventKind, str] | None = None,
               **fields: object) -> JobState:
        """Set the job's status and ``fields`` (``plan`` and ``detail`` are the state's own; every other field is
        its progress part's), publish the state (retained) and ``event`` (kind, detail)."""
        own = {k: v for k, v in fields.items() if k in TOP_LEVEL}
        progress = {k: v for k, v in fields.items() if k not in TOP_LEVEL}
        with self._lock:
            current = self._states[job_id]
            if progress:
                own["progress"] = current.progress.model_copy(update=progress)
            state = current.model_copy(update={"status": status, "updated_at": time.time(), **own})
            self._states[job_id] = typed_state(JobState.model_validate(state.model_dump()))
        self._publish(job_id, event)
        return self._states[job_id]

    def state(self, job_id: str) -> JobState:
        """The job's current state."""
        with self._lock:
            return self._states[job_id]

    def _publish(self, job_id: str, event: tuple[JobEventKind, str] | None) -> None:
        state = self._states[job_id]
        self.bus.publish(topics.job_state(job_id), state, retain=True)
        if event is not None:
            kind, detail = event
            work = installed_workload(state.kind)
            self.bus.publish(topics.job_events(job_id), JobEvent(
                job_id=job_id, submission=state.submission, kind=kind, detail=detail,
                round=work.summary(state).round if work is not None else 0))

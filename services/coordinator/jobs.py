"""The coordinator's training jobs: accept or refuse submissions, run them one at a time, publish their state.

Stage-workers hold one stage of one job, so jobs run in submission order on one thread; a queued job waits
(status ``queued``). Each job's state is retained on ``edgeswarm/job/{job}/state`` and every step is an event on
``edgeswarm/job/{job}/events``. A failure of any step fails the job with its reason; it never takes the
coordinator down.

The retained states are also how a coordinator survives its own restart: a starting coordinator reads them
first, and takes every unfinished job over where its predecessor left it (the spec, the plan and the rounds
done are in the state; the stage-workers still hold their stages and snapshots). A coordinator that stops
leaves its jobs unfinished for the next one rather than cancelling them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.errors import EdgeswarmError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.jobs import (
    FINISHED,
    JobAccepted,
    JobCancel,
    JobEvent,
    JobEventKind,
    JobRejected,
    JobState,
    JobSubmit,
    StrategyPrediction,
)
from edgeswarm.messages.training import StageSaved
from edgeswarm.planning.compare import Comparison
from edgeswarm.planning.types import Plan
from edgeswarm.training.detection import Detection
from edgeswarm.training.driver import JobCancelled, RoundReport
from edgeswarm.training.jobs import JobSpec, parse_job_text
from edgeswarm.training.lifecycle import JobObserver, Resume, run_job
from edgeswarm.training.recovery import RecoveryReport

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

STOP = None  # put on the queue to end the job thread
RETAINED_SETTLE_S = 1.0  # how long a starting coordinator collects the retained job states before taking jobs over
NOT_STARTED = frozenset({"queued", "profiling", "planning", "deploying"})  # nothing trained yet: start again


def predictions(comparison: Comparison | None, global_batch: int) -> list[StrategyPrediction]:
    """Every strategy's predicted seconds per round and samples per second from the planner's comparison."""
    if comparison is None:
        return []
    out = [StrategyPrediction(strategy="hpp", round_s=comparison.hpp.round_latency_s,
                              samples_per_s=global_batch / comparison.hpp.round_latency_s)]
    for b in comparison.baselines:
        out.append(StrategyPrediction(strategy=b.strategy, error=b.error) if b.plan is None else StrategyPrediction(
            strategy=b.strategy, round_s=b.plan.round_latency_s, samples_per_s=global_batch / b.plan.round_latency_s))
    return out


class _Publisher(JobObserver):
    """Turns what ``run_job`` reports into the job's retained state and its events."""

    def __init__(self, jobs: JobManager, spec: JobSpec) -> None:
        self.jobs = jobs
        self.spec = spec

    def profiling(self, nodes: list[str]) -> None:
        self.jobs.update(self.spec.name, "profiling", event=("profiling", f"profiling {self.spec.model.name} on "
                                                                         f"{', '.join(nodes)}"))

    def planned(self, plan: Plan, comparison: Comparison | None, total_rounds: int) -> None:
        self.jobs.update(self.spec.name, "deploying", plan=plan, total_rounds=total_rounds,
                         predicted_round_s=plan.round_latency_s,
                         predictions=predictions(comparison, self.spec.global_batch),
                         event=("planned", f"{plan.strategy}: {len(plan.stages)} stages on {len(plan.devices)} "
                                           f"devices, {plan.round_latency_s:.3f} s per round predicted"))

    def deployed(self) -> None:
        self.jobs.update(self.spec.name, "running", event=("deployed", "every stage-worker holds its stage"))

    def round_done(self, report: RoundReport) -> None:
        self.jobs.update(self.spec.name, "running", round=report.round + 1, loss=report.loss,
                         accuracy=report.accuracy, round_s=report.round_s,
                         samples_per_s=self.spec.global_batch / report.round_s,
                         event=("round", f"loss {report.loss:.4f}, accuracy {report.accuracy:.1%}, "
                                         f"{report.round_s:.3f} s"))

    def device_lost(self, failures: dict[str, Detection], round_index: int) -> None:
        lost = "; ".join(f"{d.detail} ({d.how.replace('_', ' ')}, {d.detection_s:.2f} s after it was last heard)"
                         for d in failures.values())
        self.jobs.update(self.spec.name, "recovering", event=("device_lost", f"during round {round_index}: {lost}"))

    def recovered(self, report: RecoveryReport) -> None:
        self._replanned(report, "recovered", f"{report.mode} recovery without {', '.join(report.failed)}"
                        if report.failed else "replayed from the devices' snapshots after an interruption")

    def joined(self, report: RecoveryReport) -> None:
        self._replanned(report, "joined", f"{', '.join(report.joined)} joined")

    def _replanned(self, report: RecoveryReport, kind: JobEventKind, what: str) -> None:
        plan = report.plan
        stages = " | ".join(",".join(s.devices) for s in plan.stages)
        done = self.jobs.state(self.spec.name).reconfigurations
        self.jobs.update(self.spec.name, "running", plan=plan, predicted_round_s=plan.round_latency_s,
                         round=report.resume_round, reconfigurations=done + 1,
                         event=(kind, f"{what}: plan epoch {plan.epoch}, stages {stages}, "
                                      f"{plan.round_latency_s:.3f} s per round predicted; resumed at round "
                                      f"{report.resume_round} after {report.recovery_s:.2f} s, "
                                      f"{report.moved_bytes} bytes of state moved"))

    def evaluated(self, test_accuracy: float) -> None:
        self.jobs.update(self.spec.name, "running", test_accuracy=test_accuracy,
                         event=("evaluated", f"held-out accuracy of the saved model {test_accuracy:.1%}"))

    def saved(self, version: int, saved: list[StageSaved]) -> None:
        self.jobs.update(self.spec.name, "running", checkpoint_version=version,
                         event=("checkpoint", f"version {version}: {sum(s.nbytes for s in saved)} bytes in "
                                              f"{len(saved)} stages"))


class JobManager:
    """Owns the jobs of one coordinator: its request handlers, the job thread and the published state."""

    def __init__(self, bus: Bus, node: str, *, store_node: str | None = "hub", timeout_s: float = 600.0) -> None:
        self.bus = bus
        self.node = node
        self.store_node = store_node
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._states: dict[str, JobState] = {}
        self._cancels: dict[str, threading.Event] = {}
        self._queue: queue.Queue[JobSpec | None] = queue.Queue()
        self._stopping = threading.Event()
        self._taking_over = True  # while the retained states of an earlier coordinator's jobs come in
        self._retained: set[str] = set()  # the jobs those states are of
        self._thread = threading.Thread(target=self._work, name="jobs", daemon=True)
        bus.subscribe(topics.ALL_JOB_STATES, self._on_retained_state, schemas=(JobState,))
        request = topics.request(node, "coordinator")
        bus.subscribe(request, self._on_submit, schemas=(JobSubmit,))
        bus.subscribe(request, self._on_cancel, schemas=(JobCancel,))
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the job thread: the job in flight stops at once (its round aborted on every device) but stays
        unfinished in its retained state, for the next coordinator to take over."""
        self._stopping.set()
        with self._lock:
            for event in self._cancels.values():
                event.set()
        self._queue.put(STOP)
        self._thread.join(timeout_s)

    # --- requests ----------------------------------------------------------------------------------

    def _on_submit(self, msg: Inbound) -> None:
        body = msg.body
        assert isinstance(body, JobSubmit)
        try:
            spec = parse_job_text(body.spec, source="the submitted job spec")
        except EdgeswarmError as exc:
            self.bus.reply(msg, JobRejected(reason="invalid", detail=str(exc)[:4096]))
            return
        with self._lock:
            current = self._states.get(spec.name)
            if current is not None and current.status not in FINISHED:
                self.bus.reply(msg, JobRejected(reason="duplicate", detail=(
                    f"job {spec.name} is {current.status}; cancel it (edgeswarm cancel {spec.name}) or pick "
                    "another name")))
                return
            now = time.time()
            self._states[spec.name] = JobState(job_id=spec.name, submission=body.submission, spec=body.spec,
                                               status="queued", model=spec.model.name,
                                               strategy=spec.strategy, submitted_at=now, updated_at=now)
            self._cancels[spec.name] = threading.Event()
            queued = sum(1 for s in self._states.values() if s.status == "queued") - 1
        self._publish(spec.name, ("submitted", f"{spec.model.name}, {spec.strategy}, global batch "
                                               f"{spec.global_batch}"))
        self.bus.reply(msg, JobAccepted(job_id=spec.name, detail=f"queued behind {queued} job(s)" if queued else
                                        "starting"))
        self._queue.put(spec)

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
        with self._lock:
            if state.job_id not in self._states:
                self._states[state.job_id] = state
                self._cancels[state.job_id] = threading.Event()
                self._retained.add(state.job_id)

    # --- the job thread ----------------------------------------------------------------------------

    def _work(self) -> None:
        self._stopping.wait(RETAINED_SETTLE_S)
        with self._lock:
            self._taking_over = False
            # (A job submitted meanwhile is on the queue; a retained unfinished one refused its name.)
            earlier = sorted((self._states[j] for j in self._retained if self._states[j].status not in FINISHED
                              and self._states[j].spec and not self._cancels[j].is_set()),
                             key=lambda s: s.submitted_at)
        for state in earlier:
            if self._stopping.is_set():
                return
            self._take_over(state)
        while (spec := self._queue.get()) is not STOP:
            assert spec is not None
            with self._lock:
                cancel = self._cancels[spec.name]
            if cancel.is_set():
                continue
            self._run(spec, cancel)

    def _take_over(self, state: JobState) -> None:
        """Go on with a job an earlier coordinator left unfinished: from where its devices are, or from the start
        when nothing was trained yet."""
        try:
            spec = parse_job_text(state.spec, source=f"the retained spec of job {state.job_id}")
        except EdgeswarmError as exc:
            self.update(state.job_id, "failed", detail=str(exc)[:4096], event=("failed", str(exc)[:4096]))
            return
        with self._lock:
            cancel = self._cancels[spec.name]
        if state.plan is None or state.status in NOT_STARTED:
            log.info("job %s: taking it over from an earlier coordinator; it starts again", spec.name)
            self.update(spec.name, "queued", event=("resumed", f"a restarted coordinator starts the job again "
                                                               f"(it was {state.status})"))
            self._run(spec, cancel)
            return
        log.info("job %s: taking it over from an earlier coordinator at round %d", spec.name, state.round)
        self.update(spec.name, "recovering", event=("resumed", f"a restarted coordinator takes the job over at "
                                                               f"round {state.round}, plan epoch {state.plan.epoch}"))
        self._run(spec, cancel, Resume(plan=state.plan, rounds_done=state.round,
                                       saved_version=state.checkpoint_version or 0))

    def _run(self, spec: JobSpec, cancel: threading.Event, resume: Resume | None = None) -> None:
        log.info("job %s: starting (%s, %s)", spec.name, spec.model.name, spec.strategy)
        try:
            run_job(self.bus, spec, store_node=self.store_node, observer=_Publisher(self, spec), cancel=cancel,
                    timeout_s=self.timeout_s, resume=resume)
        except JobCancelled:
            if self._stopping.is_set():
                log.info("job %s: left unfinished for the next coordinator", spec.name)
                return
            self.update(spec.name, "cancelled", event=("cancelled", "cancelled by request"))
        except Exception as exc:  # noqa: BLE001 - one job's failure must not end the coordinator's job thread
            detail = str(exc) or type(exc).__name__
            log.error("job %s failed: %s", spec.name, detail)
            self.update(spec.name, "failed", detail=detail[:4096], event=("failed", detail[:4096]))
        else:
            state = self._states[spec.name]
            self.update(spec.name, "succeeded", event=(
                "succeeded", f"{state.round} rounds, final loss {state.loss:.4f}" if state.loss is not None else ""))

    # --- state -------------------------------------------------------------------------------------

    def update(self, job_id: str, status: str, *, event: tuple[JobEventKind, str] | None = None,
               **fields: object) -> JobState:
        """Set the job's status and ``fields``, publish the state (retained) and ``event`` (kind, detail)."""
        with self._lock:
            state = self._states[job_id].model_copy(update={"status": status, "updated_at": time.time(), **fields})
            self._states[job_id] = JobState.model_validate(state.model_dump())
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
            self.bus.publish(topics.job_events(job_id), JobEvent(job_id=job_id, submission=state.submission, kind=kind,
                                                                 round=state.round, detail=detail))

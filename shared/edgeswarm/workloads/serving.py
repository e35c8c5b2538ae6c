"""What every serving kind shares: its workload's summary, charts, run and refusals (``ServingWorkload``), and its
coordinator program's shape (``ServingProgram``), written once for pipelined and tensor-parallel serving alike.

A serving job on the coordinator takes requests on the coordinator's data topic, queues them (``spec.queue`` at
most, one caller node at most half of it: ``edgeswarm.shares``; beyond: ``busy``), and a dispatcher thread of the
kind's own runs them on the deployed plan. It publishes its progress every PUBLISH_EVERY_S; when the failure detector
confirms a device lost (or the kind's ``stalled`` says the plan no longer answers) it re-plans over the devices
left, deploys the new plan as a new epoch, releases the parts of the devices it no longer uses and lets the kind
carry on what it held (``replay``). A job that stops answers every request it still holds with InferError
``not_serving`` and releases its parts.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from edgeswarm import topics
from edgeswarm.bus import Bus, Inbound
from edgeswarm.coordination.program import CoordinatorProgram, Disrupted, PlanT
from edgeswarm.errors import EdgeswarmError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.jobs import JobEventKind, JobState
from edgeswarm.messages.serving import InferError, InferErrorReason
from edgeswarm.observability import record
from edgeswarm.planning.refit import ClosedLoop, Priced, moved_text, speeds
from edgeswarm.plugins import load_target
from edgeswarm.runtime.ledger import unreserved
from edgeswarm.shares import QueueShares
from edgeswarm.values.profiles import ClusterProfile
from edgeswarm.wire import Message
from edgeswarm.workloads.base import JobContext, JobSummary, Workload, figures_line
from edgeswarm.workloads.views import Series, SeriesPoint, finite

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)

PUBLISH_EVERY_S = 1.0  # how often a serving job's state is published while it serves
# How often a job whose fit moved but keeps its plan says so: an operator (or a test) sees what the devices measured
# and how far the best plan on it is from the re-plan margin.
FIT_SAID_EVERY_S = 30.0


def refuse_request(bus: Bus, msg: Inbound, job_id: str, request_id: str, reason: InferErrorReason,
                   detail: str) -> None:
    """Answer the request ``msg`` (``request_id`` of job ``job_id``) with InferError ``reason`` and ``detail``,
    counted as ``infer_refused.{reason}`` and logged (rate-limited: callers can send many). Never raises."""
    bus.metrics.count(f"infer_refused.{reason}")
    _limited.warning(reason, "job %s: refused a request from %s (%s): %s", job_id, msg.sender, reason, detail)
    try:
        bus.reply(msg, InferError(job_id=job_id, request_id=request_id, reason=reason, detail=detail[:1024]))
    except EdgeswarmError as exc:
        log.debug("could not answer a refused request: %s", exc)


@dataclass
class QueuedRequest:
    """A caller's request on the coordinator: ``msg`` (its envelope says where to answer), its id, and when it
    arrived (monotonic seconds)."""

    msg: Inbound
    request_id: str
    arrived: float

    @property
    def caller(self) -> str:
        """The node that sent it: whose share of the queue it takes."""
        return self.msg.envelope.sender_node


R = TypeVar("R", bound=QueuedRequest)


class ServingProgram(CoordinatorProgram[PlanT], Generic[PlanT, R]):
    """One serving job on the coordinator (see the module's docstring): ``run`` returns only by raising. A kind gives
    ``measure`` (its cluster profile), ``plan_request``, ``plan_from``, ``assignments``, ``describe`` (a plan in a
    line), ``plan_fields`` (the progress fields a plan sets), ``on_data`` (its requests and its devices' results,
    admitted with ``admit``), ``dispatch`` (its dispatcher thread: requests through the plan, from ``_queue`` while
    ``_plan`` is set, until ``_stopped``) and ``progress``; and where it needs them ``stalled``, ``interrupt``,
    ``replay`` and ``held``. ``_changed`` guards the queue, the plan and the counters.

    A kind that closes the loop (planning.refit) sets ``refit_loop`` (a ``ClosedLoop``) and feeds it each measured
    unit; with the rebalance setting on (``closed_loop``), the skeleton moves the job to the loop's better plan between
    two requests (``rebalance``), and ``refitted`` is the running plan priced on the fit. It gives ``refit_profile``
    (what its plans are priced on) and ``gain`` (the predicted gain, in words)."""

    #: Told to each device to drop the job's part: ``release(job_id=...)``, no answer expected.
    release: ClassVar[type[Message]]

    def __init__(self, ctx: JobContext, spec: Any, *, worker_service: str, planner_node: str, busy_pause_s: float,
                 queue_bytes: int | None = None) -> None:
        super().__init__(ctx.bus, name=spec.name, worker_service=worker_service, cancel=ctx.cancel,
                         timeout_s=ctx.timeout_s, exclude=spec.planner.exclude, planner_node=planner_node,
                         busy_pause_s=busy_pause_s)
        self.ctx = ctx
        self.spec = spec
        self._queue_bytes = queue_bytes
        self._changed = threading.Condition()
        self._queue: deque[R] = deque()
        self._callers = QueueShares(spec.queue, queue_bytes)  # each caller's share of the queue (and its bytes)
        self._plan: PlanT | None = None  # None while (re)deploying: the dispatcher waits
        self._epoch = 0
        self._accepting = False
        self._stopped = False
        self._errors = 0  # requests refused
        self._reconfigurations = 0
        self._dispatcher: threading.Thread | None = None
        self.closed_loop = ctx.bus.settings.rebalance
        self.refit_loop: ClosedLoop[PlanT, Any] | None = None
        self._fit_said_at = -FIT_SAID_EVERY_S  # monotonic seconds

    # --- what a kind gives ----------------------------------------------------------------------------

    @abstractmethod
    def measure(self, nodes: list[str]) -> ClusterProfile:
        """The job's cluster profile on ``nodes``, measured for its model (publishing its ``profiling`` event)."""

    @abstractmethod
    def describe(self, plan: PlanT) -> str:
        """``plan`` in a line, for the job's events."""

    @abstractmethod
    def plan_fields(self, plan: PlanT) -> dict[str, Any]:
        """The progress fields ``plan`` sets (its predictions)."""

    @abstractmethod
    def on_data(self, msg: Inbound) -> None:
        """A message on the coordinator's data topic for this job (bus threads; never raises)."""

    @abstractmethod
    def dispatch(self) -> None:
        """The dispatcher thread: run queued requests on the plan until ``_stopped``."""

    @abstractmethod
    def progress(self) -> dict[str, Any]:
        """The progress fields of the job's state now."""

    def stalled(self) -> str | None:
        """Why the plan no longer answers though no device is confirmed lost (None: it answers)."""
        return None

    def interrupt(self, reason: str) -> None:
        """The plan's devices change or the job stops (``_changed`` held): give up the work under way."""

    def replay(self, plan: PlanT, epoch: int) -> str:
        """``plan`` (epoch ``epoch``) is deployed after a loss: carry on what the old plan held, saying what in a
        few words for the ``recovered`` event ("" when nothing)."""
        return ""

    def held(self) -> list[R]:
        """The requests the job holds beyond its queue, taken from it as it stops (``_changed`` held)."""
        return []

    # --- the skeleton's hooks -------------------------------------------------------------------------

    def run(self) -> None:
        self.ctx.on_data(self.on_data)
        super().run()

    def profile(self, nodes: list[str]) -> ClusterProfile:
        cluster = self.measure(nodes)
        # Plan on the room beside the jobs the devices already hold (the node's memory ledger, in their status).
        return unreserved(cluster, self.watcher.view()[0]) if self.watcher is not None else cluster

    def request_plan(self, cluster: ClusterProfile, epoch: int) -> PlanT:
        if epoch == 0:
            self.ctx.update("planning")
        return super().request_plan(cluster, epoch)

    def on_planned(self, plan: PlanT) -> None:
        self.ctx.update("deploying", plan=plan, **self.plan_fields(plan), event=("planned", self.describe(plan)))

    def on_ready(self, plan: PlanT) -> None:
        with self._changed:
            self._plan, self._epoch, self._accepting = plan, plan.epoch, True
            self._changed.notify_all()
        self.ctx.update("running", event=("serving", f"serving on {topics.data(self.ctx.node, 'coordinator')}/"
                                                     f"{{sender}}: {self.describe(plan)}"))
        self._dispatcher = threading.Thread(target=self.dispatch, name=f"dispatch-{self.name}", daemon=True)
        self._dispatcher.start()

    def step(self) -> None:
        """Publish the progress every PUBLISH_EVERY_S; a device lost (or a stalled plan) disrupts the job."""
        if self.cancel.wait(PUBLISH_EVERY_S):
            return  # the skeleton's check raises JobCancelled
        self.ctx.update("running", **self.progress())
        assert self.detector is not None
        lost = self.detector.failures()
        stalled = self.stalled()
        if stalled and not lost:
            with self._changed:
                devices = self._plan.devices if self._plan is not None else []
            lost = self.detector.confirm(devices)
        if lost or stalled:
            raise Disrupted("; ".join(d.detail for d in lost.values()) or str(stalled), lost)
        better = self.rebalance()
        if better is not None:
            plan, detail = better
            self.replanned(self._move(plan.model_copy(update={"epoch": self._epoch + 1}), [], "the plan changes",
                                      ("rebalanced", f"re-planned on measured speeds ({detail})")))

    def refit_profile(self, cluster: ClusterProfile) -> Any:
        """The profile the closed loop prices plans on over ``cluster`` (the kind's planner input, before any fit)."""
        return cluster

    def gain(self, current: PlanT, best: PlanT) -> str:
        """What moving from ``current`` to ``best`` (both priced on the refitted profile) gains, in words."""
        return ""

    def _priced(self, best: bool, now: float | None = None) -> Any:
        """``refit_loop.priced`` (``now`` None) or its ``better`` (``now``: monotonic seconds) on the running plan; None
        without a loop, a plan or a price (a pricing failure is logged: the job goes on as planned)."""
        with self._changed:
            plan = self._plan
        if self.refit_loop is None or plan is None or self.cluster is None:
            return None
        try:
            profile = self.refit_profile(self.cluster)
            loop = self.refit_loop
            return loop.priced(plan, profile, best) if now is None else loop.better(plan, profile, now)
        except (EdgeswarmError, KeyError) as exc:
            log.info("job %s: no plan on the refitted profile: %s", self.name, exc)
            return None

    def refitted(self) -> Priced[PlanT, Any] | None:
        """The running plan priced on the devices' measured speeds; None before the loop has any."""
        priced: Priced[PlanT, Any] | None = self._priced(best=False)
        return priced

    def rebalance(self) -> tuple[PlanT, str] | None:
        """Between two steps: a plan to move to on the devices' measured speeds, and why in words (which speeds moved,
        the predicted gain); None: the job keeps its plan (always, without a loop or with the rebalance setting off)."""
        if not self.closed_loop:
            return None
        found: tuple[Priced[PlanT, Any], dict[str, float]] | None = self._priced(True, time.monotonic())
        if found is None:
            self._say_fit()
            return None
        priced, moved = found
        assert priced.best is not None
        return priced.best, f"{moved_text(moved)}; {self.gain(priced.current, priced.best)}"

    def _say_fit(self) -> None:
        """Log, every FIT_SAID_EVERY_S at most, the measured speeds and the best plan's gain on them while the job
        keeps its plan (nothing before the loop has priced a best plan)."""
        loop, now = self.refit_loop, time.monotonic()
        gain = loop.rebalancer.gain if loop is not None else None
        if loop is None or gain is None or now - self._fit_said_at < FIT_SAID_EVERY_S:
            return
        self._fit_said_at = now
        log.info("job %s keeps its plan: measured speeds %s; the best plan on them is %.0f%% faster (a re-plan needs "
                 "over %.0f%% on %d checks in a row)", self.name, speeds(loop.scales()), 100 * gain,
                 100 * loop.rebalancer.margin, loop.rebalancer.confirm)

    def replanned(self, plan: PlanT) -> None:
        super().replanned(plan)
        if self.refit_loop is not None:
            self.refit_loop.new_plan()

    def on_lost(self, disruption: Disrupted) -> PlanT:
        """Re-plan over the devices left, deploy the new plan as a new epoch and ``replay`` onto it."""
        assert self.cluster is not None
        lost = sorted(disruption.failures)
        self.cluster = self.cluster.without(*lost)
        self.ctx.update("recovering", event=("device_lost", f"{', '.join(lost) or 'no device'} lost ({disruption}); "
                                                            "re-planning over the others"))
        return self._move(None, lost, f"{', '.join(lost)} lost", ("recovered", ""))

    def _move(self, plan: PlanT | None, lost: list[str], why: str, event: tuple[JobEventKind, str]) -> PlanT:
        """Stop dispatching, deploy ``plan`` (None: the planner's over ``cluster``) as the next epoch, release the
        devices it leaves out (but the ``lost``), ``replay`` onto it and go on; ``event`` (kind, what happened) is
        published with the new plan."""
        assert self.cluster is not None
        started = time.monotonic()
        with self._changed:
            old, self._plan = self._plan, None  # the dispatcher waits
            epoch = self._epoch + 1
            self.interrupt(why)
        if plan is None:
            plan = self.request_plan(self.cluster, epoch)
        try:
            self.deploy(plan)
        finally:
            self._release([d for d in (old.devices if old else []) if d not in plan.devices and d not in lost])
        carried = self.replay(plan, epoch)
        with self._changed:
            self._plan, self._epoch = plan, epoch
            self._reconfigurations += 1
            self._changed.notify_all()
        kind, what = event
        self.ctx.update("running", plan=plan, **self.plan_fields(plan), **self.progress(),
                        event=(kind, (f"{what}: " if what else "") + f"plan epoch {epoch} after "
                                     f"{time.monotonic() - started:.2f} s: {self.describe(plan)}"
                                     + (f"; {carried}" if carried else "")))
        return plan

    def stop(self) -> None:
        with self._changed:
            self._stopped, self._accepting = True, False
            plan = self._plan
            requests = list(self._queue) + self.held()
            self._queue.clear()
            self._callers = QueueShares(self.spec.queue, self._queue_bytes)
            self.interrupt("the job stopped")
            self._changed.notify_all()
        for request in requests:
            self.refuse(request.msg, request.request_id, "not_serving", f"job {self.name} stopped")
        if self._dispatcher is not None:
            self._dispatcher.join(10.0)
        self.ctx.update(self.ctx.state().status, **self.progress())  # the final figures stay in the state
        self._release(plan.devices if plan else [])

    # --- what the kinds share -------------------------------------------------------------------------

    def admit(self, request: R, nbytes: int = 0) -> None:
        """Queue ``request`` (``nbytes`` of inputs) while the job serves and the caller's share has room; else
        refuse it (``not_serving``, ``busy``)."""
        with self._changed:
            if not self._accepting:
                reason: tuple[InferErrorReason, str] | None = (
                    "not_serving", f"job {self.name} is not serving yet (or any more): see edgeswarm jobs")
            elif (share := self._callers.take(request.caller, nbytes)) is not None:
                reason = ("busy", f"job {self.name}: {share}; send again later")
            else:
                reason = None
                self._queue.append(request)
                self._changed.notify_all()
        if reason is not None:
            self.refuse(request.msg, request.request_id, *reason)

    def refuse(self, msg: Inbound, request_id: str, reason: InferErrorReason, detail: str) -> None:
        """Answer a request with InferError ``reason`` (counted among the job's errors). Never raises."""
        with self._changed:
            self._errors += 1
        record.request_refused(self.bus.metrics, self.name, reason)
        refuse_request(self.bus, msg, self.name, request_id, reason, detail)

    def _release(self, devices: list[str]) -> None:
        """Tell ``devices`` to drop the job's part (no answer expected)."""
        for device in devices:
            try:
                self.bus.publish(topics.request(device, self.worker_service), self.release(job_id=self.name))
            except EdgeswarmError as exc:
                log.warning("could not release the %s of job %s on %s: %s", self.part, self.name, device, exc)


class ServingWorkload(Workload):
    """A serving kind: jobs run side by side (and beside training), each holding one part per device it uses. A kind
    gives ``request_type`` (what callers send), ``program`` (its ``ServingProgram``, "module:Class", imported when a
    job runs: torch is not needed before), ``lost_on_restart`` (what a restarted coordinator could not answer, in
    words) and ``measured`` (its measured figures, for the job table and the charts)."""

    command = "serve"
    exclusive = False
    request_type: ClassVar[type[Message]]
    program: ClassVar[str]
    lost_on_restart: ClassVar[str] = "the requests it held"

    @abstractmethod
    def measured(self, progress: Any) -> list[tuple[str, str, float | None]]:
        """The job's measured figures in ``progress`` (its kind's progress type): (name, unit, value), a latency in
        seconds (unit "s") or a rate (its unit), None when not measured yet."""

    def summary(self, state: JobState) -> JobSummary:
        p = state.progress_as(self.progress_type)
        return JobSummary(progress=f"{p.answered} answered, {p.errors} errors", figures=figures_line(*(
            (f"{name} {value * 1000:.1f} ms" if unit == "s" else f"{value:.1f} {unit}")
            for name, unit, value in self.measured(p) if value is not None)))

    def predicted_at_load(self, progress: Any) -> dict[str, float]:
        """The plan's prediction of ``measured``'s figures (by name) at the load the job measures, where the kind
        has one. None by default: a plan that prices compute and collectives alone predicts none of them."""
        return {}

    def series(self, state: JobState) -> list[Series]:
        x = max(0.0, state.updated_at - state.submitted_at)
        progress = state.progress_as(self.progress_type)
        predicted = self.predicted_at_load(progress)
        return [Series(name=name, unit=unit, x_label="s", points=(SeriesPoint(x=x, y=value),),
                       predicted=predicted.get(name))
                for name, unit, value in self.measured(progress) if finite(value)]

    def run(self, ctx: JobContext, spec: Any) -> tuple[JobEventKind, str] | None:
        if ctx.previous is not None:
            ctx.update("queued", event=("resumed", f"a restarted coordinator deploys the job again (it was "
                                                   f"{ctx.previous.status}); nobody answered {self.lost_on_restart}"))
        program = load_target(self.program, f"the coordinator program of {self.kind}")
        program(ctx, spec, worker_service=self.worker_service).run()
        return None  # a serving job ends only by cancellation or failure

    def refuse_data(self, bus: Bus, msg: Inbound, state: JobState | None) -> None:
        body = msg.body
        if not isinstance(body, self.request_type):  # results for a job that ended: nobody waits for them
            return
        job_id, request_id = str(getattr(body, "job_id", "")), str(getattr(body, "request_id", ""))
        if state is None:
            refuse_request(bus, msg, job_id, request_id, "unknown_job",
                           f"the coordinator has no job {job_id}: see edgeswarm jobs")
        else:
            refuse_request(bus, msg, job_id, request_id, "not_serving", f"job {job_id} is {state.status}, not serving")

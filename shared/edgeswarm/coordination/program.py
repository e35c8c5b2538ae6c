"""The job skeleton every coordinator program runs on, in two shapes: ``CoordinatorProgram`` profiles, plans,
deploys to every device and runs while watching liveness, re-planning on loss; ``RoundProgram`` runs rounds that
each plan themselves (splitfed picks every round's participants and cuts).

Like Flower's ``Server.fit`` calling a strategy's hooks, ``run`` is the one driver of both and a workload fills in
small hooks (the order they are called in):

==========================  ========================================================================================
``on_start()``              RoundProgram: the job starts (resume, profile)
``nodes(online)``           CoordinatorProgram (its start, to ``on_ready``): which of the nodes whose worker service
                            is online the job may use (default: all but ``exclude``)
``profile(nodes)``          the job's cluster profile on them (and its ``profiling`` event)
``take_over(cluster)``      a job an earlier coordinator left running: bring its devices under this one and return
                            its plan (default None: plan and deploy afresh)
``plan_request(c, epoch)``  what to ask the planner service for the cluster profile ``c``; ``plan_from(reply)``
                            the plan in its answer (asked through ``ask_planner``)
``on_planned(plan)``        the first plan is known (publish it)
``deploy(plan)``            put the plan on its devices: by default ``fan_out`` of ``assignments(plan)``, every
                            reply an instance of ``ready``
``on_ready(plan)``          every device holds its part (deployed afresh or taken over): start working
``done()`` / ``step()``     the job's loop: one step (a round; one beat of a serving loop) until done; a step
                            raises ``Disrupted`` when devices are lost (the failure detector, ``self.detector``,
                            watches the plan's devices, or those a round gives it)
``on_lost(disruption)``     CoordinatorProgram: re-plan and deploy again, returning the new plan (its devices are
                            watched from then on); RoundProgram: get over it before the next round. Either may raise
                            to fail the job (the default)
``stop()``                  the job leaves its loop, however it leaves it (only once its start ran)
==========================  ========================================================================================

The skeleton checks for cancellation between phases and before every step (``check``), counts every disruption
got over as a recovery (``count_recovery``, which a step may call too), and closes the failure detector it made
when the job ends.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

from edgeswarm.bus import Bus
from edgeswarm.coordination.fanout import FanOut, Watch, fan_out
from edgeswarm.coordination.planner_client import (
    PLAN_TIMEOUT_S,
    PLANNER_BUSY_PAUSE_S,
    PLANNER_NODE,
    TOO_LARGE_ADVICE,
    request_plan,
)
from edgeswarm.errors import BusError, JobCancelled, JobError
from edgeswarm.observability import record
from edgeswarm.runtime.client import ClusterWatcher, nodes_running
from edgeswarm.runtime.detection import Detection, FailureDetector
from edgeswarm.values.profiles import ClusterProfile
from edgeswarm.wire import Message

log = logging.getLogger(__name__)

CLUSTER_SETTLE_S = 0.5  # for the cluster's retained state to arrive before the online workers are read
CLUSTER_WAIT_S = 30.0  # for a first device to come online


class DevicePlan(Protocol):
    """What the skeleton reads of a workload's plan: its version and the devices it runs on."""

    @property
    def epoch(self) -> int: ...

    @property
    def devices(self) -> list[str]: ...


PlanT = TypeVar("PlanT", bound=DevicePlan)


class Disrupted(JobError):
    """A job's step could not go on as planned: ``failures`` are the devices the failure detector confirmed lost
    (empty when none was, a lost connection to the broker or a stalled pipeline, say). ``on_lost`` decides."""

    def __init__(self, message: str, failures: dict[str, Detection] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[str, Detection] = failures or {}


class JobProgram(ABC):
    """One job on the coordinator, of either shape (see the module's docstring). ``name`` names the job in errors,
    ``worker_service`` is the service that hosts its work on the devices (its kind's ``Workload.worker_service``),
    ``exclude`` the nodes it must not use. ``detector`` is a failure detector of ``worker_service`` to use (None: one
    of its own, closed when the job ends); ``timeout_s`` bounds each request to the devices."""

    #: What the planner is asked for, and how to make a request smaller when it is too much work.
    plan_noun: str = "plan"
    too_large_advice: str = TOO_LARGE_ADVICE

    def __init__(self, bus: Bus, *, name: str, worker_service: str, cancel: threading.Event | None = None,
                 timeout_s: float = 120.0, exclude: tuple[str, ...] | list[str] = (),
                 detector: FailureDetector | None = None, planner_node: str = PLANNER_NODE,
                 plan_timeout_s: float = PLAN_TIMEOUT_S, busy_pause_s: float = PLANNER_BUSY_PAUSE_S) -> None:
        self.bus = bus
        self.name = name
        self.worker_service = worker_service
        self.cancel = cancel or threading.Event()
        self.timeout_s = timeout_s
        self.exclude = frozenset(exclude)
        self.detector = detector
        self.planner_node = planner_node
        self.plan_timeout_s = plan_timeout_s
        self.busy_pause_s = busy_pause_s
        self.watcher: ClusterWatcher | None = None
        self.online: list[str] = []  # the nodes whose worker service was online when the job started

    # --- the driver -------------------------------------------------------------------------------

    def run(self) -> None:
        """Run the job to its end: returns when ``done``, raises JobCancelled once ``cancel`` is set, JobError (or
        another EdgeswarmError) naming what failed."""
        self.watcher = ClusterWatcher(self.bus)
        view, _ = self.watcher.wait(settle_s=CLUSTER_SETTLE_S, devices=1, timeout_s=CLUSTER_WAIT_S,
                                    cancel=self.cancel)
        self.check()
        self.online = nodes_running(view, self.worker_service)
        self.on_start()
        self.check()
        own_detector = self.detector is None
        if self.detector is None:
            self.detector = FailureDetector(self.bus, self.worker_service,
                                            timeout_factor=self.bus.settings.heartbeat_timeout_factor)
        try:
            self._begin()
            try:
                self.loop()
            finally:
                self.stop()
        finally:
            if own_detector:
                self.detector.close()

    @abstractmethod
    def on_start(self) -> None:
        """The job starts, before the failure detector runs (``online``: the nodes whose worker service is online):
        a RoundProgram resumes and profiles; a CoordinatorProgram profiles (``nodes``, ``profile``)."""

    def _begin(self) -> None:  # noqa: B027 (a RoundProgram has nothing to do here)
        """The shape's start once the failure detector runs."""

    def loop(self) -> None:
        """Step until ``done``; every disruption goes to ``on_lost`` and, got over, counts as a recovery."""
        while not self.done():
            self.check()
            try:
                self.step()
            except Disrupted as exc:
                self._recover(exc)
                self.count_recovery(bool(exc.failures))

    @abstractmethod
    def _recover(self, disruption: Disrupted) -> None:
        """Go on after ``disruption`` (the shape's ``on_lost``), or raise."""

    def count_recovery(self, device_lost: bool) -> None:
        """Count that the job goes on after a disruption (``device_lost``: a device was confirmed gone)."""
        metrics = getattr(self.bus, "metrics", None)  # None: a program driven without a bus (its tests)
        if metrics is not None:
            record.recovered(metrics, self.name, device_lost)

    def check(self) -> None:
        """Raise JobCancelled once the job is cancelled."""
        if self.cancel.is_set():
            raise JobCancelled(f"job {self.name} was cancelled")

    def ask_planner(self, request: Message, what: str | None = None) -> Message:
        """The planner service's reply to ``request`` (``planner_client.request_plan``: never a PlanFailed); errors
        name ``what`` (default: the job)."""
        return request_plan(self.bus, request, what=what or f"job {self.name}", planner_node=self.planner_node,
                            timeout_s=self.plan_timeout_s, busy_pause_s=self.busy_pause_s, plan_noun=self.plan_noun,
                            too_large_advice=self.too_large_advice)

    def fan_out(self, messages: Mapping[str, Message], *, targets: Mapping[str, str] | None = None,
                watch: Watch | None = None, stop_on_reconnect: bool = True) -> FanOut:
        """``fan_out`` of ``messages`` to this job's worker service, waiting at most ``timeout_s`` seconds."""
        return fan_out(self.bus, messages, self.worker_service, timeout_s=self.timeout_s, targets=targets,
                       watch=watch, stop_on_reconnect=stop_on_reconnect)

    def done(self) -> bool:
        """Whether the job has finished its work (the default: never; it runs until cancelled)."""
        return False

    @abstractmethod
    def step(self) -> None:
        """One step of the job's work. Raises Disrupted when devices are lost (or the step cannot go on)."""

    def stop(self) -> None:  # noqa: B027 (a hook a program may leave out)
        """The job leaves its loop (done, cancelled or failed): release what it holds."""


class CoordinatorProgram(JobProgram, Generic[PlanT]):
    """A job planned and deployed once, re-planned on loss (see the module's docstring)."""

    #: The reply to an assignment that says a device holds its part (for the default ``deploy``).
    ready: type[Message] = Message
    #: What the job deploys on each device, for errors ("stage on a: ...").
    part: str = "part"
    cluster: ClusterProfile | None = None  # the profile the job plans on (hooks narrow it on losses)
    plan: PlanT | None = None  # the plan deployed

    def on_start(self) -> None:
        nodes = self.nodes(self.online)
        if not nodes:
            raise JobError(f"job {self.name}: no {self.worker_service} is online; start a cluster "
                           "(edgeswarm up --local)")
        self.cluster = self.profile(nodes)

    def _begin(self) -> None:
        assert self.cluster is not None
        plan = self.take_over(self.cluster)
        if plan is None:
            plan = self.request_plan(self.cluster, 0)
            self.on_planned(plan)
            self.check()
            self.deploy(plan)
        self.replanned(plan)
        self.on_ready(plan)

    def _recover(self, disruption: Disrupted) -> None:
        self.replanned(self.on_lost(disruption))

    def replanned(self, plan: PlanT) -> None:
        """The job runs on ``plan`` from now on: the failure detector watches its devices."""
        self.plan = plan
        if self.detector is not None:
            self.detector.watch(plan.devices)

    def request_plan(self, cluster: ClusterProfile, epoch: int) -> PlanT:
        """``plan_from`` the planner's reply to ``plan_request(cluster, epoch)``."""
        return self.plan_from(self.ask_planner(self.plan_request(cluster, epoch)))

    # --- the hooks --------------------------------------------------------------------------------

    def nodes(self, online: list[str]) -> list[str]:
        """The nodes the job may use among ``online`` (those whose worker service is online, in the view's
        order); none: the job fails saying so."""
        return [n for n in online if n not in self.exclude]

    @abstractmethod
    def profile(self, nodes: list[str]) -> ClusterProfile:
        """The job's cluster profile on ``nodes``."""

    def take_over(self, cluster: ClusterProfile) -> PlanT | None:
        """For a job an earlier coordinator ran: bring its devices under this program and return the plan they
        hold. None (the default): the job is planned and deployed afresh."""
        return None

    @abstractmethod
    def plan_request(self, cluster: ClusterProfile, epoch: int) -> Message:
        """What to ask the planner service for a plan of version ``epoch`` over ``cluster``."""

    @abstractmethod
    def plan_from(self, reply: Message) -> PlanT:
        """The plan in the planner's ``reply`` (never a PlanFailed). Raises JobError when it cannot be used."""

    def on_planned(self, plan: PlanT) -> None:
        """The job's first plan is known (not called for a take-over or a re-plan)."""

    def assignments(self, plan: PlanT) -> dict[str, Message]:
        """What each device of ``plan`` is asked to deploy (for the default ``deploy``). A program overrides either
        this or ``deploy`` (HPP training deploys through its driver; pipelined serving gives assignments)."""
        raise NotImplementedError(f"{type(self).__name__} must override assignments() or deploy()")

    def deploy(self, plan: PlanT) -> None:
        """Put ``plan`` on its devices: ``assignments(plan)`` to each at once; raises JobError naming every device
        that did not answer with ``ready``."""
        # A device may still answer after this side's connection came back: wait the whole timeout.
        fan = self.fan_out(self.assignments(plan), stop_on_reconnect=False)
        problems = [f"{self.part} on {node}: {_describe(answer)}" for node, answer in
                    [*fan.failures.items(), *fan.replies.items()] if not isinstance(answer, self.ready)]
        if problems:
            raise JobError(f"job {self.name}: deploying plan epoch {plan.epoch} failed: " + "; ".join(problems))

    def on_ready(self, plan: PlanT) -> None:
        """Every device of ``plan`` holds its part, deployed afresh or taken over; the job's loop starts next."""

    def on_lost(self, disruption: Disrupted) -> PlanT:
        """Re-plan and deploy after ``disruption``; returns the plan the job goes on with. The default gives up:
        it raises the disruption."""
        raise disruption


class RoundProgram(JobProgram):
    """A job of rounds that each plan themselves (see the module's docstring): a ``step`` is a round."""

    def _recover(self, disruption: Disrupted) -> None:
        self.on_lost(disruption)

    def on_lost(self, disruption: Disrupted) -> None:
        """Get over ``disruption`` before the next round. The default gives up: it raises the disruption."""
        raise disruption


def _describe(answer: Message | BusError) -> str:
    """A device's answer to a deployment, for an error: its reason and detail when it gives them."""
    reason, detail = getattr(answer, "reason", None), getattr(answer, "detail", None)
    if isinstance(answer, Message) and reason is not None and detail is not None:
        return f"{reason}: {detail}"
    return str(answer)

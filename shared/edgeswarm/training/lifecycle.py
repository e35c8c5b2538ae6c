"""A training job from start to end against a running cluster: profile, plan, deploy, train, checkpoint.

``run_job`` is what the coordinator runs for every submitted job (on its own thread). It profiles the devices
whose stage-workers are online through their profiler services, asks the planner service for the plan and the
baselines, deploys the plan on the stage-workers, runs the rounds and saves checkpoints. Every step waits with
a timeout and fails naming the step and the device; ``cancel`` stops the job at once, aborting a round in
flight. What happens is reported to a ``JobObserver``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.errors import BusError, EdgeswarmError
from edgeswarm.messages.planning import PlanFailed, PlanReply, PlanRequest
from edgeswarm.messages.training import CheckpointSource, StageSaved
from edgeswarm.planning.hpp.compare import Comparison
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.runtime.client import ClusterWatcher, nodes_running
from edgeswarm.runtime.detection import Detection, FailureDetector
from edgeswarm.runtime.program import STAGE_WORKER
from edgeswarm.training.driver import (
    ConnectionInterrupted,
    DeviceLost,
    JobCancelled,
    JobDriver,
    JobError,
    RoundReport,
    StagesFailed,
)
from edgeswarm.training.jobs import JobSpec
from edgeswarm.training.recovery import RecoveryReport, grow, recover
from edgeswarm.values.profiles import ClusterProfile

log = logging.getLogger(__name__)

MAX_PROFILED_BATCH = 256
PLANNER_NODE = "hub"
PLANNER_BUSY_PAUSE_S = 2.0  # between asks while the planner's queue is full


@dataclass
class JobResult:
    """The plan a job ran on, the planner's comparison, every round's report and the checkpoints saved (the
    last is the final model)."""

    plan: Plan
    comparison: Comparison | None = None
    rounds: list[RoundReport] = field(default_factory=list)
    saved: list[list[StageSaved]] = field(default_factory=list)
    test_accuracy: float | None = None
    recoveries: list[RecoveryReport] = field(default_factory=list)


class JobObserver:
    """What ``run_job`` reports as a job goes. The default does nothing; the coordinator publishes it."""

    def profiling(self, nodes: list[str]) -> None:
        """Profiling the model on ``nodes`` starts."""

    def profile_progress(self, node: str, fraction: float, message: str) -> None:
        """A device's profiler reports progress (fraction 0..1)."""

    def planned(self, plan: Plan, comparison: Comparison | None, total_rounds: int) -> None:
        """The plan the job runs on, with the planner's baselines when it gave them."""

    def deployed(self) -> None:
        """Every stage-worker holds its stage."""

    def round_done(self, report: RoundReport) -> None:
        """A round ended."""

    def saved(self, version: int, saved: list[StageSaved]) -> None:
        """Every stage was saved to the checkpoint store as ``version``."""

    def device_lost(self, failures: dict[str, Detection], round_index: int) -> None:
        """The failure detector confirmed ``failures`` while round ``round_index`` ran (or was next)."""

    def recovered(self, report: RecoveryReport) -> None:
        """The job runs again on ``report.plan`` from round ``report.resume_round``."""

    def joined(self, report: RecoveryReport) -> None:
        """Devices ``report.joined`` were added: the job goes on with ``report.plan`` from ``report.resume_round``."""

    def evaluated(self, test_accuracy: float) -> None:
        """The final model, loaded back from the checkpoint store, scored ``test_accuracy`` on held-out data."""


def profile_batch_sizes(job: JobSpec) -> list[int]:
    """Batch sizes to profile at: powers of two up to the largest micro-batch the planner may pick, and it."""
    largest = job.global_batch // job.micro_batches if job.micro_batches else min(job.global_batch, MAX_PROFILED_BATCH)
    sizes = {1 << k for k in range(largest.bit_length()) if 1 << k <= largest} | {largest}
    return sorted(sizes)


def request_plan(bus: Bus, job: JobSpec, cluster: ClusterProfile, *, timeout_s: float = 120.0,
                 planner_node: str = PLANNER_NODE,
                 busy_pause_s: float = PLANNER_BUSY_PAUSE_S) -> tuple[Plan, Comparison | None]:
    """Ask the planner service on ``planner_node`` for ``job``'s plan with every baseline beside it; returns
    the plan of the job's strategy and the comparison. While the planner answers ``busy`` (its queue is full)
    the request is asked again every ``busy_pause_s`` seconds. Raises JobError when the planner fails (``too_large``
    says how to make the job smaller), stays busy or does not answer within ``timeout_s`` seconds in all, or the
    strategy has no feasible plan."""
    request = PlanRequest(cluster=cluster, global_batch=job.global_batch, micro_batches=job.micro_batches,
                          optimizer=job.optimizer.name, strategy=job.strategy, compare=True)
    give_up = time.monotonic() + timeout_s
    while True:
        left = give_up - time.monotonic()
        try:
            reply = bus.request(topics.request(planner_node, "planner"), request, timeout_s=max(left, 1.0)).body
        except BusError as exc:
            raise JobError(f"job {job.name}: the planner on {planner_node} did not answer: {exc}") from None
        if not (isinstance(reply, PlanFailed) and reply.reason == "busy"):
            break
        if time.monotonic() + busy_pause_s > give_up:
            raise JobError(f"job {job.name}: the planner on {planner_node} stayed busy for {timeout_s:.0f} s "
                           f"({reply.detail}); submit the job again when the planner has caught up")
        log.info("job %s: the planner on %s is busy; asking again in %.0f s", job.name, planner_node, busy_pause_s)
        time.sleep(busy_pause_s)
    if isinstance(reply, PlanFailed):
        if reply.reason == "too_large":
            raise JobError(f"job {job.name}: planning it is too much work for the planner on {planner_node}: "
                           f"{reply.detail}. In the job file: set micro_batches, or run on fewer devices")
        raise JobError(f"job {job.name}: no plan ({reply.reason}): {reply.detail}")
    assert isinstance(reply, PlanReply) and reply.comparison is not None
    comparison = reply.comparison
    if job.strategy == "hpp":
        return comparison.hpp, comparison
    baseline = comparison.baseline(job.strategy)
    if baseline.plan is None:
        raise JobError(f"job {job.name}: strategy {job.strategy} has no feasible plan: {baseline.error}")
    return baseline.plan, comparison


@dataclass(frozen=True)
class Resume:
    """Where a job that an earlier coordinator ran stands, from its retained state: the plan its devices hold,
    the rounds done and the last checkpoint version saved (0: none)."""

    plan: Plan
    rounds_done: int
    saved_version: int = 0


def run_job(bus: Bus, job: JobSpec, *, store_node: str | None = "hub", observer: JobObserver | None = None,
            cancel: threading.Event | None = None, timeout_s: float = 600.0,
            detector: FailureDetector | None = None, resume: Resume | None = None) -> JobResult:
    """Train ``job`` on the devices whose stage-workers are online on ``bus``'s cluster; returns what happened.

    Checkpoints go to the checkpoint store on ``store_node`` every ``job.checkpoint_interval`` rounds and at
    the end (None: no checkpoints); the final checkpoint is then loaded back and evaluated on the held-out
    split. Devices the failure ``detector`` (a new one if None) confirms lost are replaced as ``job.recovery``
    says, and the job replays from the latest round start every unit has a copy of. With ``resume`` the job is
    taken over from an earlier coordinator instead of planned: the plan's devices still online are profiled
    (their profilers have the profiles cached) and every one restores its state from its own snapshots, as after
    a lost connection, so the job goes on exactly where it was. Raises JobCancelled once ``cancel`` is set,
    JobError (or a profiling error) naming what failed.
    """
    from edgeswarm.data import open_dataset  # torch: only when a job actually runs

    seen = observer or JobObserver()
    cancel = cancel or threading.Event()

    def check() -> None:
        if cancel.is_set():
            raise JobCancelled(f"job {job.name} was cancelled")

    dataset = open_dataset(job.data, job.model)
    terms_per_sample = 1
    for dim in dataset.label_shape:
        terms_per_sample *= dim
    loss_terms = job.global_batch * terms_per_sample
    total = job.total_rounds(dataset.train_size)
    watcher = ClusterWatcher(bus)
    view, _ = watcher.wait(settle_s=0.5, devices=1, timeout_s=30)
    nodes = nodes_running(view, STAGE_WORKER)
    if resume is not None:
        nodes = [n for n in resume.plan.devices if n in nodes]
    if not nodes:
        raise JobError(f"job {job.name}: no stage-worker " + ("of its plan " if resume else "") +
                       "is online; start a cluster (edgeswarm up --local)")
    if resume is None:
        seen.profiling(nodes)
    cluster = profile_cluster(bus, job.model, profile_batch_sizes(job), nodes=nodes, timeout_s=timeout_s,
                              progress=seen.profile_progress)
    check()
    if resume is None:
        plan, comparison = request_plan(bus, job, cluster)
        seen.planned(plan, comparison, total)
        check()
    own_detector = detector is None
    detector = detector or FailureDetector(bus, timeout_factor=bus.settings.heartbeat_timeout_factor)
    try:
        if resume is None:
            driver = JobDriver(bus, job, plan, loss_terms=loss_terms, timeout_s=timeout_s, cancel=cancel,
                               detector=detector)
            driver.deploy(checkpoint=_initial(bus, job, store_node))
            seen.deployed()
            result = JobResult(plan, comparison)
            start = saved_version = 0
        else:
            driver, report = _take_over(bus, job, resume, cluster, loss_terms, timeout_s, cancel, detector,
                                        store_node)
            cluster = cluster.without(*report.failed)
            result = JobResult(report.plan, recoveries=[report])
            seen.recovered(report)
            start, saved_version = report.resume_round, min(resume.saved_version, report.resume_round)
        joiner = _joiner(bus, job, watcher, detector, passed_over=set(nodes_running(view, STAGE_WORKER)) -
                         set(result.plan.devices), timeout_s=timeout_s)
        train_rounds(driver, job, total, cluster, store_node, result, seen, check, joiner, start=start,
                     saved_version=saved_version)
    finally:
        if own_detector:
            detector.close()
    if store_node and total:
        from edgeswarm.training.evaluation import evaluate_checkpoint

        result.test_accuracy = evaluate_checkpoint(bus, store_node, job, len(result.plan.stages), total)
        seen.evaluated(result.test_accuracy)
    return result


def _take_over(bus: Bus, job: JobSpec, resume: Resume, cluster: ClusterProfile, loss_terms: int, timeout_s: float,
               cancel: threading.Event, detector: FailureDetector,
               store_node: str | None) -> tuple[JobDriver, RecoveryReport]:
    """Bring the devices of ``resume.plan`` under a new driver: the ones that are gone are confirmed failed and
    replaced as ``job.recovery`` says, and every device restores its state at the latest round start all units
    have a copy of (the round the earlier coordinator was in, normally), or from the last checkpoint when the
    devices no longer hold the state (they restarted too)."""
    # The earlier coordinator may have sent the next epoch's assignments before it stopped: start past it.
    plan = resume.plan.model_copy(update={"epoch": resume.plan.epoch + 1})
    driver = JobDriver(bus, job, plan, loss_terms, epoch=plan.epoch, timeout_s=timeout_s, cancel=cancel,
                       detector=detector)
    gone = [n for n in plan.devices if n not in {d.device.node for d in cluster.devices}]
    failures = detector.confirm(gone) if gone else {}
    if len(failures) < len(gone):
        raise JobError(f"job {job.name}: {', '.join(n for n in gone if n not in failures)} of its plan answer but "
                       "could not be profiled; try again once their profilers are up")
    if failures and job.recovery == "none":
        raise DeviceLost(f"job {job.name}: {', '.join(failures)} left while no coordinator ran it", failures)
    return recover(driver, failures, resume.rounds_done, cluster, job.recovery,
                   _checkpoint(store_node, resume.saved_version, job))


def _initial(bus: Bus, job: JobSpec, store_node: str | None) -> CheckpointSource | None:
    """Where the stages of a job that starts from a file load it (version 0 of its checkpoints); None: the seed."""
    if job.init is None:
        return None
    if store_node is None:
        raise JobError(f"job {job.name} starts from {job.init.file}, which needs the checkpoint store")
    from edgeswarm.training.initial import InitError, initial_checkpoint

    try:
        return initial_checkpoint(bus, store_node, job)
    except InitError as exc:
        raise JobError(str(exc)) from None


def _checkpoint(store_node: str | None, saved_version: int, job: JobSpec) -> tuple[str, int] | None:
    """What ``recover`` may go back to: the store's node and the last version saved, if any was (version 0 is the
    file a job started from)."""
    return (store_node, saved_version) if store_node and (saved_version or job.init is not None) else None


#: A job's way to add devices that appeared: given the driver and the round about to start, the new driver, the
#: report and the profile of every device now usable, or None when nothing changes.
Joiner = Callable[[JobDriver, ClusterProfile, int], tuple[JobDriver, RecoveryReport, ClusterProfile] | None]


JOIN_READY_S = 30.0  # how long a device that appeared may take to bring its profiler up


def _joiner(bus: Bus, job: JobSpec, watcher: ClusterWatcher, detector: FailureDetector, *, passed_over: set[str],
            timeout_s: float) -> Joiner:
    """Adds the devices whose stage-worker came online during the job (not those the plan passed over at the
    start; a device lost earlier may come back). Each new device is tried once: profiled together with the
    plan's devices, then ``grow``."""
    tried = set(passed_over)

    def join(driver: JobDriver, cluster: ClusterProfile, index: int) -> tuple[JobDriver, RecoveryReport,
                                                                            ClusterProfile] | None:
        view, _ = watcher.view()
        fresh = sorted(n for n in nodes_running(view, STAGE_WORKER)
                       if n not in driver.plan.devices and n not in tried and not detector.failed(n))
        if not fresh:
            return None
        tried.update(fresh)
        log.info("job %s: %s appeared; profiling before round %d", job.name, ", ".join(fresh), index)
        try:
            grown = profile_cluster(bus, job.model, profile_batch_sizes(job), nodes=[*driver.plan.devices, *fresh],
                                    timeout_s=timeout_s, ready_timeout_s=JOIN_READY_S)
        except EdgeswarmError as exc:
            log.warning("job %s: %s cannot join: %s", job.name, ", ".join(fresh), exc)
            return None
        joined = grow(driver, fresh, grown, index)
        return None if joined is None else (*joined, grown)

    return join


def train_rounds(driver: JobDriver, job: JobSpec, total: int, cluster: ClusterProfile, store_node: str | None,
                 result: JobResult, seen: JobObserver, check: Callable[[], None], joiner: Joiner | None = None, *,
                 start: int = 0, saved_version: int = 0) -> None:
    """Run rounds from ``start`` until ``total`` are done and saved (``saved_version`` is the last checkpoint
    version saved); a lost device is replaced (``job.recovery``) and the rounds since the resume point run again.
    At round starts that have snapshots (every ``job.backup_interval``-th), ``joiner`` may add devices that
    appeared."""
    index = start
    while index < total or (store_node and saved_version < total):
        check()
        try:
            if joiner is not None and 0 < index < total and index % job.backup_interval == 0:
                grown = joiner(driver, cluster, index)
                if grown is not None:
                    driver, report_, cluster = grown
                    result.recoveries.append(report_)
                    result.plan = report_.plan
                    seen.joined(report_)
            if index < total:
                report = driver.run_round(index)
                result.rounds.append(report)
                seen.round_done(report)
                index += 1
            due = index == total or (job.checkpoint_interval and index % job.checkpoint_interval == 0)
            if store_node and due and saved_version < index:
                saved = _save(driver, store_node, index, check)
                saved_version = index
                result.saved.append(saved)
                seen.saved(index, saved)
        except (DeviceLost, ConnectionInterrupted) as exc:
            if job.recovery == "none":
                raise
            failures = exc.failures if isinstance(exc, DeviceLost) else driver.await_reconnected()
            if failures:
                seen.device_lost(failures, index)
            else:
                log.warning("%s: replaying from the last snapshots", exc)
            driver, report_ = recover(driver, failures, index, cluster, job.recovery,
                                      _checkpoint(store_node, saved_version, job))
            cluster = cluster.without(*report_.failed)  # a later recovery must not plan on them
            result.recoveries.append(report_)
            result.rounds = [r for r in result.rounds if r.round < report_.resume_round]
            result.plan = report_.plan
            index = report_.resume_round
            saved_version = min(saved_version, index)
            seen.recovered(report_)


SAVE_RETRY_S = 60.0  # how long a checkpoint save is retried while the checkpoint store is away (restarting)
SAVE_RETRY_PAUSE_S = 1.0


def _save(driver: JobDriver, store_node: str, version: int, check: Callable[[], None]) -> list[StageSaved]:
    """``driver.save``, retried for SAVE_RETRY_S while the checkpoint store is away (a device could not reach it,
    or did not answer): the store keeps its files across a restart, so the job waits for it rather than fail. A
    refusal (a stale version, a damaged file, ...) and a lost device are raised at once."""
    deadline = time.monotonic() + SAVE_RETRY_S
    while True:
        try:
            return driver.save(store_node, version)
        except (DeviceLost, ConnectionInterrupted, JobCancelled):
            raise
        except JobError as exc:
            if time.monotonic() > deadline or (isinstance(exc, StagesFailed) and not exc.transient):
                raise
            log.warning("%s; retrying in %.0f s", exc, SAVE_RETRY_PAUSE_S)
            time.sleep(SAVE_RETRY_PAUSE_S)
            check()

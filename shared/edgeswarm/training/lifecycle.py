"""A training job from start to end against a running cluster: profile, plan, deploy, train, checkpoint.

``run_job`` is what the coordinator runs for every submitted job (on its own thread). It profiles the devices
whose stage-workers are online through their profiler services, asks the planner service for the plan and the
baselines, deploys the plan on the stage-workers, runs the rounds and saves checkpoints. Every step waits with
a timeout and fails naming the step and the device; ``cancel`` stops the job at once, aborting a round in
flight. What happens is reported to a ``JobObserver``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.errors import BusError
from edgeswarm.messages.planning import PlanFailed, PlanReply, PlanRequest
from edgeswarm.messages.training import StageSaved
from edgeswarm.planning.compare import Comparison
from edgeswarm.planning.types import Plan
from edgeswarm.profiling.gather import profile_cluster
from edgeswarm.profiling.types import ClusterProfile
from edgeswarm.runtime.client import ClusterWatcher, nodes_running
from edgeswarm.training.detection import Detection, FailureDetector
from edgeswarm.training.driver import DeviceLost, JobCancelled, JobDriver, JobError, RoundReport
from edgeswarm.training.jobs import JobSpec
from edgeswarm.training.recovery import RecoveryReport, recover

MAX_PROFILED_BATCH = 256
PLANNER_NODE = "hub"


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

    def evaluated(self, test_accuracy: float) -> None:
        """The final model, loaded back from the checkpoint store, scored ``test_accuracy`` on held-out data."""


def profile_batch_sizes(job: JobSpec) -> list[int]:
    """Batch sizes to profile at: powers of two up to the largest micro-batch the planner may pick, and it."""
    largest = job.global_batch // job.micro_batches if job.micro_batches else min(job.global_batch, MAX_PROFILED_BATCH)
    sizes = {1 << k for k in range(largest.bit_length()) if 1 << k <= largest} | {largest}
    return sorted(sizes)


def request_plan(bus: Bus, job: JobSpec, cluster: ClusterProfile, *, timeout_s: float = 120.0,
                 planner_node: str = PLANNER_NODE) -> tuple[Plan, Comparison | None]:
    """Ask the planner service on ``planner_node`` for ``job``'s plan with every baseline beside it; returns
    the plan of the job's strategy and the comparison. Raises JobError when the planner fails, does not
    answer within ``timeout_s``, or the strategy has no feasible plan."""
    request = PlanRequest(cluster=cluster, global_batch=job.global_batch, micro_batches=job.micro_batches,
                          optimizer=job.optimizer.name, strategy=job.strategy, compare=True)
    try:
        reply = bus.request(topics.request(planner_node, "planner"), request, timeout_s=timeout_s).body
    except BusError as exc:
        raise JobError(f"job {job.name}: the planner on {planner_node} did not answer: {exc}") from None
    if isinstance(reply, PlanFailed):
        raise JobError(f"job {job.name}: no plan ({reply.reason}): {reply.detail}")
    assert isinstance(reply, PlanReply) and reply.comparison is not None
    comparison = reply.comparison
    if job.strategy == "hpp":
        return comparison.hpp, comparison
    baseline = comparison.baseline(job.strategy)
    if baseline.plan is None:
        raise JobError(f"job {job.name}: strategy {job.strategy} has no feasible plan: {baseline.error}")
    return baseline.plan, comparison


def run_job(bus: Bus, job: JobSpec, *, store_node: str | None = "hub", observer: JobObserver | None = None,
            cancel: threading.Event | None = None, timeout_s: float = 600.0,
            detector: FailureDetector | None = None) -> JobResult:
    """Train ``job`` on the devices whose stage-workers are online on ``bus``'s cluster; returns what happened.

    Checkpoints go to the checkpoint store on ``store_node`` every ``job.checkpoint_interval`` rounds and at
    the end (None: no checkpoints); the final checkpoint is then loaded back and evaluated on the held-out
    split. Devices the failure ``detector`` (a new one if None) confirms lost are replaced as ``job.recovery``
    says, and the job replays from the latest round start every unit has a copy of. Raises JobCancelled once
    ``cancel`` is set, JobError (or a profiling error) naming what failed.
    """
    from edgeswarm.training.data import open_dataset  # torch: only when a job actually runs

    seen = observer or JobObserver()
    cancel = cancel or threading.Event()

    def check() -> None:
        if cancel.is_set():
            raise JobCancelled(f"job {job.name} was cancelled")

    dataset = open_dataset(job.data, job.model)
    terms_per_sample = 1
    for dim in dataset.label_shape:
        terms_per_sample *= dim
    view, _ = ClusterWatcher(bus).wait(settle_s=0.5, devices=1, timeout_s=30)
    nodes = nodes_running(view, "stage-worker")
    if not nodes:
        raise JobError(f"job {job.name}: no stage-worker is online; start a cluster (edgeswarm up --local)")
    seen.profiling(nodes)
    cluster = profile_cluster(bus, job.model, profile_batch_sizes(job), nodes=nodes, timeout_s=timeout_s,
                              progress=seen.profile_progress)
    check()
    plan, comparison = request_plan(bus, job, cluster)
    total = job.total_rounds(dataset.train_size)
    seen.planned(plan, comparison, total)
    check()
    own_detector = detector is None
    detector = detector or FailureDetector(bus, timeout_factor=bus.settings.heartbeat_timeout_factor)
    try:
        driver = JobDriver(bus, job, plan, loss_terms=job.global_batch * terms_per_sample, timeout_s=timeout_s,
                           cancel=cancel, detector=detector)
        driver.deploy()
        seen.deployed()
        result = JobResult(plan, comparison)
        train_rounds(driver, job, total, cluster, store_node, result, seen, check)
    finally:
        if own_detector:
            detector.close()
    if store_node and total:
        from edgeswarm.training.evaluation import evaluate_checkpoint

        result.test_accuracy = evaluate_checkpoint(bus, store_node, job, len(result.plan.stages), total)
        seen.evaluated(result.test_accuracy)
    return result


def train_rounds(driver: JobDriver, job: JobSpec, total: int, cluster: ClusterProfile, store_node: str | None,
           result: JobResult, seen: JobObserver, check: Callable[[], None]) -> None:
    """Run rounds until ``total`` are done and saved; a lost device is replaced (``job.recovery``) and the rounds
    since the resume point run again."""
    index = 0
    saved_version = 0
    while index < total or (store_node and saved_version < total):
        check()
        try:
            if index < total:
                report = driver.run_round(index)
                result.rounds.append(report)
                seen.round_done(report)
                index += 1
            due = index == total or (job.checkpoint_interval and index % job.checkpoint_interval == 0)
            if store_node and due and saved_version < index:
                saved = driver.save(store_node, index)
                saved_version = index
                result.saved.append(saved)
                seen.saved(index, saved)
        except DeviceLost as lost:
            if job.recovery == "none":
                raise
            seen.device_lost(lost.failures, index)
            driver, report_ = recover(driver, lost.failures, index, cluster, job.recovery)
            result.recoveries.append(report_)
            result.rounds = [r for r in result.rounds if r.round < report_.resume_round]
            result.plan = report_.plan
            index = report_.resume_round
            saved_version = min(saved_version, index)
            seen.recovered(report_)

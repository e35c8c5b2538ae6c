"""A training job from start to end against a running cluster: profile, plan, deploy, train, checkpoint.

``run_job`` is what ``edgeswarm train`` runs today from the client; the coordinator's job service is to call
the same function. Each step waits with a timeout and fails with the step and the device named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from edgeswarm.bus import Bus
from edgeswarm.messages.training import StageSaved
from edgeswarm.planning.compare import plan_best
from edgeswarm.planning.types import Plan
from edgeswarm.profiling.gather import profile_at_hub
from edgeswarm.runtime.client import ClusterWatcher, nodes_running
from edgeswarm.training.driver import JobDriver, JobError, RoundReport
from edgeswarm.training.jobs import JobSpec

MAX_PROFILED_BATCH = 256


@dataclass
class JobResult:
    """The plan a job ran on, every round's report and the checkpoints saved (the last is the final model)."""

    plan: Plan
    rounds: list[RoundReport] = field(default_factory=list)
    saved: list[list[StageSaved]] = field(default_factory=list)


def profile_batch_sizes(job: JobSpec) -> list[int]:
    """Batch sizes to profile at: powers of two up to the largest micro-batch the planner may pick, and it."""
    largest = job.global_batch // job.micro_batches if job.micro_batches else min(job.global_batch, MAX_PROFILED_BATCH)
    sizes = {1 << k for k in range(largest.bit_length()) if 1 << k <= largest} | {largest}
    return sorted(sizes)


def run_job(bus: Bus, hub: str, job: JobSpec, *, store_node: str | None = "hub",
            on_plan: Callable[[Plan], None] | None = None,
            on_round: Callable[[RoundReport, Plan], None] | None = None,
            on_profile: Callable[[str, float, str], None] | None = None,
            timeout_s: float = 600.0) -> JobResult:
    """Train ``job`` on the devices whose stage-workers are online at ``hub``; returns what happened.

    Checkpoints go to the checkpoint store on ``store_node`` every ``job.checkpoint_interval`` rounds and at
    the end (None: no checkpoints). Raises JobError (or a profiling or planning error) naming what failed.
    """
    from edgeswarm.training.data import open_dataset  # torch: only when a job actually runs

    dataset = open_dataset(job.data, job.model)
    terms_per_sample = 1
    for dim in dataset.label_shape:
        terms_per_sample *= dim
    view, _ = ClusterWatcher(bus).wait(settle_s=0.5, devices=1, timeout_s=30)
    nodes = nodes_running(view, "stage-worker")
    if not nodes:
        raise JobError(f"job {job.name}: no stage-worker is online at {hub}; start a cluster (edgeswarm up --local)")
    cluster = profile_at_hub(hub, job.model, profile_batch_sizes(job), nodes=nodes, timeout_s=timeout_s,
                             progress=on_profile)
    plan = plan_best(job.strategy, cluster, job.global_batch, micro_batches=job.micro_batches,
                     optimizer=job.optimizer.name)
    if on_plan is not None:
        on_plan(plan)
    driver = JobDriver(bus, job, plan, loss_terms=job.global_batch * terms_per_sample, timeout_s=timeout_s)
    driver.deploy()
    result = JobResult(plan)
    total = job.total_rounds(dataset.train_size)
    for index in range(total):
        report = driver.run_round(index)
        result.rounds.append(report)
        if on_round is not None:
            on_round(report, plan)
        last = index == total - 1
        if store_node and (last or (job.checkpoint_interval and (index + 1) % job.checkpoint_interval == 0)):
            result.saved.append(driver.save(store_node, index + 1))
    return result

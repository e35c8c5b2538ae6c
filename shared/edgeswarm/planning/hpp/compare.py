"""The Asteroid plan next to the single-device, DP and PP baselines, with the predicted speed-ups.

The global batch is fixed; the number of micro-batches M may be given or chosen (spec A12): each strategy
is then planned for every M that is a power of two dividing the global batch (micro-batch B = G / M within
the profiled batch sizes) and keeps its fastest, so every strategy gets the same tuning.
"""

from __future__ import annotations

import time
from typing import Protocol

from pydantic import BaseModel

from edgeswarm.errors import InfeasiblePlanError, ProfileError
from edgeswarm.planning.deadline import Deadline, check
from edgeswarm.planning.hpp.asteroid import plan_asteroid
from edgeswarm.planning.hpp.baselines import plan_dp, plan_pp, plan_single
from edgeswarm.planning.hpp.types import Plan, PlanOptions, Strategy
from edgeswarm.values.profiles import ClusterProfile, Optimizer


class Planner(Protocol):
    """A strategy's planner: the plan for one PlanOptions, stopping with PlanningDeadlineError past ``deadline``."""

    def __call__(self, cluster: ClusterProfile, options: PlanOptions, *, deadline: Deadline | None = None) -> Plan:
        ...


PLANNERS: dict[Strategy, Planner] = {"hpp": plan_asteroid, "single": plan_single, "dp": plan_dp, "pp": plan_pp}
MAX_MICRO_BATCHES = 64


class BaselineResult(BaseModel):
    """A baseline's plan, or why it has none (it does not fit in memory); ``speedup`` is the HPP plan's
    throughput over this baseline's (None when the baseline is infeasible)."""

    strategy: Strategy
    plan: Plan | None = None
    error: str | None = None
    speedup: float | None = None


class Comparison(BaseModel):
    """The HPP plan and every baseline for one cluster and global batch; ``planning_s`` is the HPP planner's
    wall time in seconds (all micro-batch choices)."""

    hpp: Plan
    baselines: list[BaselineResult]
    planning_s: float = 0.0

    def baseline(self, strategy: Strategy) -> BaselineResult:
        return next(b for b in self.baselines if b.strategy == strategy)


def micro_batch_choices(cluster: ClusterProfile, global_batch: int) -> list[int]:
    """The values of M worth planning: powers of two dividing ``global_batch`` whose micro-batch every device's
    profile covers. Raises ProfileError when none does."""
    covered = min((e.compute.batch_sizes[-1] for e in cluster.devices), default=global_batch)
    choices = [m for m in (2**k for k in range(7)) if m <= MAX_MICRO_BATCHES and global_batch % m == 0
               and global_batch // m <= covered]
    if not choices:
        raise ProfileError(f"the profiles cover micro-batches up to {covered} samples, too few for a global batch of "
                           f"{global_batch} in at most {MAX_MICRO_BATCHES} micro-batches: profile larger batch sizes")
    return choices


def plan_best(strategy: Strategy, cluster: ClusterProfile, global_batch: int, *, micro_batches: int | None = None,
              optimizer: Optimizer = "sgd", deadline: Deadline | None = None) -> Plan:
    """The ``strategy`` plan of highest predicted throughput for ``global_batch`` samples per round, over the
    given M or every M of ``micro_batch_choices``. Raises InfeasiblePlanError when no choice fits and
    PlanningDeadlineError once ``deadline`` has passed."""
    if micro_batches is not None and global_batch % micro_batches:
        raise ProfileError(f"a global batch of {global_batch} does not split into {micro_batches} micro-batches")
    choices = [micro_batches] if micro_batches else micro_batch_choices(cluster, global_batch)
    best: Plan | None = None
    errors: list[str] = []
    for m in choices:
        check(deadline, f"the {strategy} plan at M={m}")
        options = PlanOptions(micro_batch_size=global_batch // m, micro_batches=m, optimizer=optimizer)
        try:
            plan = PLANNERS[strategy](cluster, options, deadline=deadline)
        except InfeasiblePlanError as exc:
            errors.append(f"M={m}: {exc}")
            continue
        if best is None or plan.throughput_sps > best.throughput_sps:
            best = plan
    if best is None:
        raise InfeasiblePlanError("; ".join(errors))
    return best


def compare(cluster: ClusterProfile, global_batch: int, *, micro_batches: int | None = None,
            optimizer: Optimizer = "sgd", deadline: Deadline | None = None) -> Comparison:
    """Plan with Asteroid and with each baseline. Raises InfeasiblePlanError only when the HPP plan itself is
    infeasible (infeasible baselines are reported, not raised), PlanningDeadlineError once ``deadline`` has
    passed."""
    started = time.perf_counter()
    hpp = plan_best("hpp", cluster, global_batch, micro_batches=micro_batches, optimizer=optimizer,
                    deadline=deadline)
    elapsed = time.perf_counter() - started
    results = []
    for strategy in ("single", "dp", "pp"):
        try:
            plan = plan_best(strategy, cluster, global_batch, micro_batches=micro_batches, optimizer=optimizer,
                             deadline=deadline)
        except InfeasiblePlanError as exc:
            results.append(BaselineResult(strategy=strategy, error=str(exc)))
            continue
        results.append(BaselineResult(strategy=strategy, plan=plan, speedup=hpp.throughput_sps / plan.throughput_sps))
    return Comparison(hpp=hpp, baselines=results, planning_s=elapsed)

"""The Asteroid plan next to the single-device, DP and PP baselines, with the predicted speed-ups."""

from __future__ import annotations

from pydantic import BaseModel

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.planning.asteroid import plan_asteroid
from edgeswarm.planning.baselines import plan_dp, plan_pp, plan_single
from edgeswarm.planning.types import Plan, PlanOptions, Strategy
from edgeswarm.profiling.types import ClusterProfile


class BaselineResult(BaseModel):
    """A baseline's plan, or why it has none (it does not fit in memory); ``speedup`` is the HPP plan's
    throughput over this baseline's (None when the baseline is infeasible)."""

    strategy: Strategy
    plan: Plan | None = None
    error: str | None = None
    speedup: float | None = None


class Comparison(BaseModel):
    """The HPP plan and every baseline for one cluster and one set of options."""

    hpp: Plan
    baselines: list[BaselineResult]

    def baseline(self, strategy: Strategy) -> BaselineResult:
        return next(b for b in self.baselines if b.strategy == strategy)


def compare(cluster: ClusterProfile, options: PlanOptions) -> Comparison:
    """Plan with Asteroid and with each baseline on the same cost model. Raises InfeasiblePlanError only
    when the HPP plan itself is infeasible; infeasible baselines are reported, not raised."""
    hpp = plan_asteroid(cluster, options)
    results = []
    for strategy, planner in (("single", plan_single), ("dp", plan_dp), ("pp", plan_pp)):
        try:
            plan = planner(cluster, options)
        except InfeasiblePlanError as exc:
            results.append(BaselineResult(strategy=strategy, error=str(exc)))
            continue
        results.append(BaselineResult(strategy=strategy, plan=plan, speedup=hpp.throughput_sps / plan.throughput_sps))
    return Comparison(hpp=hpp, baselines=results)

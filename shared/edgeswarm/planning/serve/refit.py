"""Pipelined serving's side of the closed loop (planning.refit holds the fit and the rebalancer every kind shares):
what a plan predicts for each stage device's forward of one micro-batch (``predicted_compute_s``, the fit's
denominator) and what a running plan takes on a refitted profile (``reprice``: its stages kept, priced anew)."""

from __future__ import annotations

from edgeswarm.planning.serve.costs import ServeCosts, serve_costs
from edgeswarm.planning.serve.plan import Candidate, price, to_plan
from edgeswarm.planning.serve.types import ServePlan
from edgeswarm.values.profiles import ClusterProfile


def _costs_and_candidate(plan: ServePlan, cluster: ClusterProfile) -> tuple[ServeCosts, Candidate]:
    costs = serve_costs(cluster, plan.micro_batch_size, [])
    index = {node: i for i, node in enumerate(costs.nodes)}
    return costs, Candidate(bounds=tuple((s.start, s.end) for s in plan.stages),
                            devices=tuple(index[s.device] for s in plan.stages), method=plan.method)


def predicted_compute_s(plan: ServePlan, cluster: ClusterProfile, cold: bool = True) -> dict[str, float]:
    """Each stage device of ``plan``: seconds of its stage's forward of one full micro-batch, as ``cluster`` prices
    it; its units' alone, without the call's cold cost, when not ``cold`` (``ScaleFit.add``'s ``units``). Raises
    KeyError when a device of the plan is not in ``cluster``."""
    costs, cand = _costs_and_candidate(plan, cluster)
    return {costs.nodes[d]: float(costs.compute_s(d, s, e)) - (0.0 if cold else costs.cold_s(d))
            for (s, e), d in zip(cand.bounds, cand.devices, strict=True)}


def reprice(plan: ServePlan, cluster: ClusterProfile) -> ServePlan:
    """``plan`` (its stages and devices) priced on ``cluster``: what the running plan delivers if its devices compute
    as ``cluster`` says. Raises KeyError when a device of the plan is not in ``cluster``."""
    costs, cand = _costs_and_candidate(plan, cluster)
    return to_plan(costs, price(costs, cand)).model_copy(update={"epoch": plan.epoch})

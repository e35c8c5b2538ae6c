"""Layer-wise lightweight re-planning after a device leaves (spec 5.4).

The stage order and device groups stay; the failed device is removed (its stage too, if it was alone);
the cut points are placed again so each stage's share of the model's FLOPs matches its group's share of
the compute capacity (v_d = 1 / time of the whole model at B on device d). Alg. 1 re-splits every group.
A group that no longer fits in memory has its boundary moved one unit at a time toward a neighbour with
slack; if that fails the caller falls back to the full planner (heavy rescheduling). FLOPs are only a proxy
for time (a depthwise convolution has few FLOPs and takes long), so the cuts are then adjusted one unit at a
time while the cost model predicts a shorter round: still the paper's "minor adjustment of the partition
points", at a few milliseconds.
"""

from __future__ import annotations

import numpy as np

from edgeswarm.errors import InfeasiblePlanError, PlanningError
from edgeswarm.planning.deadline import Deadline, check
from edgeswarm.planning.hpp.assemble import Layout, assemble_plan, stage_costs
from edgeswarm.planning.hpp.compare import plan_best
from edgeswarm.planning.hpp.costmodel import CostModel, warmup
from edgeswarm.planning.hpp.types import Plan, Strategy
from edgeswarm.values.profiles import ClusterProfile


def light_replan(plan: Plan, cluster: ClusterProfile, failed: str, *, deadline: Deadline | None = None) -> Plan:
    """The plan without device ``failed``, with the same stage order and groups and new cut points.

    ``cluster`` is the profile the plan was made from (it may still list the failed device). The result's
    epoch is the old one plus one. Raises PlanningError if the device is not in the plan or nobody is left,
    InfeasiblePlanError if no nearby cut fits in memory (re-plan from scratch then), and PlanningDeadlineError
    once ``deadline`` has passed.
    """
    if failed not in plan.devices:
        raise PlanningError(f"device {failed} is not in the plan (devices: {', '.join(plan.devices)})")
    remaining = cluster.without(failed)
    if not remaining.devices:
        raise InfeasiblePlanError(f"{failed} was the only device: nothing is left to train on")
    cm = CostModel(remaining, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    groups = [tuple(index[d] for d in s.devices if d != failed) for s in plan.stages]
    groups = [g for g in groups if g]
    b = cm.options.micro_batch_size
    capacity = np.array([sum(1.0 / float(cm.compute_s(d, b, 0, cm.L)) for d in g) for g in groups])
    cuts = flops_cuts(cm.flops_prefix, capacity)
    new = _refine(cm, _fit_memory(cm, cuts, groups, deadline), plan.strategy, deadline)
    return new.model_copy(update={"epoch": plan.epoch + 1})


def _refine(cm: CostModel, layout: Layout, strategy: Strategy, deadline: Deadline | None = None) -> Plan:
    """Hill-climb: move one cut point by one unit at a time, taking the move the cost model predicts the shortest
    round for, while it shortens the round (at most one step per unit). ``layout`` fits in memory; so does the
    result, since an infeasible layout is never taken."""
    best = assemble_plan(cm, layout, strategy)
    cuts = [start for start, _, _ in layout] + [layout[-1][1]]
    groups = [group for _, _, group in layout]
    for move in range(cm.L):
        check(deadline, f"the light re-plan's refinement (move {move})")
        step = None
        for k in range(1, len(cuts) - 1):
            for delta in (-1, 1):
                moved = list(cuts)
                moved[k] += delta
                if not moved[k - 1] < moved[k] < moved[k + 1]:
                    continue
                try:
                    candidate = assemble_plan(cm, [(moved[p], moved[p + 1], groups[p]) for p in range(len(groups))],
                                              strategy)
                except InfeasiblePlanError:
                    continue
                if candidate.round_latency_s < (step or best).round_latency_s:
                    step, step_cuts = candidate, moved
        if step is None:
            return best
        best, cuts = step, step_cuts
    return best


def heavy_replan(plan: Plan, cluster: ClusterProfile, failed: str, *, deadline: Deadline | None = None) -> Plan:
    """Heavy rescheduling, the straw-man of spec 5.1: the full planner on the surviving devices, same global
    batch, M and optimizer; epoch plus one. Raises PlanningDeadlineError once ``deadline`` has passed."""
    if failed not in plan.devices:
        raise PlanningError(f"device {failed} is not in the plan (devices: {', '.join(plan.devices)})")
    new = plan_best("hpp", cluster.without(failed), plan.options.global_batch,
                    micro_batches=plan.options.micro_batches, optimizer=plan.options.optimizer, deadline=deadline)
    return new.model_copy(update={"epoch": plan.epoch + 1})


def flops_cuts(flops_prefix: np.ndarray, capacity: np.ndarray) -> list[int]:
    """Cut points 0 = c_0 < c_1 < ... < c_P = L so that stage k's FLOPs share is nearest its capacity share.

    ``flops_prefix`` has L + 1 entries (FLOPs of units before each boundary); every stage keeps one unit
    at least. Raises PlanningError when there are more groups than units.
    """
    n_units = len(flops_prefix) - 1
    stages = len(capacity)
    if stages > n_units:
        raise PlanningError(f"{stages} stages cannot share {n_units} units")
    total = float(flops_prefix[-1])
    shares = np.cumsum(capacity) / capacity.sum()
    cuts = [0]
    for k in range(stages - 1):
        lo, hi = cuts[-1] + 1, n_units - (stages - 1 - k)
        candidates = np.arange(lo, hi + 1)
        target = total * shares[k]
        cuts.append(int(candidates[np.argmin(np.abs(flops_prefix[candidates] - target))]))
    cuts.append(n_units)
    return cuts


def _fit_memory(cm: CostModel, cuts: list[int], groups: list[tuple[int, ...]],
                deadline: Deadline | None = None) -> Layout:
    """Move cut points one unit at a time until every stage fits its group's memory (bounded search)."""
    stages = len(groups)
    m = cm.options.micro_batches

    def fits(p: int, start: int, end: int) -> bool:
        c = stage_costs(cm, groups[p], warmup(stages, p, m), np.array([start]), np.array([end]))
        return bool(c.feasible[0])

    cuts = list(cuts)
    for step in range(cm.L * stages):
        check(deadline, f"the light re-plan's memory fitting (step {step})")
        bad = next((p for p in range(stages) if not fits(p, cuts[p], cuts[p + 1])), None)
        if bad is None:
            return [(cuts[p], cuts[p + 1], groups[p]) for p in range(stages)]
        moved = False
        # Shrink the overflowing stage toward the neighbour that can take one more unit.
        if bad + 1 < stages and cuts[bad + 1] - 1 > cuts[bad] and fits(bad + 1, cuts[bad + 1] - 1, cuts[bad + 2]):
            cuts[bad + 1] -= 1
            moved = True
        elif bad > 0 and cuts[bad] + 1 < cuts[bad + 1] and fits(bad - 1, cuts[bad - 1], cuts[bad] + 1):
            cuts[bad] += 1
            moved = True
        if not moved:
            break
    raise InfeasiblePlanError("the lightweight re-plan does not fit the remaining devices' memory: "
                              "re-plan from scratch (heavy rescheduling)")

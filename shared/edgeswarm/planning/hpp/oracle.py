"""Exhaustive search: every contiguous layout in planning order, priced by the same cost model (AC-8).

Only for small instances (the count grows as C(L-1, P-1) * C(N-1, P-1) summed over P): it is the oracle the
DP is checked against, not a planner.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from edgeswarm.errors import InfeasiblePlanError, PlanningError
from edgeswarm.planning.hpp.assemble import Layout, stage_costs
from edgeswarm.planning.hpp.costmodel import CostModel, round_latency, warmup

MAX_LAYOUTS = 200_000


def exhaustive_search(cm: CostModel) -> tuple[Layout, float]:
    """The layout of least predicted round latency over all contiguous stage and group splits that use
    every device, and that latency in seconds. Raises PlanningError when the instance is too large."""
    count = sum(math.comb(cm.L - 1, p - 1) * math.comb(cm.N - 1, p - 1) for p in range(1, min(cm.L, cm.N) + 1))
    if count > MAX_LAYOUTS:
        raise PlanningError(f"exhaustive search over {count} layouts is too large (limit {MAX_LAYOUTS})")
    best: tuple[Layout, float] | None = None
    for p in range(1, min(cm.L, cm.N) + 1):
        for cuts in itertools.combinations(range(1, cm.L), p - 1):
            bounds = (0, *cuts, cm.L)
            for splits in itertools.combinations(range(1, cm.N), p - 1):
                groups = (0, *splits, cm.N)
                layout = [(bounds[s], bounds[s + 1], tuple(range(groups[s], groups[s + 1]))) for s in range(p)]
                latency = layout_latency(cm, layout)
                if best is None or latency < best[1]:
                    best = (layout, latency)
    if best is None or not math.isfinite(best[1]):
        raise InfeasiblePlanError("no layout fits the devices' memory")
    return best


def layout_latency(cm: CostModel, layout: Layout) -> float:
    """Predicted round latency of a layout in seconds (inf when a stage does not fit in memory)."""
    p_total = len(layout)
    m = cm.options.micro_batches
    ef: list[float] = []
    eb: list[float] = []
    ta: list[float] = []
    for p, (start, end, group) in enumerate(layout):
        c = stage_costs(cm, group, warmup(p_total, p, m), np.array([start]), np.array([end]))
        if not c.feasible[0]:
            return math.inf
        ef.append(float(c.forward_s[0]))
        eb.append(float(c.backward_s[0]))
        ta.append(float(c.allreduce_s[0]))
        if p + 1 < p_total:
            comm = cm.comm_s(end - 1, group, layout[p + 1][2])
            ef.append(comm)
            eb.append(comm)
            ta.append(0.0)
    return round_latency(ef, eb, m, ta)[0] + cm.round_overhead_s([d for _, _, group in layout for d in group])

"""How much work a serving plan request is (see edgeswarm.planning.budget)."""

from __future__ import annotations

from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.serve.types import ServeOptions
from edgeswarm.values.profiles import ClusterProfile


def estimate_serve_plan(cluster: ClusterProfile, options: ServeOptions) -> WorkEstimate:
    """The work of ``plan_serving``: the paper's partition DP and placements (about L^2 x N^2 cells) and, for
    methods ``auto`` and ``optimal``, the exact search, which bounds its own work (EXACT_WORK_CELLS)."""
    from edgeswarm.planning.serve.plan import EXACT_WORK_CELLS

    units, devices = len(cluster.model.units), len(cluster.devices)
    cells = (units + 1) ** 2 * max(1, devices) ** 2
    if options.method in ("auto", "optimal"):
        cells += int(EXACT_WORK_CELLS)
    return WorkEstimate(cells, f"a serving plan of {units} units on {devices} devices ({options.method})",
                        ("plan fewer units or devices", "use method kpath or greedy"))

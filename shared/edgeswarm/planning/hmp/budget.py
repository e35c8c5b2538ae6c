"""How much work an HMP plan request is (see edgeswarm.planning.budget)."""

from __future__ import annotations

from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.hmp.types import HmpCluster, HmpOptions

# A device's share of one prediction: interpolations over its grids and the ring sums (cells).
_PREDICT_CELLS = 64


def estimate_hmp_plan(cluster: HmpCluster, options: HmpOptions, compare: bool = False) -> WorkEstimate:
    """The work of ``plan_hmp``: Algorithm 1 (O(D^3), spec 3.5) and one prediction per device subset tried
    (D of them with ``prune``), for each parallelism compared (four with ``compare`` or mode ``auto``)."""
    d = len(cluster.devices)
    subsets = d if options.prune else 1
    per = subsets * (d**3 + _PREDICT_CELLS * d)
    modes = 4 if compare or options.mode == "auto" else 1
    return WorkEstimate(modes * per, f"an HMP plan of {cluster.model_name or cluster.model.family} on {d} devices",
                        ("plan fewer devices", "turn pruning off"))

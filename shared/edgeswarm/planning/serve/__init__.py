"""Throughput-optimal pipelined inference (the ``serve-pipeline`` workload): pure planners.

The paper's method (Parthasarathy & Krishnamachari, spec ``partition-placement-inference.md``) lives in
``graph`` (linearisation, segments, transfer sizes), ``partition`` (min-total-transfer DP), ``classes``
(bandwidth classes), ``kpath`` (bottleneck k-path) and ``placement`` (class-ordered placement, baselines,
bounds and brute-force optima). ``plan`` is the compute-aware planner for real, profiled clusters.
Nothing here does I/O.
"""

from edgeswarm.planning.serve.types import ServeOptions, ServePlan, ServeStagePlan

__all__ = ["ServeOptions", "ServePlan", "ServeStagePlan"]

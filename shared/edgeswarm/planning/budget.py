"""The planner's time budget: how much work a request is, in *cells*, and the check that refuses one too large.

A cell is the unit of the planners' vectorised inner loops; each workload's planner counts the cells a request
costs from its shape alone before doing any of it (``edgeswarm.planning.hpp.budget``,
``edgeswarm.planning.serve.budget``). The budget in seconds becomes a cap in cells through ``SECONDS_PER_CELL``;
the planner service refuses a request above the cap before starting it, and stops one that runs past the budget
anyway at its deadline (edgeswarm.planning.deadline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgeswarm.errors import PlanTooLargeError

# Seconds per cell on the host the default budget was set for, measured with the HPP search on synthetic
# Env C-like profiles (edgeswarm.planning.synthetic) on a 2-core AMD EPYC VM shared with other jobs, Python 3.11,
# numpy 2: L=213 N=6 B=128 took 0.44 s for 1.57 M cells (2.8e-7 s per cell), L=200 N=12 B=32 5.0 s for 19.5 M
# (2.6e-7), L=80 N=8 B=256 0.17 s for 0.65 M (2.7e-7); small searches pay a fixed overhead per device group
# and run up to 3.2e-7. The constant is rounded up from these so that the estimate errs towards refusing.
# A slower planner host (a Raspberry Pi is several times slower) should lower EDGESWARM_PLAN_TIME_BUDGET_S in
# proportion; the deadline still stops whatever the estimate lets through.
SECONDS_PER_CELL = 3e-7

@dataclass(frozen=True)
class WorkEstimate:
    """The cells a request would cost (``cells``), what they are (``what``) and how to make it smaller
    (``advice``, in order of effect)."""

    cells: int
    what: str
    advice: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        """The predicted planning time at SECONDS_PER_CELL, in seconds."""
        return self.cells * SECONDS_PER_CELL


def work_cap(budget_s: float) -> int:
    """The most cells a budget of ``budget_s`` seconds allows."""
    return math.floor(budget_s / SECONDS_PER_CELL)


def check_budget(estimate: WorkEstimate, budget_s: float) -> None:
    """Raise PlanTooLargeError, saying the estimate, the budget and what to change, when ``estimate`` is more
    than ``budget_s`` seconds of work."""
    cap = work_cap(budget_s)
    if estimate.cells <= cap:
        return
    advice = "; ".join([*estimate.advice, "or give the planner a larger budget (EDGESWARM_PLAN_TIME_BUDGET_S)"])
    raise PlanTooLargeError(
        f"planning {estimate.what} is about {estimate.cells:,} cells of work (~{estimate.seconds:.0f} s at "
        f"{SECONDS_PER_CELL:g} s per cell), over this planner's budget of {budget_s:g} s ({cap:,} cells): {advice}")

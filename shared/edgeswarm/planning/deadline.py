"""A deadline the planners check between their iterations, so that a search whose work was under-estimated
still stops (edgeswarm.planning.budget estimates the work before it starts).

The clock is injectable: tests pass a counter and stop a search after an exact number of iterations, without
depending on how fast the machine is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from edgeswarm.errors import PlanningDeadlineError

Clock = Callable[[], float]


class Deadline:
    """Planning must end by ``at`` on ``clock`` (seconds, by default ``time.monotonic``).

    ``check(where)`` raises PlanningDeadlineError once the clock has passed ``at``; it reads the clock once
    per call and has no other effect, so checking costs next to nothing between iterations.
    """

    def __init__(self, at: float, *, clock: Clock = time.monotonic, budget_s: float | None = None) -> None:
        self.at = at
        self.budget_s = budget_s
        self._clock = clock

    @classmethod
    def after(cls, seconds: float, *, clock: Clock = time.monotonic) -> Deadline:
        """The deadline ``seconds`` from now on ``clock``."""
        return cls(clock() + seconds, clock=clock, budget_s=seconds)

    def check(self, where: str) -> None:
        """Raise PlanningDeadlineError naming ``where`` the planner stopped if the deadline has passed."""
        if self._clock() <= self.at:
            return
        budget = f"its time budget of {self.budget_s:g} s" if self.budget_s is not None else "its deadline"
        raise PlanningDeadlineError(
            f"planning stopped in {where}: it ran past {budget}. Fix the number of micro-batches, plan fewer "
            "units or devices, or give the planner a larger budget (EDGESWARM_PLAN_TIME_BUDGET_S)")


def check(deadline: Deadline | None, where: str) -> None:
    """``deadline.check(where)``, or nothing without a deadline."""
    if deadline is not None:
        deadline.check(where)

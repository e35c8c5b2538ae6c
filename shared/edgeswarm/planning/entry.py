"""What a workload gives the planner service: its request schemas and the pure functions that price and answer them.

The planner service (``services/planner``) is generic: it subscribes every kind's ``requests``, prices a request
with ``estimate`` on the receiving thread (refusing ``too_large`` work at once), and answers it on its worker
thread with ``plan``, within the time budget ``deadline``. A reply's ``planning_s`` (every reply schema has it) is
set by the service to the time ``plan`` took. ``plan`` raises a PlanningError subclass for a request it cannot
answer; the service turns that into PlanFailed. ``describe`` gives the log line of an answered request and
``counter`` the name of the metric it counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.deadline import Deadline
from edgeswarm.wire.schema import Message


@dataclass(frozen=True)
class PlannerEntry:
    """One workload's planning: ``requests`` it answers; ``estimate(request)``; ``plan(request, deadline) ->
    reply``; ``describe(request, reply, seconds) -> str``; ``counter(request) -> str``."""

    requests: tuple[type[Message], ...]
    estimate: Callable[[Any], WorkEstimate]
    plan: Callable[[Any, Deadline], Message]
    describe: Callable[[Any, Any, float], str]
    counter: Callable[[Any], str]

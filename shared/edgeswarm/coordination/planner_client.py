"""The planner client every coordinator program uses: one request to the planner service, asked again while the
planner's queue is full, and every failure turned into a JobError that says what to do."""

from __future__ import annotations

import logging
import time

from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.errors import BusError, JobError
from edgeswarm.messages.planning import PlanFailed
from edgeswarm.wire import Message

log = logging.getLogger(__name__)

PLANNER_NODE = "hub"
PLANNER = "planner"  # the planner's service name
PLAN_TIMEOUT_S = 120.0  # all the asks of one plan together, busy pauses included
PLANNER_BUSY_PAUSE_S = 2.0  # between asks while the planner's queue is full
TOO_LARGE_ADVICE = "Make the job smaller, or run it on fewer devices"


def request_plan(bus: Bus, request: Message, *, what: str, planner_node: str = PLANNER_NODE,
                 timeout_s: float = PLAN_TIMEOUT_S, busy_pause_s: float = PLANNER_BUSY_PAUSE_S,
                 plan_noun: str = "plan", too_large_advice: str = TOO_LARGE_ADVICE) -> Message:
    """Ask the planner service on ``planner_node`` ``request`` and return its reply, which is never a PlanFailed.
    While the planner answers ``busy`` (its queue is full) the request is asked again every ``busy_pause_s``
    seconds. ``what`` names the asker in errors ("job j"), ``plan_noun`` what it asks for ("serving plan"), and
    ``too_large_advice`` says how to make the request smaller when the planner finds it too much work. Raises
    JobError when the planner does not answer or stays busy within ``timeout_s`` seconds in all, or fails the
    request."""
    give_up = time.monotonic() + timeout_s
    while True:
        left = give_up - time.monotonic()
        try:
            reply = bus.request(topics.request(planner_node, PLANNER), request, timeout_s=max(left, 1.0)).body
        except BusError as exc:
            raise JobError(f"{what}: the planner on {planner_node} did not answer: {exc}") from None
        if not (isinstance(reply, PlanFailed) and reply.reason == "busy"):
            break
        if time.monotonic() + busy_pause_s > give_up:
            raise JobError(f"{what}: the planner on {planner_node} stayed busy for {timeout_s:.0f} s "
                           f"({reply.detail}); submit the job again when the planner has caught up")
        log.info("%s: the planner on %s is busy; asking again in %.0f s", what, planner_node, busy_pause_s)
        time.sleep(busy_pause_s)
    if isinstance(reply, PlanFailed):
        if reply.reason == "too_large":
            raise JobError(f"{what}: planning it is too much work for the planner on {planner_node}: "
                           f"{reply.detail}. {too_large_advice}")
        raise JobError(f"{what}: no {plan_noun} ({reply.reason}): {reply.detail}")
    return reply

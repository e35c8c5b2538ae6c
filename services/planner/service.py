"""The planner: answers every job kind's plan requests over MQTT with versioned plans.

A thin adapter over each workload's planner (``workload.planner``, a ``planning.entry.PlannerEntry``: the request
schemas it answers and pure functions to price and answer them). HPP training's PlanRequest on
``edgeswarm/node/{node}/planner/request`` is answered with a PlanReply (the plan, optionally the baselines), its
ReplanRequest with the lightweight re-plan (or, when asked, the full planner on the surviving devices), serving's
ServePlanRequest with a ServePlanReply; a request with no plan gets a PlanFailed saying why.

Planning can take seconds, so it never runs on the thread that receives requests (and answers probes on the
same topic): a request is first priced (edgeswarm.planning.budget) and refused ``too_large`` at once if it is
more work than EDGESWARM_PLAN_TIME_BUDGET_S allows; otherwise it is queued (at most ``MAX_QUEUED``
waiting, beyond that it is refused ``busy``) and planned in order by one worker thread, which drops requests
that expired while they waited and stops a search that runs past the budget (``too_large`` as well).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.errors import (
    ConfigError,
    EdgeswarmError,
    InfeasiblePlanError,
    PlanningError,
    PlanTooLargeError,
    ProfileError,
)
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.planning import PlanFailed, PlanFailureReason
from edgeswarm.planning.budget import WorkEstimate, check_budget
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.entry import PlannerEntry
from edgeswarm.plugins import load_target
from edgeswarm.queue_worker import QueueWorker
from edgeswarm.runtime.service import Service
from edgeswarm.wire import Message
from edgeswarm.workloads import KINDS, installed_workload

log = logging.getLogger(__name__)

# Requests waiting while one is planned. Each holds a validated profile (up to the schema's 16 MiB), and with
# the default budget eight of them are already minutes of work: a requester should hear "busy" rather than
# time out in the queue.
MAX_QUEUED = 8


@dataclass(frozen=True)
class _Job:
    msg: Inbound
    entry: PlannerEntry
    estimate: WorkEstimate


def planner_entries() -> dict[type[Message], PlannerEntry]:
    """Every installed kind's planner, by the request schemas it answers. Raises ConfigError for a kind whose
    planner cannot be loaded, or two kinds answering the same schema."""
    out: dict[type[Message], PlannerEntry] = {}
    for kind in KINDS:
        work = installed_workload(kind)
        if work is None or not work.planner:
            continue
        entry = load_target(work.planner, f"the planner of job kind {kind!r}")
        for schema in entry.requests:
            if schema in out and out[schema] is not entry:
                raise ConfigError(f"two job kinds answer {schema.__name__}: give each kind its own request schema")
            out[schema] = entry
    return out


class PlannerService(Service):
    name = "planner"

    def setup(self) -> None:
        self._budget_s = self.settings.plan_time_budget_s
        self._jobs: QueueWorker[_Job] = QueueWorker("planner-worker", MAX_QUEUED, self._serve, self.metrics,
                                                    failed=lambda job, exc: self._unexpected(job.msg, exc),
                                                    depth_gauge="plan_queue_depth")
        # Refusals and failures are triggered by whoever sends requests: their log lines are rate-limited.
        self._refusals = RateLimitedLog(log, what="refusals")
        self._entries = planner_entries()
        request = topics.request(self.node, self.name)
        self.bus.subscribe(request, self._on_request, schemas=tuple(self._entries))
        log.info("planning with a time budget of %g s per request, at most %d requests waiting", self._budget_s,
                 MAX_QUEUED)

    def teardown(self) -> None:
        self._jobs.stop()

    # --- the receiving thread: price, refuse or queue; never plan here --------------------------------

    def _on_request(self, msg: Inbound) -> None:
        entry = self._entries[type(msg.body)]  # the subscription's schema filter let only these through
        try:
            estimate = entry.estimate(msg.body)
            check_budget(estimate, self._budget_s)
        except PlanningError as exc:
            self._fail(msg, exc)
            return
        except Exception as exc:  # a bug in the estimate: the requester still hears why, and the handler goes on
            self._unexpected(msg, exc)
            return
        if not self._jobs.offer(_Job(msg, entry, estimate)):
            self._refuse(msg, "busy", f"the planner on {self.node} already has {MAX_QUEUED} requests waiting; "
                                      "try again later")

    # --- the worker thread ----------------------------------------------------------------------------

    def _serve(self, job: _Job) -> None:
        msg = job.msg
        expires_at = msg.envelope.expires_at
        if expires_at is not None and time.time() > expires_at:
            self.metrics.count("expired")
            self._refusals.warning("expired", "dropping %s from %s: it expired while it waited",
                                   msg.envelope.schema_name, msg.sender)
            return
        log.debug("planning %s from %s: about %d cells", job.estimate.what, msg.sender, job.estimate.cells)
        # The budget counts from the start of planning, not from arrival: waiting in the queue is not work.
        deadline = Deadline.after(self._budget_s)
        started = time.perf_counter()
        try:
            answer = job.entry.plan(msg.body, deadline)
        except PlanningError as exc:
            self._fail(msg, exc)
            return
        elapsed = time.perf_counter() - started
        self.metrics.count(job.entry.counter(msg.body))
        log.info("%s", job.entry.describe(msg.body, answer, elapsed))
        self._answer(msg, answer.model_copy(update={"planning_s": elapsed}))

    # --- answers --------------------------------------------------------------------------------------

    def _unexpected(self, msg: Inbound, exc: Exception) -> None:
        """Count, log (rate-limited, with the traceback) and answer ``error``; never raises."""
        self.metrics.count("handler_errors")
        try:
            self._refusals.log(logging.ERROR, "error", "a request from %s failed unexpectedly", msg.sender,
                               exc_info=True)
            self._refuse(msg, "error", f"the planner failed unexpectedly: {type(exc).__name__}: {exc}")
        except Exception:  # the answer itself failed: nothing more can be done for this request
            log.debug("could not answer a failed request", exc_info=True)

    def _fail(self, msg: Inbound, exc: PlanningError) -> None:
        reason: PlanFailureReason = (
            "too_large" if isinstance(exc, PlanTooLargeError)
            else "infeasible" if isinstance(exc, InfeasiblePlanError)
            else "bad_profile" if isinstance(exc, ProfileError) else "bad_request")
        self._refuse(msg, reason, str(exc))

    def _refuse(self, msg: Inbound, reason: PlanFailureReason, detail: str) -> None:
        self.metrics.count(f"plan_failed.{reason}")
        self._refusals.warning(reason, "no plan for %s (%s): %s", msg.sender, reason, detail)
        self._answer(msg, PlanFailed(reason=reason, detail=detail[:4096]))

    def _answer(self, msg: Inbound, answer: Message) -> None:
        try:
            self.bus.reply(msg, answer)
        except EdgeswarmError as exc:
            self._refusals.warning("unanswered", "could not answer %s: %s", msg.sender, exc)

"""The planner: answers plan and re-plan requests over MQTT with versioned plans.

A thin adapter over edgeswarm.planning: a PlanRequest on ``edgeswarm/node/{node}/planner/request`` is
answered with a PlanReply (the plan, optionally the baselines) or a PlanFailed saying why there is no plan;
a ReplanRequest with the lightweight re-plan (or, when asked, the full planner on the surviving devices).

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
from edgeswarm.errors import EdgeswarmError, InfeasiblePlanError, PlanningError, PlanTooLargeError, ProfileError
from edgeswarm.logs import RateLimitedLog
from edgeswarm.messages.planning import (
    PlanFailed,
    PlanFailureReason,
    PlanReply,
    PlanRequest,
    ReplanRequest,
    ServePlanReply,
    ServePlanRequest,
)
from edgeswarm.planning.budget import WorkEstimate, check_budget
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.hpp.budget import estimate_plan, estimate_replan
from edgeswarm.planning.hpp.compare import compare, plan_best
from edgeswarm.planning.hpp.replan import heavy_replan, light_replan
from edgeswarm.planning.serve.budget import estimate_serve_plan
from edgeswarm.planning.serve.plan import plan_serving
from edgeswarm.queue_worker import QueueWorker
from edgeswarm.runtime.service import Service
from edgeswarm.wire import Message

log = logging.getLogger(__name__)

# Requests waiting while one is planned. Each holds a validated profile (up to the schema's 16 MiB), and with
# the default budget eight of them are already minutes of work: a requester should hear "busy" rather than
# time out in the queue.
MAX_QUEUED = 8


@dataclass(frozen=True)
class _Job:
    msg: Inbound
    estimate: WorkEstimate


class PlannerService(Service):
    name = "planner"

    def setup(self) -> None:
        self._budget_s = self.settings.plan_time_budget_s
        self._jobs: QueueWorker[_Job] = QueueWorker("planner-worker", MAX_QUEUED, self._serve, self.metrics,
                                                    failed=lambda job, exc: self._unexpected(job.msg, exc),
                                                    depth_gauge="plan_queue_depth")
        # Refusals and failures are triggered by whoever sends requests: their log lines are rate-limited.
        self._refusals = RateLimitedLog(log, what="refusals")
        request = topics.request(self.node, self.name)
        self.bus.subscribe(request, self._on_request, schemas=(PlanRequest, ReplanRequest, ServePlanRequest))
        log.info("planning with a time budget of %g s per request, at most %d requests waiting", self._budget_s,
                 MAX_QUEUED)

    def teardown(self) -> None:
        self._jobs.stop()

    # --- the receiving thread: price, refuse or queue; never plan here --------------------------------

    def _on_request(self, msg: Inbound) -> None:
        req = msg.body
        try:
            if isinstance(req, PlanRequest):
                estimate = estimate_plan(req.cluster, req.global_batch, micro_batches=req.micro_batches,
                                         strategy=req.strategy, compare=req.compare)
            elif isinstance(req, ServePlanRequest):
                estimate = estimate_serve_plan(req.cluster, req.options)
            else:
                assert isinstance(req, ReplanRequest)  # guaranteed by the subscription's schema filter
                estimate = estimate_replan(req.plan, req.cluster, req.failed, heavy=req.heavy)
            check_budget(estimate, self._budget_s)
        except PlanningError as exc:
            self._fail(msg, exc)
            return
        except Exception as exc:  # a bug in the estimate: the requester still hears why, and the handler goes on
            self._unexpected(msg, exc)
            return
        if not self._jobs.offer(_Job(msg, estimate)):
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
            if isinstance(msg.body, ServePlanRequest):
                served = plan_serving(msg.body.cluster, msg.body.options)
                elapsed = time.perf_counter() - started
                self.metrics.count("serve_plans")
                log.info("planned serving %s on %d devices in %.2f s: %d stages, %.1f samples/s predicted (epoch %d)",
                         msg.body.cluster.model.model.name, len(msg.body.cluster.devices), elapsed,
                         len(served.stages), served.throughput_per_s, msg.body.epoch)
                self._answer(msg, ServePlanReply(plan=served.model_copy(update={"epoch": msg.body.epoch}),
                                                 planning_s=elapsed))
                return
            if isinstance(msg.body, PlanRequest):
                answer = self._plan(msg.body, deadline)
            else:
                assert isinstance(msg.body, ReplanRequest)
                answer = self._replan(msg.body, deadline)
        except PlanningError as exc:
            self._fail(msg, exc)
            return
        elapsed = time.perf_counter() - started
        plan = answer.plan
        if isinstance(msg.body, PlanRequest):
            self.metrics.count("plans")
            log.info("planned %s for %s on %d devices in %.2f s: %d stages, %.3f s per round (epoch %d)",
                     plan.strategy, msg.body.cluster.model.model.name, len(msg.body.cluster.devices), elapsed,
                     len(plan.stages), plan.round_latency_s, plan.epoch)
        else:
            self.metrics.count("replans")
            log.info("re-planned without %s (%s) in %.3f s: epoch %d, %d stages", msg.body.failed,
                     "heavy" if msg.body.heavy else "light", elapsed, plan.epoch, len(plan.stages))
        self._answer(msg, answer.model_copy(update={"planning_s": elapsed}))

    @staticmethod
    def _plan(req: PlanRequest, deadline: Deadline) -> PlanReply:
        if req.compare:
            comparison = compare(req.cluster, req.global_batch, micro_batches=req.micro_batches,
                                 optimizer=req.optimizer, deadline=deadline)
            plan, extra = comparison.hpp, comparison
        else:
            plan = plan_best(req.strategy, req.cluster, req.global_batch, micro_batches=req.micro_batches,
                             optimizer=req.optimizer, deadline=deadline)
            extra = None
        return PlanReply(plan=plan.model_copy(update={"epoch": req.epoch}), comparison=extra, planning_s=0.0)

    @staticmethod
    def _replan(req: ReplanRequest, deadline: Deadline) -> PlanReply:
        replan = heavy_replan if req.heavy else light_replan
        return PlanReply(plan=replan(req.plan, req.cluster, req.failed, deadline=deadline), planning_s=0.0)

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

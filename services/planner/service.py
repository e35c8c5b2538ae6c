"""The planner: answers plan and re-plan requests over MQTT with versioned plans.

A thin adapter over edgeswarm.planning: a PlanRequest on ``edgeswarm/node/{node}/planner/request`` is
answered with a PlanReply (the plan, optionally the baselines) or a PlanFailed saying why there is no plan;
a ReplanRequest with the lightweight re-plan (or, when asked, the full planner on the surviving devices).
"""

from __future__ import annotations

import logging
import time

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.errors import InfeasiblePlanError, PlanningError, ProfileError
from edgeswarm.messages.planning import PlanFailed, PlanReply, PlanRequest, ReplanRequest
from edgeswarm.planning.compare import compare, plan_best
from edgeswarm.planning.replan import heavy_replan, light_replan
from edgeswarm.runtime.service import Service

log = logging.getLogger(__name__)


class PlannerService(Service):
    name = "planner"

    def setup(self) -> None:
        request = topics.request(self.node, self.name)
        self.bus.subscribe(request, self._on_plan, schemas=(PlanRequest,))
        self.bus.subscribe(request, self._on_replan, schemas=(ReplanRequest,))

    def _on_plan(self, msg: Inbound) -> None:
        req = msg.body
        assert isinstance(req, PlanRequest)
        started = time.perf_counter()
        try:
            if req.compare:
                comparison = compare(req.cluster, req.global_batch, micro_batches=req.micro_batches,
                                     optimizer=req.optimizer)
                plan, extra = comparison.hpp, comparison
            else:
                plan = plan_best(req.strategy, req.cluster, req.global_batch, micro_batches=req.micro_batches,
                                 optimizer=req.optimizer)
                extra = None
        except PlanningError as exc:
            self._fail(msg, exc)
            return
        plan = plan.model_copy(update={"epoch": req.epoch})
        elapsed = time.perf_counter() - started
        self.metrics.count("plans")
        log.info("planned %s for %s on %d devices in %.2f s: %d stages, %.3f s per round (epoch %d)", plan.strategy,
                 req.cluster.model.model.name, len(req.cluster.devices), elapsed, len(plan.stages),
                 plan.round_latency_s, plan.epoch)
        self.bus.reply(msg, PlanReply(plan=plan, comparison=extra, planning_s=elapsed))

    def _on_replan(self, msg: Inbound) -> None:
        req = msg.body
        assert isinstance(req, ReplanRequest)
        started = time.perf_counter()
        try:
            replan = heavy_replan if req.heavy else light_replan
            plan = replan(req.plan, req.cluster, req.failed)
        except PlanningError as exc:
            self._fail(msg, exc)
            return
        elapsed = time.perf_counter() - started
        self.metrics.count("replans")
        log.info("re-planned without %s (%s) in %.3f s: epoch %d, %d stages", req.failed,
                 "heavy" if req.heavy else "light", elapsed, plan.epoch, len(plan.stages))
        self.bus.reply(msg, PlanReply(plan=plan, planning_s=elapsed))

    def _fail(self, msg: Inbound, exc: PlanningError) -> None:
        reason = ("infeasible" if isinstance(exc, InfeasiblePlanError)
                  else "bad_profile" if isinstance(exc, ProfileError) else "bad_request")
        self.metrics.count(f"plan_failed.{reason}")
        log.warning("no plan for %s: %s", msg.sender, exc)
        self.bus.reply(msg, PlanFailed(reason=reason, detail=str(exc)[:4096]))

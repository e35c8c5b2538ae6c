"""The stage-worker: one per device. It runs the programs registered below for every job it takes part in.

The service only subscribes, routes and answers what no program takes: each request on its request topic and each
tensor on its data-plane topic goes to the program registered for the message's schema, and the program routes it
to the job it names (``runtime.program``). Each workload's program lives with its workload: training
(``edgeswarm.training.stage_program.TrainingProgram``: StageAssign, RoundStart and the rest) and forward-only
serving (``edgeswarm.serving.stage.ServeStageProgram``: ServeAssign, ServeRelease and ServeTensor); a new
workload's is registered by adding it to ``_programs``. A job id belongs to one program at a time: a request of
one program for a job another program holds is refused.

Programs share the process's ``ComputeGate`` (building a model holds it alone: torch.fx tracing patches
``Module.__call__`` for every thread), and nothing else: rounds of different jobs run at the same time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.runtime.program import STAGE_WORKER, ComputeGate, WorkerContext, WorkerProgram
from edgeswarm.runtime.service import Service
from edgeswarm.serving.stage import ServeStageProgram
from edgeswarm.training.stage_program import TrainingProgram

log = logging.getLogger(__name__)

WAIT_S = 120.0  # longest wait for one tensor or unit state from a peer before the round or restore fails


class StageWorkerService(Service):
    name = STAGE_WORKER
    computes = True

    def setup(self) -> None:
        assert self.compute_name is not None  # resolved when the service was made (computes)
        context = WorkerContext(bus=self.bus, node=self.node, service=self.name, device=self.device,
                                metrics=self.metrics, gate=ComputeGate(), compute_name=self.compute_name)
        # The registry: one program per workload (read WAIT_S now, so a test may shorten it before setup).
        self._programs: list[WorkerProgram] = [TrainingProgram(context, wait_s=WAIT_S),
                                               ServeStageProgram(context)]
        request = topics.request(self.node, self.name)
        data = topics.data(self.node, self.name)
        for program in self._programs:
            self.bus.subscribe(request, partial(self._route, program, program.on_request), schemas=program.handles)
            if program.tensors:
                self.bus.subscribe(data, partial(self._route, program, program.on_tensor), schemas=program.tensors,
                                   plane="data")

    def teardown(self) -> None:
        for program in self._programs:
            program.close()

    def _route(self, program: WorkerProgram, handler: Callable[[Inbound], None], msg: Inbound) -> None:
        """Hand ``msg`` to ``program`` unless its job belongs to another program (a request is then refused; a
        tensor dropped)."""
        job_id = program.job_of(msg.body)
        other = next((p for p in self._programs if p is not program and p.holds(job_id)), None)
        if other is not None:
            self.metrics.count("requests_refused.job_kind")
            detail = (f"{self.node} holds job {job_id} as {type(other).__name__}, not {type(program).__name__}: "
                      f"a {type(msg.body).__name__} does not apply to it")
            log.error("%s from %s: %s", type(msg.body).__name__, msg.sender, detail)
            if handler == program.on_request:
                program.refuse(msg, job_id, "bad_request", detail)
            return
        handler(msg)

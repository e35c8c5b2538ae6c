"""The stage-worker: one per device. It hosts the worker programs of the job kinds whose stages run on devices.

Everything is ``edgeswarm.workloads.worker_host.WorkerService``: the programs come from the kinds that name this
service (training's ``TrainingProgram``, serving's ``ServeStageProgram``: ``Workload.worker_program``), and the host
routes each message to its program and keeps a job to one program.
"""

from __future__ import annotations

from edgeswarm.service_registry import STAGE_WORKER
from edgeswarm.workloads.worker_host import WorkerService

WAIT_S = 120.0  # longest wait for one tensor or unit state from a peer before the round or restore fails


class StageWorkerService(WorkerService):
    name = STAGE_WORKER

    def peer_wait_s(self) -> float:
        return WAIT_S  # read at setup, so a test may shorten it before

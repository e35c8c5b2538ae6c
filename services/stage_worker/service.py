"""The stage-worker: one per device. It hosts the worker programs of the job kinds whose stages run on devices.

Everything is ``edgeswarm.workloads.worker_host.WorkerService``: the programs come from the kinds that name this
service (training's ``TrainingProgram``, serving's ``ServeStageProgram``: ``Workload.worker_program``), and the host
routes each message to its program and keeps a job to one program.
"""

from __future__ import annotations

from edgeswarm.service_registry import STAGE_WORKER
from edgeswarm.workloads.worker_host import WorkerService


class StageWorkerService(WorkerService):
    name = STAGE_WORKER

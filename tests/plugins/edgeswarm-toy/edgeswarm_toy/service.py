"""The toy-worker service: edgeswarm's worker host with the programs of the kinds it hosts (the toy's)."""

from __future__ import annotations

from edgeswarm.workloads.worker_host import WorkerService
from edgeswarm_toy.spec import WORKER


class ToyWorkerService(WorkerService):
    name = WORKER

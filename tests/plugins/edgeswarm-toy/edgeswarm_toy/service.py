"""The toy-worker service: edgeswarm's worker host with the programs of the kinds it hosts (the toy's)."""

from __future__ import annotations

from edgeswarm.runtime.worker_host import WorkerService
from edgeswarm.service_registry import ServiceEntry
from edgeswarm_toy.spec import WORKER


class ToyWorkerService(WorkerService):
    name = WORKER


ENTRY = ServiceEntry(target="edgeswarm_toy.service:ToyWorkerService", role="device")

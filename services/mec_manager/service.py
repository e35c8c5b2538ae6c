"""The mec-manager: one per edge server (MEC). It hosts the programs of the job kinds that train a server half for
devices (SmartSplit's ``train-splitfed``: ``edgeswarm.splitfed.mec.MecProgram``); the generic worker host does the
rest."""

from __future__ import annotations

from edgeswarm.service_registry import MEC_MANAGER
from edgeswarm.workloads.worker_host import WorkerService


class MecManagerService(WorkerService):
    name = MEC_MANAGER

"""The tensor-shard-worker: one per device. It hosts the programs of the job kinds that split every layer across
devices (Galaxy's ``serve-hmp``: ``edgeswarm.hmp.worker.ShardProgram``); the generic worker host does the rest."""

from __future__ import annotations

from edgeswarm.service_registry import TENSOR_SHARD_WORKER
from edgeswarm.workloads.worker_host import WorkerService


class TensorShardWorkerService(WorkerService):
    name = TENSOR_SHARD_WORKER

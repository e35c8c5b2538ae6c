"""Every control message schema. Importing this package registers them all with the wire codec."""

from edgeswarm.messages.bench import BenchAck, BenchData, BenchEcho, BenchEchoReply, BenchStart
from edgeswarm.messages.checkpoints import (
    CheckpointCommit,
    CheckpointFailed,
    CheckpointList,
    CheckpointListing,
    CheckpointLoad,
    CheckpointLoaded,
    CheckpointMissing,
    CheckpointSaved,
    CheckpointTensor,
    StageVersions,
)
from edgeswarm.messages.cluster import ClusterEvent, ClusterView, NodeView, ServiceView
from edgeswarm.messages.jobs import JobAccepted, JobCancel, JobEvent, JobRejected, JobState, JobSubmit
from edgeswarm.messages.liveness import Heartbeat, Probe, ProbeReply, Status
from edgeswarm.messages.metrics import MetricsReport
from edgeswarm.messages.planning import PlanFailed, PlanReply, PlanRequest, ReplanRequest
from edgeswarm.messages.profiling import LinkProbe, ProfileFailed, ProfileProgress, ProfileReport, ProfileRequest
from edgeswarm.messages.training import (
    RoundDone,
    RoundStart,
    StageAbort,
    StageAssign,
    StageFailed,
    StageReady,
    StageSave,
    StageSaved,
    StageTensor,
)

__all__ = [
    "BenchAck",
    "BenchData",
    "BenchEcho",
    "BenchEchoReply",
    "BenchStart",
    "CheckpointCommit",
    "CheckpointFailed",
    "CheckpointList",
    "CheckpointListing",
    "CheckpointLoad",
    "CheckpointLoaded",
    "CheckpointMissing",
    "CheckpointSaved",
    "CheckpointTensor",
    "ClusterEvent",
    "ClusterView",
    "Heartbeat",
    "JobAccepted",
    "JobCancel",
    "JobEvent",
    "JobRejected",
    "JobState",
    "JobSubmit",
    "LinkProbe",
    "MetricsReport",
    "NodeView",
    "PlanFailed",
    "PlanReply",
    "PlanRequest",
    "Probe",
    "ProbeReply",
    "ProfileFailed",
    "ProfileProgress",
    "ProfileReport",
    "ProfileRequest",
    "ReplanRequest",
    "RoundDone",
    "RoundStart",
    "ServiceView",
    "StageAbort",
    "StageAssign",
    "StageFailed",
    "StageReady",
    "StageSave",
    "StageSaved",
    "StageTensor",
    "StageVersions",
    "Status",
]

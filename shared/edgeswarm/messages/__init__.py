"""Every control message schema. Importing this package registers them all with the wire codec."""

from edgeswarm.messages.bench import BenchAck, BenchData, BenchEcho, BenchEchoReply, BenchStart
from edgeswarm.messages.cluster import ClusterEvent, ClusterView, NodeView, ServiceView
from edgeswarm.messages.liveness import Heartbeat, Probe, ProbeReply, Status
from edgeswarm.messages.metrics import MetricsReport

__all__ = [
    "BenchAck",
    "BenchData",
    "BenchEcho",
    "BenchEchoReply",
    "BenchStart",
    "ClusterEvent",
    "ClusterView",
    "Heartbeat",
    "MetricsReport",
    "NodeView",
    "Probe",
    "ProbeReply",
    "ServiceView",
    "Status",
]

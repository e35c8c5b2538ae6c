"""The coordinator's view of the cluster and the events it publishes when the view changes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.wire.schema import MIB, Message, Name, schema

ServiceState = Literal["online", "suspect", "offline"]


class ServiceView(BaseModel):
    """One service instance as the membership sees it. Ages are seconds; None means never heard."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    service: Name
    instance: Name
    state: ServiceState
    version: str
    host: str
    pid: int
    data_url: str
    heartbeat_age_s: float | None
    started_at: float
    reason: str | None = None


class NodeView(BaseModel):
    """One node: its device class, memory (bytes) and services. ``state`` is its best service's state; ``compute``
    the device its computing services run on ("cpu", "cuda:0 (...)"; empty when none of them says).
    ``free_memory_bytes`` is the budget less what the best service's process uses; ``reserved_memory_bytes`` what the
    node's memory ledger holds for the jobs of every program on the node (``runtime.ledger``), the most any of its
    live services reports (0 in views from before the field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: Name
    state: ServiceState
    device_class: str
    memory_budget_bytes: int = Field(ge=0)
    free_memory_bytes: int = Field(ge=0)
    services: tuple[ServiceView, ...]
    conflicts: tuple[str, ...] = ()
    compute: str = Field(default="", max_length=128)
    reserved_memory_bytes: int = Field(default=0, ge=0)


@schema("edgeswarm.cluster_view", 1)
class ClusterView(Message):
    """Retained on ``edgeswarm/cluster/view`` by the coordinator. ``generated_at`` is Unix seconds."""

    MAX_BYTES = 4 * MIB

    generated_at: float
    heartbeat_timeout_factor: float = Field(gt=0)
    nodes: tuple[NodeView, ...]

    def node(self, node_id: str) -> NodeView | None:
        """The node called ``node_id``, or None."""
        return next((n for n in self.nodes if n.node == node_id), None)


@schema("edgeswarm.cluster_event", 1)
class ClusterEvent(Message):
    """A change in membership: the coordinator's on ``edgeswarm/cluster/events`` (hub only), a service's about its
    own node on ``edgeswarm/node/{node}/{service}/events`` (``node`` is the writer's own)."""

    kind: Literal["service_online", "service_suspect", "service_offline", "duplicate_node"]
    node: Name
    service: Name
    instance: Name
    detail: str
    at: float

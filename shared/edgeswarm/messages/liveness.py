"""Liveness messages: the retained status, the periodic heartbeat, and the health probe."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeswarm.wire.schema import Message, Name, schema


@schema("edgeswarm.status", 1)
class Status(Message):
    """Retained on ``edgeswarm/node/{node}/{service}/status``; the Last Will sets ``state=offline``.

    ``data_url`` is the broker that tensors for this service must be published to (DESIGN.md
    principle 3). Memory figures are bytes (the accelerator's when the service computes on CUDA);
    ``heartbeat_interval_s`` is seconds. ``compute`` is the device the service computes on ("cpu",
    "cuda:0 (NVIDIA ...)"), empty for a service that does not compute (and in statuses from before the field). The
    strings are bounded because the coordinator keeps every status it accepts and republishes it in the cluster
    view. ``reserved_memory_bytes`` is what the node's memory ledger holds for every program on the node (bytes; 0
    for a service that does not report it, and in statuses from before the field); the service re-announces its
    status when it changes.
    """

    state: Literal["online", "offline"]
    node: Name
    service: Name
    instance: Name
    version: str = Field(max_length=64)
    host: str = Field(max_length=255)
    pid: int
    device_class: str = Field(max_length=128)
    memory_budget_bytes: int = Field(ge=0)
    free_memory_bytes: int = Field(ge=0)
    data_url: str = Field(max_length=512)
    heartbeat_interval_s: float = Field(gt=0)
    started_at: float
    reason: str | None = Field(default=None, max_length=512)
    compute: str = Field(default="", max_length=128)
    reserved_memory_bytes: int = Field(default=0, ge=0)


@schema("edgeswarm.heartbeat", 1)
class Heartbeat(Message):
    """Published every ``interval_s`` seconds, retained with an expiry of a few intervals."""

    node: Name
    service: Name
    instance: Name
    seq: int = Field(ge=0)
    interval_s: float = Field(gt=0)
    uptime_s: float = Field(ge=0)
    free_memory_bytes: int = Field(ge=0)
    inbox_depth: int = Field(ge=0)


@schema("edgeswarm.probe", 1)
class Probe(Message):
    """"Are you alive and healthy?", sent as a request to ``edgeswarm/node/{node}/{service}/request``."""


@schema("edgeswarm.probe_reply", 1)
class ProbeReply(Message):
    """The answer to a Probe. ``healthy`` is false when the service's inbox is saturated."""

    node: Name
    service: Name
    instance: Name
    healthy: bool
    uptime_s: float = Field(ge=0)
    inbox_depth: int = Field(ge=0)
    handler_errors: int = Field(ge=0)
    rejected: int = Field(ge=0)
    detail: str = ""


@schema("edgeswarm.rejected", 1)
class RequestRejected(Message):
    """The answer to a request the receiving bus could not take: dropped because the service's inbox was full
    (``overflow``), or refused before any handler saw it (``invalid_message``, ``unknown_schema``,
    ``unsupported_version``, ``unexpected_schema``, ``too_large``, ``forged_sender``, ...). Sent, rate-limited,
    only to a valid ``reply_to`` of the requester's own node."""

    reason: str = Field(max_length=64)
    detail: str = Field(default="", max_length=1024)

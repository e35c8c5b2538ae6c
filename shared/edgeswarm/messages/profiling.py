"""Messages of the profiler: requests, progress, reports, failures and link probes.

A ProfileRequest goes to ``edgeswarm/node/{node}/profiler/request``; the profiler answers it with a
ProfileReport (also retained on ``edgeswarm/node/{node}/profiler/profile/{model_fingerprint}``) or a
ProfileFailed, and publishes ProfileProgress events on ``edgeswarm/node/{node}/profiler/progress``
while it works. LinkProbe carries the tensors of link measurements on the profilers' data topics.
Sizes are bytes, times seconds, bandwidths bytes per second.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeswarm.values.limits import MAX_BATCH_GRID
from edgeswarm.values.profiles import DeviceProfileEntry, LinkProfile, ModelProfile, ModelSpec
from edgeswarm.wire.schema import MIB, Message, Name, schema

ProfileMethod = Literal["calibrated", "measured"]

MAX_PEERS = 256


@schema("edgeswarm.profile.request", 1)
class ProfileRequest(Message):
    """Request: profile ``model`` on this node at ``batch_sizes`` and measure the links to ``peers``.

    ``batch_sizes`` should be ascending, distinct and at least 1; the profiler answers anything else
    (and an unknown model) with a ProfileFailed rather than dropping it. ``method`` is ``calibrated``
    (time the host once, scale by the device's measured speed ratio) or ``measured`` (time every unit
    on the device). ``peers`` are node ids whose profilers this node measures links to (its own id is
    skipped). ``request_id`` is echoed in every progress event and in the answer.
    """

    request_id: str = Field(min_length=1, max_length=64)
    model: ModelSpec
    batch_sizes: list[int] = Field(min_length=1, max_length=MAX_BATCH_GRID)
    method: ProfileMethod = "calibrated"
    peers: list[Name] = Field(default_factory=list, max_length=MAX_PEERS)


@schema("edgeswarm.profile.progress", 1)
class ProfileProgress(Message):
    """How far the profiler on ``node`` is with request ``request_id``: ``fraction`` in [0, 1]."""

    request_id: str
    node: Name
    fraction: float = Field(ge=0.0, le=1.0)
    message: str = Field(max_length=512)


@schema("edgeswarm.profile.report", 1)
class ProfileReport(Message):
    """A node's profile of one model: the reply to a ProfileRequest, also retained per model.

    ``entry`` is the device (node, class, fingerprint, memory budget, measured FLOP/s) and its
    per-unit timings; ``model`` the device-independent layer sequence; ``links`` the links measured
    from this node to the request's peers; ``cache_hit`` says the timings came from the profile cache
    without measuring; ``elapsed_s`` is how long the request took.
    """

    MAX_BYTES = 4 * MIB

    request_id: str
    node: Name
    entry: DeviceProfileEntry
    model: ModelProfile
    links: list[LinkProfile] = Field(default_factory=list)
    cache_hit: bool = False
    elapsed_s: float = Field(default=0.0, ge=0.0)

    def own_links(self) -> list[LinkProfile]:
        """The links this report may speak for: those from its own node to another (a node measures only its own)."""
        return [link for link in self.links if link.src == self.node and link.dst != self.node]


ProfileFailureReason = Literal["bad_request", "busy", "link", "error"]


@schema("edgeswarm.profile.failed", 1)
class ProfileFailed(Message):
    """The answer to a ProfileRequest that could not be served, with a human-readable ``detail``.

    ``reason``: ``bad_request`` (unknown model, bad config or batch sizes), ``busy`` (too many
    requests queued), ``link`` (a peer's link could not be measured) or ``error`` (anything else).
    """

    request_id: str
    node: Name
    reason: ProfileFailureReason
    detail: str = Field(max_length=4096)


LinkProbeKind = Literal["ping", "pong", "bulk", "bulk_ack"]


@schema("edgeswarm.profile.link_probe", 1)
class LinkProbe(Message):
    """One tensor of a link measurement, on a profiler's data topic; always carries a tensor.

    ``ping``: a small tensor the receiving profiler sends straight back as a ``pong`` (same
    ``probe_id``, same tensor) to the sender's profiler. ``bulk``: a large tensor; the receiver answers
    with a ``bulk_ack`` carrying a one-byte tensor and ``received_bytes``, the bulk tensor's size.
    """

    probe_id: str = Field(min_length=1, max_length=64)
    kind: LinkProbeKind
    received_bytes: int = Field(default=0, ge=0)

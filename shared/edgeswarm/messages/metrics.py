"""The periodic metrics report every service publishes."""

from __future__ import annotations

from pydantic import Field

from edgeswarm.wire.schema import Message, Name, schema


@schema("edgeswarm.metrics", 1)
class MetricsReport(Message):
    """Published on ``edgeswarm/node/{node}/{service}/metrics``.

    ``counters`` are totals since start (for example ``rejected.checksum``, ``handler_errors``,
    ``bytes_out``); ``gauges`` are current values (for example ``inbox_depth``, ``reassembly_bytes``).
    """

    MAX_BYTES = 256 * 1024

    node: Name
    service: Name
    instance: Name
    uptime_s: float = Field(ge=0)
    counters: dict[str, int]
    gauges: dict[str, float]

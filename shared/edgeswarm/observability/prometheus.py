"""PLACEHOLDER (issue 24 interface; the metrics work replaces the body, keeping the signatures)."""

from __future__ import annotations

from edgeswarm.bus import Bus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusCollector:
    """The cluster's metrics as Prometheus families, from what the services publish on the hub."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    def start(self) -> None:
        """Subscribe to what the metrics are made of."""

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text exposition format (``CONTENT_TYPE``)."""
        return b""

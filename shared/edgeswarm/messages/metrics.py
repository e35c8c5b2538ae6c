"""The periodic metrics report every service publishes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edgeswarm.wire.schema import Message, Name, schema

MAX_HISTOGRAMS = 128  # series in one report (``edgeswarm.metrics.Metrics`` keeps no more)
MAX_BUCKETS = 32  # bounds of one histogram, +Inf not counted
MAX_METRIC_NAME = 160  # characters of an internal name (a prefix and a job name, say)


class Histogram(BaseModel):
    """Observations of one internal histogram since the service started: ``bounds`` are the finite bucket upper
    bounds, strictly ascending (+Inf is implicit: its count is ``count``); ``counts[i]`` is how many observations
    were at most ``bounds[i]`` (cumulative, so never decreasing and at most ``count``); ``sum`` is their total."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    bounds: tuple[float, ...] = Field(min_length=1, max_length=MAX_BUCKETS)
    counts: tuple[int, ...] = Field(min_length=1, max_length=MAX_BUCKETS)
    sum: float
    count: int = Field(ge=0)

    @model_validator(mode="after")
    def _monotone(self) -> Histogram:
        if len(self.counts) != len(self.bounds):
            raise ValueError(f"{len(self.counts)} counts for {len(self.bounds)} bounds")
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise ValueError("bounds must be strictly ascending")
        if self.counts[0] < 0 or any(a > b for a, b in zip(self.counts, self.counts[1:], strict=False)):
            raise ValueError("counts must be cumulative: non-negative and never decreasing")
        if self.counts[-1] > self.count:
            raise ValueError(f"{self.counts[-1]} observations in the buckets but count {self.count}")
        return self


@schema("edgeswarm.metrics", 1)
class MetricsReport(Message):
    """Published on ``edgeswarm/node/{node}/{service}/metrics``.

    ``counters`` are totals since start (for example ``rejected.checksum``, ``handler_errors``,
    ``bytes_out``); ``gauges`` are current values (for example ``inbox_depth``, ``reassembly_bytes``);
    ``histograms`` distributions since start (for example ``serve_request_s.{job}``), at most MAX_HISTOGRAMS
    (reports from before the field carry none). The names are internal: ``edgeswarm.observability.catalogue``
    maps them to Prometheus families.
    """

    MAX_BYTES = 256 * 1024

    node: Name
    service: Name
    instance: Name
    uptime_s: float = Field(ge=0)
    counters: dict[str, int]
    gauges: dict[str, float]
    histograms: dict[str, Histogram] = Field(default_factory=dict, max_length=MAX_HISTOGRAMS)

    @field_validator("histograms")
    @classmethod
    def _names(cls, value: dict[str, Histogram]) -> dict[str, Histogram]:
        for name in value:
            if not 1 <= len(name) <= MAX_METRIC_NAME:
                raise ValueError(f"a histogram name of {len(name)} characters (1 to {MAX_METRIC_NAME})")
        return value


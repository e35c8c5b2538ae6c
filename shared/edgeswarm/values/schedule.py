"""One round of a job's schedule as bars, planned beside measured: the value types the timeline PNG
(``planning.hpp.render``), the trace collector (``tracing``) and the dashboard share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ScheduleBar(BaseModel):
    """One operation on one lane: ``start_s`` from the round's start and ``dur_s`` (seconds)."""

    model_config = ConfigDict(frozen=True)

    lane: str = Field(max_length=128)
    name: str = Field(max_length=64)
    cat: Literal["compute", "transfer", "collective", "wait", "other"]
    start_s: float = Field(ge=0)
    dur_s: float = Field(ge=0)
    source: Literal["planned", "measured"]
    micro_batch: int | None = None


class ScheduleView(BaseModel):
    """Round ``round`` of a job: its lanes (a stage's device, a shard) and the planned and measured bars on them.
    ``measured_s`` is the measured round's span (first start to last end), ``planned_s`` the planned one's."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    round: int = Field(ge=0)
    lanes: tuple[str, ...]
    bars: tuple[ScheduleBar, ...]
    measured_s: float = Field(default=0.0, ge=0)
    planned_s: float = Field(default=0.0, ge=0)


def lane_key(lane: str) -> tuple[tuple[int, ...], str]:
    """A sort key by the numbers in a lane, then its text: "stage 0", "link 0→1", "stage 1", ..., "stage 10"."""
    numbers: list[int] = []
    digits = ""
    for ch in lane + " ":
        if ch.isdigit():
            digits += ch
        elif digits:
            numbers.append(int(digits[:9]))
            digits = ""
    return tuple(numbers), lane

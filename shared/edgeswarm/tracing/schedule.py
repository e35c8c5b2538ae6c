"""PLACEHOLDER (issue 24 interface): one round's schedule, planned beside measured, for the dashboard to draw."""

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


class ScheduleView(BaseModel):
    """Round ``round`` of a job: its lanes (a stage's device, a shard) and the planned and measured bars on them."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    round: int = Field(ge=0)
    lanes: tuple[str, ...]
    bars: tuple[ScheduleBar, ...]

"""What the dashboard draws of a job, made by its workload: the plan as groups of blocks, and figures as series.

A ``PlanView`` is generic on purpose: a pipeline's stages, a tensor-parallel plan's shards and split learning's
participants are all groups (a stage, a shard set, a participant) of blocks (a device with its share), so the page
draws any kind, a plug-in's included, without knowing it. A ``Series`` is one figure over rounds or time (loss,
accuracy, latency), with an optional ``predicted`` value to draw beside it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

MAX_GROUPS = 256
MAX_POINTS = 512  # points per series: the page draws the latest ones


class PlanBlock(BaseModel):
    """One device's part of a group: ``share`` in [0, 1] of the group's work (1 when it does all of it)."""

    model_config = ConfigDict(frozen=True)

    device: str = Field(max_length=128)
    share: float = Field(default=1.0, ge=0.0, le=1.0)
    detail: str = Field(default="", max_length=256)


class PlanGroup(BaseModel):
    """A stage, a shard set or a participant: ``label`` (e.g. "stage 0: units 0-3") and its blocks."""

    model_config = ConfigDict(frozen=True)

    label: str = Field(max_length=128)
    blocks: tuple[PlanBlock, ...] = Field(max_length=MAX_GROUPS)
    detail: str = Field(default="", max_length=256)


class PlanView(BaseModel):
    """A job's plan as the dashboard draws it: ``layout`` "chain" (groups in order, data flowing from each to the
    next: a pipeline) or "parallel" (groups side by side: shards, participants); ``summary`` is one line on the
    plan and its prediction."""

    model_config = ConfigDict(frozen=True)

    layout: str = Field(default="chain", pattern=r"^(chain|parallel)$")
    groups: tuple[PlanGroup, ...] = Field(max_length=MAX_GROUPS)
    summary: str = Field(default="", max_length=512)
    epoch: int = Field(default=0, ge=0)


class SeriesPoint(BaseModel):
    """One value: ``x`` a round number, or seconds since the job was submitted."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    x: float
    y: float


class Series(BaseModel):
    """One figure of a job over ``x_label`` (round or time): its points, its unit, and the plan's prediction of it
    where there is one."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    name: str = Field(max_length=64)
    unit: str = Field(default="", max_length=32)
    x_label: str = Field(default="round", max_length=32)
    points: tuple[SeriesPoint, ...] = Field(default=(), max_length=MAX_POINTS)
    predicted: float | None = None


def default_plan_view(stage_devices: list[list[str]], epoch: int = 0) -> PlanView | None:
    """A chain of groups, one a stage, each with its devices in equal shares: what a kind without its own drawing
    gets from ``Workload.stage_devices``. None for no stages."""
    if not stage_devices:
        return None
    groups = tuple(PlanGroup(label=f"stage {i}", blocks=tuple(PlanBlock(device=d, share=1.0 / len(devs))
                                                              for d in devs))
                   for i, devs in enumerate(stage_devices) if devs)
    return PlanView(layout="chain", groups=groups, epoch=epoch) if groups else None


def finite(value: float | None) -> bool:
    """Whether ``value`` is a number to draw (not None, NaN or infinite: a diverged loss is NaN)."""
    return value is not None and math.isfinite(value)


def human_bytes(n: float) -> str:
    """``n`` bytes as a person reads them: "512 B", "7.5 KiB", "1.2 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"

"""A job's entries in the checkpoint store: its stages, and which units each stage of a version holds.

A job's stages are saved as ``stage-0``, ``stage-1``, ... (``stage_entry``) of one version, each holding a unit
range of the plan the job ran on then; a later re-plan changes the ranges, so every version also gets a ``layout``
entry: no tensors, and its meta ``stages`` listing the ranges (``"0-52,52-72"``) and ``model`` naming the zoo model
(its ModelSpec as JSON), so a version says by itself what it is. Restoring a job from a version reads it to know
which stage files hold a unit; ``edgeswarm export`` reads it to assemble the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from edgeswarm.bus import Bus
from edgeswarm.checkpoints.client import load_checkpoint, save_checkpoint
from edgeswarm.errors import CheckpointError
from edgeswarm.planning.hpp.types import Plan
from edgeswarm.values.checkpoints import as_torch
from edgeswarm.values.profiles import ModelSpec

if TYPE_CHECKING:
    import torch  # only for a load's result: a coordinator saving layouts never imports it

LAYOUT = "layout"


@dataclass(frozen=True)
class Layout:
    """A version's layout entry: each stage's unit range [start, end) by stage index, the zoo model (None in a
    layout saved without one) and the whole meta as strings (``stages``, ``model`` and anything saved beside)."""

    ranges: list[tuple[int, int]]
    model: ModelSpec | None
    meta: dict[str, str]


def stage_entry(stage: int) -> str:
    """The checkpoint store's name for stage ``stage`` of a job."""
    return f"stage-{stage}"


def load_stage(bus: Bus, store_node: str, job_id: str, stage: int, version: int, *,
               timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
    """Every tensor of stage ``stage`` of ``version`` of ``job_id`` (see ``checkpoint_tensors``), by name. Raises
    CheckpointError when the store does not have it or it is damaged."""
    info, arrays = load_checkpoint(bus, store_node, job_id, stage_entry(stage), version, timeout_s=timeout_s)
    return as_torch(info, arrays)


def save_layout(bus: Bus, store_node: str, job_id: str, version: int, plan: Plan | list[tuple[int, int]], *,
                model: ModelSpec | None = None, extra: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
    """Record that ``version`` of ``job_id``'s stages holds ``plan``'s unit ranges (a plan, or the ranges), of
    ``model``, with ``extra`` meta beside. Raises CheckpointError."""
    pairs = [(s.start, s.end) for s in plan.stages] if isinstance(plan, Plan) else plan
    meta = {"stages": ",".join(f"{a}-{b}" for a, b in pairs), **(extra or {})}
    if model is not None:
        meta["model"] = model.model_dump_json()
    save_checkpoint(bus, store_node, job_id, LAYOUT, version, {}, meta=meta, timeout_s=timeout_s)


def load_layout(bus: Bus, store_node: str, job_id: str, version: int, *,
                timeout_s: float = 60.0) -> list[tuple[int, int]]:
    """The unit range [start, end) of every stage of ``version`` of ``job_id``, by stage index. Raises
    CheckpointError when the store has no layout for it or the layout is malformed."""
    return load_layout_meta(bus, store_node, job_id, version, timeout_s=timeout_s).ranges


def load_layout_meta(bus: Bus, store_node: str, job_id: str, version: int, *,
                     timeout_s: float = 60.0) -> Layout:
    """The layout entry of ``version`` of ``job_id``, its ranges and model checked. Raises CheckpointError when the
    store has no layout for it or the layout is malformed (ranges that do not cut the model in order, a model that
    is not a model spec)."""
    info, _ = load_checkpoint(bus, store_node, job_id, LAYOUT, version, timeout_s=timeout_s)
    meta = {k: str(v) for k, v in info.meta.items()}
    text = info.meta.get("stages")
    try:
        ranges = [(int(a), int(b)) for a, b in (r.split("-") for r in str(text).split(","))]
    except ValueError:
        raise CheckpointError(f"the layout of {job_id} version {version} is malformed: {text!r}") from None
    if not ranges or ranges[0][0] != 0 or any(b <= a for a, b in ranges) or \
            any(ranges[k][1] != ranges[k + 1][0] for k in range(len(ranges) - 1)):
        raise CheckpointError(f"the layout of {job_id} version {version} does not cut the model in order: {text!r}")
    try:
        model = ModelSpec.model_validate_json(meta["model"]) if "model" in meta else None
    except ValidationError:
        raise CheckpointError(f"the layout of {job_id} version {version} names a malformed model: "
                              f"{meta['model'][:200]!r}") from None
    return Layout(ranges, model, meta)

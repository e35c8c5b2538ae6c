"""A training job's checkpoint version, assembled from its stages into the whole model's state dict.

The stages of a version are saved separately (``stage-0``, ``stage-1``, ...), each under the whole model's
parameter names, with a ``layout`` entry naming the model and each stage's unit range (``training.layout``). Their
weights and buffers together are exactly the plain torch model's ``state_dict()``; the optimizer's entries
(``opt:...``) are left out. ``export_model`` fetches them over MQTT through the checkpoint store and checks the
result against the zoo model before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from edgeswarm.bus import Bus
from edgeswarm.checkpoints.client import list_checkpoints
from edgeswarm.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from edgeswarm.hpp.model_file import describe_problems, specs_of, state_problems
from edgeswarm.state.layout import LAYOUT, load_layout_meta, load_stage, stage_entry
from edgeswarm.state.units import model_state
from edgeswarm.values.profiles import ModelSpec

MAX_JOBS_SHOWN = 20


class ExportError(CheckpointError):
    """A job's checkpoint cannot be exported: an unknown job, no such version, a stage or the layout missing."""


@dataclass
class ExportedModel:
    """The whole model of ``version`` of ``job_id``: its zoo ``model`` and its ``state`` dict (torch tensors)."""

    job_id: str
    version: int
    model: ModelSpec
    state: dict[str, torch.Tensor]

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata an exported file carries (``format: pt`` is what Hugging Face tools expect)."""
        return {"format": "pt", "edgeswarm.model": self.model.name,
                "edgeswarm.model_config": json.dumps(self.model.config, sort_keys=True),
                "edgeswarm.job": self.job_id, "edgeswarm.version": str(self.version)}


def complete_versions(bus: Bus, store_node: str, job_id: str, *, timeout_s: float = 60.0) -> list[int]:
    """The versions of ``job_id`` whose every stage was saved (those with a layout), ascending. Raises ExportError
    naming the jobs the store has when it has none of ``job_id``."""
    listing = list_checkpoints(bus, store_node, job_id, timeout_s=timeout_s).get(job_id, {})
    if not listing:
        known = sorted(list_checkpoints(bus, store_node, timeout_s=timeout_s))
        shown = ", ".join(known[:MAX_JOBS_SHOWN]) + (f" and {len(known) - MAX_JOBS_SHOWN} more"
                                                     if len(known) > MAX_JOBS_SHOWN else "")
        raise ExportError(f"the checkpoint store on {store_node} has no checkpoint of job {job_id!r}; jobs with "
                          f"checkpoints: {shown or 'none'}")
    versions = listing.get(LAYOUT, [])
    if not versions:
        raise ExportError(f"job {job_id} has no complete checkpoint version yet (no layout saved): wait for its "
                          "first checkpoint")
    return versions


def export_model(bus: Bus, store_node: str, job_id: str, version: int | None = None, *,
                 timeout_s: float = 60.0) -> ExportedModel:
    """Fetch every stage of ``version`` (None: the latest complete one) of ``job_id`` from the checkpoint store on
    ``store_node`` and assemble the whole model's state dict. ``bus`` must advertise its status (the store streams
    the tensors to its data topic). Raises ExportError (unknown job, no such version, a stage or the model missing,
    stages that do not make up the model) or another CheckpointError (the store unreachable, a damaged file)."""
    versions = complete_versions(bus, store_node, job_id, timeout_s=timeout_s)
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise ExportError(f"job {job_id} has no complete checkpoint version {version}; complete versions: "
                          f"{', '.join(map(str, versions))}")
    layout = load_layout_meta(bus, store_node, job_id, version, timeout_s=timeout_s)
    ranges, model = layout.ranges, layout.model
    if model is None:
        raise ExportError(f"the layout of version {version} of job {job_id} does not name its model; it was saved by "
                          "an older edgeswarm")
    state: dict[str, torch.Tensor] = {}
    for stage in range(len(ranges)):
        try:
            state.update(model_state(load_stage(bus, store_node, job_id, stage, version, timeout_s=timeout_s)))
        except CheckpointNotFoundError as exc:
            raise ExportError(f"version {version} of job {job_id} lacks {stage_entry(stage)} of its {len(ranges)} "
                              f"stages: {exc}") from None
    try:
        problems = state_problems(specs_of(state), model)
    except ConfigError as exc:
        raise ExportError(f"version {version} of job {job_id} names a model this build cannot make: {exc}") from None
    if problems:
        raise ExportError(f"the stages of version {version} of job {job_id} do not make up {model.name}:\n"
                          f"{describe_problems(problems)}")
    return ExportedModel(job_id, version, model, state)

"""Held-out accuracy of a job's model as the checkpoint store has it: every stage loaded, chained, evaluated."""

from __future__ import annotations

import torch

from edgeswarm.bus import Bus
from edgeswarm.data import open_dataset
from edgeswarm.data.base import Dataset
from edgeswarm.evaluation import held_out
from edgeswarm.hpp.spec import JobSpec
from edgeswarm.models.zoo import build_model
from edgeswarm.state.layout import load_stage
from edgeswarm.state.units import model_state


def accuracy(model: torch.nn.Module, dataset: Dataset, batch_size: int = 256) -> float:
    """Share of the held-out split's targets (samples, or tokens for sequence targets) the model in evaluation
    mode predicts right."""
    return held_out(model, dataset, batch_size)[0]


def evaluate_checkpoint(bus: Bus, store_node: str, job: JobSpec, stages: int, version: int, *,
                        timeout_s: float = 120.0) -> float:
    """Load ``version`` of every stage of ``job`` from the checkpoint store on ``store_node`` (its weights and
    buffers; the optimizer state is left out), rebuild the whole model and return its held-out accuracy. Raises
    CheckpointError when a stage is missing or damaged, and RuntimeError when the stages do not make up the
    model."""
    state: dict[str, torch.Tensor] = {}
    for stage in range(stages):
        state.update(model_state(load_stage(bus, store_node, job.name, stage, version, timeout_s=timeout_s)))
    model = build_model(job.model)
    model.load_state_dict(state, strict=True)
    return accuracy(model, open_dataset(job.data, job.model))

"""Training jobs: what a user submits (YAML or JSON), validated before anything runs.

A job names a zoo model and a data set, the global batch (samples per round) and optionally the number of
micro-batches M, the optimizer, how long to train (rounds or epochs), the strategy (``hpp`` by default;
``dp``, ``pp`` and ``single`` run the baselines on the same runtime, so comparisons are measured), and how
often to checkpoint; ``init`` starts it from a safetensors file of the model's weights. An invalid spec is refused
with every offending field and the reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgeswarm.errors import ConfigError
from edgeswarm.planning.hpp.types import Strategy
from edgeswarm.values.limits import MAX_GLOBAL_BATCH
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec, OptimizerSpec
from edgeswarm.wire.schema import NAME_PATTERN
from edgeswarm.workloads import field_errors

if TYPE_CHECKING:  # torch is imported only to build an optimizer: messages carry these specs
    import torch

Recovery = Literal["light", "heavy", "none"]


class InitSpec(BaseModel):
    """Start a job from a whole-model safetensors file (what ``edgeswarm export`` writes) instead of the model's seed.

    ``file`` is a path on the machine that runs ``edgeswarm train``: the command checks the file against the
    model, uploads it to the checkpoint store as version 0 of the job and fills in ``sha256`` (of the file's
    bytes), which the coordinator checks against what the store holds before the stages load it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(min_length=1, max_length=4096)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class JobSpec(BaseModel):
    """A training job. Exactly one of ``rounds`` and ``epochs`` says how long it trains."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["train", "train-hpp"] = "train"
    name: str = Field(pattern=NAME_PATTERN)
    model: ModelSpec
    data: DatasetSpec
    # Capped like the planner's requests, so a job it could never plan is refused when it is submitted.
    global_batch: int = Field(default=256, ge=1, le=MAX_GLOBAL_BATCH)
    micro_batches: int | None = Field(default=None, ge=1, le=MAX_GLOBAL_BATCH)
    optimizer: OptimizerSpec = OptimizerSpec()
    rounds: int | None = Field(default=None, ge=1)
    epochs: float | None = Field(default=None, gt=0)
    strategy: Strategy = "hpp"
    checkpoint_interval: int = Field(default=1, ge=0, description="rounds between checkpoints; 0: only the end")
    seed: int = 0
    recovery: Recovery = Field(default="light", description="how a lost device is replaced: light (move only the "
                               "layers whose owner changes), heavy (gather, full re-plan, redistribute) or none "
                               "(fail the job)")
    backup_interval: int = Field(default=1, ge=1, description="rounds between stage backups and snapshots; a "
                                 "failure replays the rounds since the last one")
    init: InitSpec | None = Field(default=None, description="start from the weights of this safetensors file "
                                  "(uploaded by `edgeswarm train`) instead of the model's seed")

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.rounds is None) == (self.epochs is None):
            raise ValueError("give exactly one of rounds and epochs")
        if self.micro_batches is not None and self.global_batch % self.micro_batches:
            raise ValueError(f"global_batch {self.global_batch} does not split into {self.micro_batches} "
                             "micro-batches of equal size")
        return self

    def total_rounds(self, train_size: int) -> int:
        """Rounds to run on a training set of ``train_size`` samples (epochs rounded up to whole rounds)."""
        if self.rounds is not None:
            return self.rounds
        assert self.epochs is not None
        return max(1, math.ceil(self.epochs * train_size / self.global_batch))


def parse_job(data: Any, *, source: str = "the job spec") -> JobSpec:
    """A JobSpec from parsed YAML/JSON. Raises ConfigError listing every invalid field and why."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{field_errors(exc)}") from None


def make_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer the spec names, over ``params``."""
    import torch

    params = list(params)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    momentum = spec.momentum if spec.name == "momentum" else 0.0
    return torch.optim.SGD(params, lr=spec.lr, momentum=momentum, weight_decay=spec.weight_decay)


class StrategyPrediction(BaseModel):
    """What the planner predicts for one strategy on this job's cluster: seconds per round and samples per
    second, or why the strategy has no plan (it does not fit in memory)."""

    strategy: Strategy
    round_s: float | None = None
    samples_per_s: float | None = None
    error: str | None = None

    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainProgress(BaseModel):
    """How far a training job is. ``round`` counts the rounds done out of ``total_rounds``; ``loss`` and
    ``accuracy`` are the last round's over its mini-batch; ``round_s`` its wall time, against the plan's
    ``predicted_round_s``, and ``refitted_round_s``, what the closed loop predicted for that round from the rounds
    before it (planning.refit: each device's compute and each link as measured); ``samples_per_s`` is the global
    batch over ``round_s``. ``test_accuracy`` is the final
    model's, loaded back from the checkpoint store, on the held-out split. ``reconfigurations`` counts re-plans
    after a device left or joined, and ``predictions`` are every strategy's predicted figures. After a recovery
    ``round`` goes back to the round the job resumed from: those rounds run again."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # a diverged loss is NaN

    kind: Literal["train", "train-hpp"] = "train"
    strategy: Strategy = "hpp"
    round: int = Field(default=0, ge=0)
    total_rounds: int = Field(default=0, ge=0)
    loss: float | None = None
    accuracy: float | None = None
    round_s: float | None = None
    predicted_round_s: float | None = None
    refitted_round_s: float | None = None
    samples_per_s: float | None = None
    checkpoint_version: int | None = None
    test_accuracy: float | None = None
    predictions: list[StrategyPrediction] = Field(default_factory=list, max_length=8)
    reconfigurations: int = Field(default=0, ge=0)

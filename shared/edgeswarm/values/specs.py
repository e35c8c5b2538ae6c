"""What a training job trains on and with: its data set and its optimizer (the model is a ``profiles.ModelSpec``).

Both travel in job specs and in stage assignments, so they sit below the messages and the training package.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.values.profiles import Optimizer

DatasetKind = Literal["teacher", "tokens", "cifar10", "npz", "digits"]


class DatasetSpec(BaseModel):
    """Which data to train on.

    ``path`` is the directory of a "cifar10" or "npz" data set (required there, refused for the synthetic kinds and
    for "digits", scikit-learn's bundled handwritten digits).
    ``size`` and ``test_size`` are sample counts of the training and held-out splits: the synthetic kinds generate
    that many (default 4096 and 1024); the file kinds use the first ``size`` / ``test_size`` samples of their files
    (default: all of them). ``seed`` selects the synthetic task and its samples, and the epoch permutations of
    ``round_sample_ids``. ``noise`` is the probability that a synthetic label (for next-token tasks, each target
    token) is replaced by a uniformly random one; file kinds take their labels as they are. ``teacher_grid``
    sets what the "teacher" labels depend on: 2, the mean of each channel's quadrants (the default for even
    image sides), or 1, each channel's mean, which a CNN ending in global pooling learns within tens of steps.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: DatasetKind = "teacher"
    path: str | None = None
    size: int | None = Field(default=None, ge=1)
    test_size: int | None = Field(default=None, ge=0)
    seed: int = Field(default=0, ge=0)
    noise: float = Field(default=0.0, ge=0.0, le=1.0)
    teacher_grid: Literal[1, 2] | None = None

    @model_validator(mode="after")
    def _path_and_noise(self) -> DatasetSpec:
        reads_files = self.kind in ("cifar10", "npz")
        if reads_files and not self.path:
            expected = ("the directory holding the CIFAR-10 python batches data_batch_1..5 and test_batch"
                        if self.kind == "cifar10" else "a directory holding train.npz and test.npz (arrays x and y)")
            raise ValueError(f"kind {self.kind!r} needs path: {expected}; nothing is downloaded")
        if not reads_files and self.path is not None:
            source = "reads scikit-learn's bundled digits" if self.kind == "digits" else "generates its data"
            raise ValueError(f"kind {self.kind!r} {source} and takes no path (got {self.path!r}); "
                             "remove path, or use kind 'cifar10' or 'npz' to read files")
        if self.teacher_grid is not None and self.kind != "teacher":
            raise ValueError(f"teacher_grid applies to kind 'teacher' only, not {self.kind!r}")
        if (reads_files or self.kind == "digits") and self.noise > 0:
            raise ValueError(f"noise applies to the synthetic kinds only; kind {self.kind!r} uses its labels "
                             "as they are")
        return self


class OptimizerSpec(BaseModel):
    """The optimizer and its hyper-parameters. ``momentum`` applies to ``momentum`` only (plain ``sgd`` has
    none, so its memory model has no optimizer state)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Optimizer = "sgd"
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)

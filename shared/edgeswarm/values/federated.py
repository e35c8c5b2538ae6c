"""What a split federated learning round is told about its data and its training: how the training set is divided
among the devices, and each party's local training settings. Shared by the job spec, the messages between the
coordinator, the MECs and the devices, and the data partitioner, so each reads the same values."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PartitionKind = Literal["iid", "dirichlet", "label-skew"]
SplitMode = Literal["usplit", "vanilla", "local"]
RecomputePolicy = Literal["adaptive", "always", "off"]
ThetaMode = Literal["peak", "budget"]
MAX_FL_DEVICES = 1024


class PartitionSpec(BaseModel):
    """How the training set is divided over ``devices`` devices, from ``seed``: ``iid`` (shuffled, equal shares),
    ``dirichlet`` (class k's proportions across the devices drawn from Dir(``alpha``): 0.1 is strongly non-IID,
    1.0 mildly), ``label-skew`` (each device holds ``classes_per_device`` classes only)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    kind: PartitionKind = "dirichlet"
    devices: int = Field(default=4, ge=1, le=MAX_FL_DEVICES)
    alpha: float = Field(default=0.5, gt=0.0, le=1e6)
    classes_per_device: int = Field(default=2, ge=1, le=1 << 16)
    seed: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _fields_apply(self) -> PartitionSpec:
        # By value, not by ``model_fields_set``: a message carries every field, defaults included, so a spec that
        # went over the wire has them all set.
        fields = type(self).model_fields
        if self.kind != "dirichlet" and self.alpha != fields["alpha"].default:
            raise ValueError(f"alpha applies to kind 'dirichlet' only, not {self.kind!r}")
        if self.kind != "label-skew" and self.classes_per_device != fields["classes_per_device"].default:
            raise ValueError(f"classes_per_device applies to kind 'label-skew' only, not {self.kind!r}")
        return self


class LocalTraining(BaseModel):
    """One party's local training in a round (spec section 7): ``epochs`` E over its partition in batches of
    ``batch_size``, SGD with ``lr``, ``momentum``, ``weight_decay``. ``mode``: ``usplit`` (the device keeps the first
    ``cut`` units and the last ``tail``; labels never leave it), ``vanilla`` (the MEC holds everything after the cut
    and gets the labels: the SplitFed baseline) or ``local`` (the whole model on the device: FedAvg).
    ``sample_pruning`` drops ``prune_ratio`` of the samples under the ``prune_percentile``-th loss percentile for the
    rest of the round (spec 5.4). ``recompute`` and ``theta`` steer the device's memory reducer (spec 6.3)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    mode: SplitMode = "usplit"
    tail: int = Field(default=1, ge=0, le=64)
    epochs: int = Field(default=1, ge=1, le=100)
    batch_size: int = Field(default=32, ge=1, le=4096)
    lr: float = Field(default=0.01, gt=0.0, le=10.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=5e-4, ge=0.0, le=1.0)
    sample_pruning: bool = True
    prune_percentile: float = Field(default=20.0, ge=0.0, le=100.0)
    prune_ratio: float = Field(default=0.8, ge=0.0, le=1.0)
    recompute: RecomputePolicy = "adaptive"
    theta: ThetaMode = "peak"

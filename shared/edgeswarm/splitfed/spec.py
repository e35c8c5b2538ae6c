"""What a user submits to train with SmartSplit's split federated learning: ``kind: train-splitfed`` and these
fields, and what the job's state says about its rounds."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.messages.splitfed import MAX_ROUND, MAX_SETUP_S
from edgeswarm.planning.splitfed.types import MAX_SPLIT_DEVICES, Solver
from edgeswarm.values.federated import LocalTraining, PartitionSpec, RecomputePolicy, ThetaMode
from edgeswarm.values.limits import MAX_MEMORY_BYTES, MAX_UNITS
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec
from edgeswarm.wire.schema import NAME_PATTERN, Name

# SmartSplit itself, and the baselines on the same runtime: whole-model local training (FedAvg, random selection,
# a device whose budget cannot hold the model drops out), one fixed cut for everyone with random selection
# (SplitFed, a vanilla split: labels go to the server), and SmartSplit without its memory reducer.
SplitfedMode = Literal["smartsplit", "fedavg", "splitfed", "smartsplit-norecompute"]
MAX_ROUND_RECORDS = 200  # rounds kept in the job's state (the latest)


class SplitfedSpec(BaseModel):
    """A split federated learning job: ``rounds`` rounds over ``partition.devices`` data partitions (one per
    device; a device's partition is its index among the job's devices, in name order), ``participants`` K train
    per round (the central manager selects ``ceil(gamma * K)`` candidates, the MECs' importance scheduler keeps K,
    exploring with ``epsilon``). ``lam`` weighs round time against label skew; ``solver`` is the central manager's
    (Bayesian optimisation or the exhaustive oracle). ``fixed_cut`` is the SplitFed baseline's cut (default 3: after
    LeNet-5's first pooling, its third unit). ``memory_budget_bytes`` caps every device's training memory (0: the
    node's own budget, from its ledger). ``wait_s`` is the longest a party waits for one tensor of its peer.
    ``mode`` picks the method: SmartSplit (``smartsplit``, with sample pruning on unless ``training.sample_pruning``
    is false; ``smartsplit-norecompute`` without the memory reducer and without pruning) or a baseline on the same
    runtime (``fedavg``: whole-model local training; ``splitfed``: one fixed cut, labels sent to the server), which
    prune nothing whatever ``training`` says."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["train-splitfed"]
    name: str = Field(pattern=NAME_PATTERN)
    model: ModelSpec = ModelSpec(name="lenet5", config={"num_classes": 10})
    data: DatasetSpec = DatasetSpec(kind="digits")
    partition: PartitionSpec = PartitionSpec()
    mode: SplitfedMode = "smartsplit"
    rounds: int = Field(default=5, ge=1, le=MAX_ROUND)
    participants: int = Field(default=2, ge=1, le=MAX_SPLIT_DEVICES)
    gamma: float = Field(default=2.0, ge=1.0, le=10.0)
    epsilon: float = Field(default=0.1, ge=0.0, le=1.0)
    lam: float = Field(default=1.0, ge=0.0, le=1e6)
    solver: Solver = "bo"
    training: LocalTraining = LocalTraining()
    fixed_cut: int = Field(default=3, ge=1, le=MAX_UNITS)
    recompute: RecomputePolicy = "adaptive"
    theta: ThetaMode = "peak"
    estimator: Literal["grad_nnls", "oracle", "off"] = "grad_nnls"
    memory_budget_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    seed: int = Field(default=0, ge=0)
    wait_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    exclude: list[Name] = Field(default_factory=list, max_length=MAX_SPLIT_DEVICES)

    @model_validator(mode="after")
    def _consistent(self) -> SplitfedSpec:
        if self.participants > self.partition.devices:
            raise ValueError(f"participants {self.participants} exceeds the {self.partition.devices} partitions "
                             "(partition.devices): raise partition.devices or lower participants")
        if self.training.mode != "usplit" and "training" in self.model_fields_set \
                and "mode" in self.training.model_fields_set:
            raise ValueError("training.mode follows the job's mode; leave it out")
        return self

    def local_training(self) -> LocalTraining:
        """The training every party runs, with the job's mode applied (FedAvg trains locally, SplitFed splits
        vanilla, SmartSplit without recomputation turns the reducer off)."""
        mode = {"fedavg": "local", "splitfed": "vanilla"}.get(self.mode, "usplit")
        recompute = "off" if self.mode in ("smartsplit-norecompute", "fedavg", "splitfed") else self.recompute
        pruning = self.training.sample_pruning and self.mode == "smartsplit"
        return self.training.model_copy(update={"mode": mode, "recompute": recompute, "theta": self.theta,
                                                "sample_pruning": pruning})


class ParticipantRecord(BaseModel):
    """One device in one round: its MEC, cut, outcome, measured peak training memory (bytes), mean loss, the
    iterations it trained, the seconds its own computes took and the seconds before its first step (DeviceReport's
    ``setup_s``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    mec: Name
    cut: int = Field(ge=1, le=MAX_UNITS)
    outcome: str = Field(max_length=32)
    peak_bytes: int = Field(default=0, ge=0)
    loss: float | None = None
    samples: int = Field(default=0, ge=0)
    recompute: str = Field(default="", max_length=256)
    iterations: int = Field(default=0, ge=0)
    compute_s: float = Field(default=0.0, ge=0.0)
    setup_s: float = Field(default=0.0, ge=0.0, le=MAX_SETUP_S)


class RoundRecord(BaseModel):
    """One finished round: its participants, held-out accuracy and loss of the aggregated model, the predicted and
    measured round time (seconds, from its plan to its aggregated model: profiling and preparing a node first seen
    are the job's setup, announced by their own ``profiling`` events, not the round's work; predicted: the slowest
    planned round of the devices that trained, ``splitfed.coordinator.participants_s``, and the round's fixed cost
    beyond them as earlier rounds measured it, ``splitfed.coordinator.fixed_price``) and ``refitted_s``, the
    prediction as the closed loop corrected it from the rounds before (``splitfed.coordinator.refitted_s``: the
    fixed per-round costs and the devices' real speed; None until rounds are measured), the bytes the U-split moved
    on the MECs' LANs and the bytes that crossed the WAN (models between the coordinator and the MECs or the
    devices), updates refused, devices left out."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    round: int = Field(ge=0)
    participants: list[ParticipantRecord] = Field(max_length=MAX_SPLIT_DEVICES)
    accuracy: float | None = None
    loss: float | None = None
    predicted_s: float = Field(default=0.0, ge=0.0)
    refitted_s: float | None = Field(default=None, ge=0.0)
    round_s: float = Field(default=0.0, ge=0.0)
    lan_bytes: int = Field(default=0, ge=0)
    wan_bytes: int = Field(default=0, ge=0)
    refused: int = Field(default=0, ge=0)
    left_out: list[Name] = Field(default_factory=list, max_length=MAX_SPLIT_DEVICES)


class SplitfedProgress(BaseModel):
    """How a split federated learning job trains: rounds done, the latest rounds' records, the last accuracy."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["train-splitfed"] = "train-splitfed"
    rounds_done: int = Field(default=0, ge=0)
    rounds_total: int = Field(default=0, ge=0)
    accuracy: float | None = None
    loss: float | None = None
    refused: int = Field(default=0, ge=0)
    history: list[RoundRecord] = Field(default_factory=list, max_length=MAX_ROUND_RECORDS)

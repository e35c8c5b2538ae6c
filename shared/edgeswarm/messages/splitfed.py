"""Messages of the train-splitfed workload (SmartSplit): a round from the coordinator to the MECs and devices, the
U-split's tensors between a device and its MEC, and what comes back.

Each round the coordinator enrols every candidate device the central manager picked (SplitEnrol, a request to its
stage-worker: which MEC trains with it, which data partition is its own) and hands each MEC its candidates and their
cuts (SplitRoundStart, a request to its mec-manager), then the global weights (SplitGlobal, a frame on the MEC's
data topic, taken only from the coordinator the round named). The MEC picks who trains (Algorithm 2) and sends each
its part of the model (SplitPartWeights: the first ``cut`` units and the tail). Per mini-batch the device and its
MEC exchange SplitTensor frames: the cut activation, the MEC's output, the tail's gradient, the cut gradient. At the
round's end the device sends its trained part (SplitDone), and the MEC the weighted sum of its devices' reassembled
models (SplitUpdate) to the coordinator, which finishes FedAvg. Labels are in none of these but a vanilla split's
activation frame (the SplitFed baseline), which the U-split never sends.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.splitfed.types import (
    MAX_SPLIT_DEVICES,
    ModelCost,
    SplitDevice,
    SplitMec,
    SplitOptions,
    SplitSelection,
)
from edgeswarm.values.federated import LocalTraining, PartitionSpec
from edgeswarm.values.limits import MAX_MEMORY_BYTES, MAX_UNITS
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec
from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_BATCH_LABELS = 4096
MAX_ROUND = (1 << 31) - 1
MAX_ROUND_S = 86400.0  # a round's seconds an MEC may report
MAX_SETUP_S = 3600.0  # a device's seconds before a round's first step that a report may claim (the planner prices it)
SplitTensorKind = Literal["activation", "middle", "tail_gradient", "cut_gradient"]
DeviceOutcome = Literal["trained", "failed", "lost", "refused", "skipped"]


class SplitCandidate(BaseModel):
    """A device the central manager picked for the round, its cut, its partition index and its sample count."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    cut: int = Field(ge=1, le=MAX_UNITS)
    index: int = Field(ge=0, lt=MAX_SPLIT_DEVICES)
    samples: int = Field(ge=0, le=1 << 31)


class DeviceReport(BaseModel):
    """One device's round as its MEC saw it: ``outcome`` (``skipped``: a candidate the MEC's importance scheduler did
    not pick; ``lost``: its tensors stopped; ``refused``: its update held NaN or infinite values), its cut,
    samples (full local set, the FedAvg weight), iterations run, mean loss and the sum of squared per-sample
    losses (Eq. 7's input: only scalars leave the device), its measured peak training bytes and budget, the
    recomputation it used, the seconds its own computes took (``compute_s``: forward, backward and update of its
    parts, as the device computes them), the seconds before its first step (``setup_s``: its part built, the weights
    loaded, its memory planned and its partition read) and the MEC's estimate of its label skew (``dis``, nats) and
    statistical utility (``stat``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    outcome: DeviceOutcome
    cut: int = Field(ge=1, le=MAX_UNITS)
    samples: int = Field(default=0, ge=0)
    iterations: int = Field(default=0, ge=0)
    loss: float | None = None
    loss_sq_sum: float = Field(default=0.0, ge=0.0)
    peak_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    budget_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    recompute: str = Field(default="", max_length=256)
    pruned: int = Field(default=0, ge=0)
    compute_s: float = Field(default=0.0, ge=0.0)
    setup_s: float = Field(default=0.0, ge=0.0, le=MAX_SETUP_S)
    dis: float | None = Field(default=None, ge=0.0)
    stat: float | None = Field(default=None, ge=0.0)
    detail: str = Field(default="", max_length=1024)


@schema("edgeswarm.splitfed.plan_request", 1)
class SplitPlanRequest(Message):
    """Request to the planner: the central manager's selection for round ``round`` (spec section 4). Answered with
    SplitPlanReply or PlanFailed."""

    MAX_BYTES = 4 * MIB

    model: ModelCost
    devices: list[SplitDevice] = Field(min_length=1, max_length=MAX_SPLIT_DEVICES)
    mecs: list[SplitMec] = Field(min_length=1, max_length=64)
    options: SplitOptions
    round: int = Field(default=0, ge=0, le=MAX_ROUND)


@schema("edgeswarm.splitfed.plan_reply", 1)
class SplitPlanReply(Message):
    """The round's selection matrix; ``planning_s`` is the planner's time."""

    MAX_BYTES = 1 * MIB

    selection: SplitSelection
    planning_s: float = Field(ge=0.0)


class RoundSetup(BaseModel):
    """What every party of a round needs to build its part: the model, the data and its division, the training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    dataset: DatasetSpec
    partition: PartitionSpec
    training: LocalTraining


@schema("edgeswarm.splitfed.prepare", 1)
class SplitPrepare(Message):
    """Request to a device's stage-worker or an MEC's mec-manager before job ``job_id`` runs a round on it (a fresh
    process's first steps take several times a later one's, and a first tensor to a node waits for the connection's
    handshakes). Both open the data-plane connections their tensors of the job take: to ``peers`` (a device's: its
    MEC; an MEC's: its devices, and the sender's coordinator). A device then builds the job's model and trains one
    step of it on partition ``index``'s first batch with throwaway weights, and times a round's setup as a round
    does it; an MEC builds the job's reassembly of its devices' models and runs its label-distribution estimate once
    on throwaway weights. Answered SplitPrepared."""

    MAX_BYTES = 256 * 1024

    job_id: Name
    setup: RoundSetup
    index: int | None = Field(default=None, ge=0, lt=MAX_SPLIT_DEVICES)
    peers: list[Name] = Field(default_factory=list, max_length=MAX_SPLIT_DEVICES)


@schema("edgeswarm.splitfed.prepared", 1)
class SplitPrepared(Message):
    """The answer to SplitPrepare: the party is prepared; ``setup_s`` is what a round's setup took it after that (a
    device: its part built, the weights loaded, its partition read; an MEC: its reassembly built; seconds), a
    device's the planner's price for its setup until its rounds measure it. ``step_s``: a device's seconds of one
    local training iteration of the whole model at the job's batch size, as it computes them (the median of five
    after its throwaway one); 0 where none was timed (an MEC, an empty partition)."""

    job_id: Name
    node: Name
    setup_s: float = Field(ge=0.0, le=MAX_SETUP_S, allow_inf_nan=False)
    step_s: float = Field(default=0.0, ge=0.0, le=MAX_SETUP_S, allow_inf_nan=False)


@schema("edgeswarm.splitfed.enrol", 1)
class SplitEnrol(Message):
    """Request to a device's stage-worker: in round ``round`` of job ``job_id`` this device may train with MEC ``mec``
    on partition ``index``; it takes that MEC's SplitPartWeights and tensors for the round and no one else's.
    ``budget_bytes`` caps its training memory below the node's own budget (0: the node's). Answered SplitEnrolled."""

    MAX_BYTES = 256 * 1024

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    mec: Name
    index: int = Field(ge=0, lt=MAX_SPLIT_DEVICES)
    setup: RoundSetup
    budget_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    wait_s: float = Field(default=60.0, gt=0.0, le=3600.0)


@schema("edgeswarm.splitfed.enrolled", 1)
class SplitEnrolled(Message):
    """The answer to SplitEnrol and SplitRoundStart: the party holds the round; ``budget_bytes`` is the training
    memory it has now (a device: the least of its ledger's room and the round's cap; an MEC: its ledger's room)."""

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    node: Name
    budget_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)


@schema("edgeswarm.splitfed.round_start", 1)
class SplitRoundStart(Message):
    """Request to an MEC's mec-manager: train round ``round`` of job ``job_id`` with these candidates, of which
    ``quota`` train (Algorithm 2: the top by statistical utility, or with probability ``epsilon`` a random draw from
    ``seed``); the global weights follow as SplitGlobal from ``coordinator``. Answered SplitEnrolled."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    coordinator: Name
    setup: RoundSetup
    candidates: list[SplitCandidate] = Field(min_length=1, max_length=MAX_SPLIT_DEVICES)
    quota: int = Field(ge=1, le=MAX_SPLIT_DEVICES)
    epsilon: float = Field(default=0.1, ge=0.0, le=1.0)
    seed: int = Field(default=0, ge=0)
    estimator: Literal["grad_nnls", "oracle", "off"] = "grad_nnls"
    wait_s: float = Field(default=60.0, gt=0.0, le=3600.0)


@schema("edgeswarm.splitfed.release", 1)
class SplitRelease(Message):
    """Command to a stage-worker or mec-manager, not answered: job ``job_id`` ended; drop everything of it."""

    job_id: Name


@schema("edgeswarm.splitfed.global", 1)
class SplitGlobal(Message):
    """The round's global model (always carries the tensor: every state entry flattened to float32 in the model's
    state-dict order), from the coordinator to an MEC."""

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)


@schema("edgeswarm.splitfed.part", 1)
class SplitPartWeights(Message):
    """From an MEC to a fine-selected device: its part of the global model for cut ``cut`` (the first ``cut`` units
    and the tail, flattened in state-dict order; the whole model when ``local``)."""

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    cut: int = Field(ge=1, le=MAX_UNITS)


@schema("edgeswarm.splitfed.tensor", 1)
class SplitTensor(Message):
    """One U-split tensor of mini-batch ``step`` (always carries the tensor): ``activation`` (device to MEC, the cut
    layer's output; ``last`` on the device's last mini-batch of the round), ``middle`` (MEC to device, the MEC part's
    output), ``tail_gradient`` (device to MEC, the loss's gradient at the MEC part's output), ``cut_gradient`` (MEC
    to device). ``labels`` only in a vanilla split's activation (the baseline that sends them)."""

    MAX_BYTES = 256 * 1024

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    step: int = Field(ge=0, le=1 << 31)
    kind: SplitTensorKind
    last: bool = False  # an activation: the round's last mini-batch of this device
    labels: list[int] | None = Field(default=None, max_length=MAX_BATCH_LABELS)


@schema("edgeswarm.splitfed.done", 1)
class SplitDone(Message):
    """From a device to its MEC at the round's end: its report and (when ``report.outcome`` is ``trained``) its
    trained part, flattened as SplitPartWeights's; an empty tensor otherwise."""

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    report: DeviceReport


@schema("edgeswarm.splitfed.update", 1)
class SplitUpdate(Message):
    """From an MEC to the coordinator: the sum of its trained devices' reassembled models weighted by their
    samples (float32, flattened in SplitGlobal's order; empty when none trained), the total weight ``samples``, the
    largest single weight ``heaviest`` and the ``count`` of models summed (``aggregation.PartialSum``), every
    candidate's report, the updates refused (NaN or infinite values), the bytes its devices' tensors took on its
    LAN, and ``devices_s``: the seconds from its devices' parts going out to the last of their rounds ending here
    (their SplitDone in), the part of the round its devices' planned rounds price (0 when none was served)."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    round: int = Field(ge=0, le=MAX_ROUND)
    mec: Name
    samples: int = Field(ge=0)
    heaviest: int = Field(default=0, ge=0)
    count: int = Field(default=0, ge=0, le=MAX_SPLIT_DEVICES)
    reports: list[DeviceReport] = Field(max_length=MAX_SPLIT_DEVICES)
    refused: int = Field(default=0, ge=0)
    lan_bytes: int = Field(default=0, ge=0)
    devices_s: float = Field(default=0.0, ge=0.0, le=MAX_ROUND_S, allow_inf_nan=False)

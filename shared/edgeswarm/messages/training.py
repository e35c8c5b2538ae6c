"""Messages of the stage-workers: assignments, rounds, the tensors between devices, saving a stage.

Requests go to ``edgeswarm/node/{node}/stage-worker/request``; tensors to the worker's data topic
``edgeswarm/node/{node}/stage-worker/data``. A round's tensors are tagged with the job, the plan ``epoch``
and the round, so a worker drops anything from another epoch or job. Times are seconds.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.values.limits import MAX_LINK_SAMPLES
from edgeswarm.values.profiles import LinkSample, ModelSpec
from edgeswarm.values.specs import DatasetSpec, OptimizerSpec
from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_GROUPS = 64


# Bytes per element of every dtype a unit's training state may hold.
STATE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}


class StateEntry(BaseModel):
    """One tensor of a unit's training state in a packed StageState: its name (``param:``, ``buffer:`` or
    ``opt:`` followed by the qualified parameter name and, for optimizer state, ``:field``), dtype and shape. Its
    raw bytes (``nbytes``, little-endian) follow those of the entry before it in the message's uint8 tensor."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=512)
    dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32"]
    # Each dimension fits torch's int64 shape: a larger one made unpack_units raise TypeError out of the handler.
    shape: list[Annotated[int, Field(ge=0, lt=2**63)]] = Field(max_length=16)

    @property
    def nbytes(self) -> int:
        """Bytes of the entry's tensor."""
        return math.prod(self.shape) * STATE_ITEMSIZE[self.dtype]


class UnitSource(BaseModel):
    """Where a restoring stage-worker gets unit ``unit``'s state: from ``node`` (itself, or a peer that sends it),
    either that node's own state (``owner`` None) or the backup it holds for the failed device ``owner``."""

    model_config = ConfigDict(frozen=True)

    unit: int = Field(ge=0)
    node: Name
    owner: Name | None = None


class CheckpointSource(BaseModel):
    """A checkpoint a restoring stage-worker takes every unit's state from: ``version`` of the job's stages on the
    checkpoint store of ``store_node``, where checkpoint stage ``stage-k`` holds units ``stages[k]`` ([start,
    end)); the worker loads the ones its units are in."""

    model_config = ConfigDict(frozen=True)

    store_node: Name
    version: int = Field(ge=0)
    stages: list[tuple[int, int]] = Field(min_length=1, max_length=MAX_GROUPS)


@schema("edgeswarm.stage.assign", 1)
class StageAssign(Message):
    """Request: hold units [start, end) of ``model`` as rank ``rank`` of stage ``stage`` of a job's plan.

    ``groups`` lists every stage's devices (node ids) and ``shares`` their samples per micro-batch, so the
    worker can route to its neighbours; ``warmup`` is its K_p. ``data`` and ``seed`` let the first and last
    stages read their samples and labels by id (``round_sample_ids``); ``loss_scale`` is 1 / loss terms per
    round. Answered with StageReady, or StageFailed.

    Fault tolerance: the worker snapshots its stage's state (weights, buffers, optimizer state) at the start of
    every ``backup_interval``-th round and, when ``backup_to`` names a device (single-device stages), sends it
    there as a backup. With ``restore`` the stage is not initialised from the seed: every unit's state at the
    start of round ``resume_round`` comes from the named source (its own snapshot or backup, or StageState
    messages from a peer told to send them with StageSendState), and the next round run is ``resume_round``.
    With ``checkpoint`` instead, every unit's state comes from that checkpoint version (saved after round
    ``resume_round``): how a job goes on when devices and their backups failed together.
    """

    MAX_BYTES = 4 * MIB

    job_id: Name
    epoch: int = Field(ge=0)
    stage: int = Field(ge=0)
    rank: int = Field(ge=0)
    model: ModelSpec
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    groups: list[list[Name]] = Field(min_length=1, max_length=MAX_GROUPS)
    shares: list[list[int]] = Field(min_length=1, max_length=MAX_GROUPS)
    micro_batches: int = Field(ge=1)
    warmup: int = Field(ge=1)
    loss_scale: float = Field(gt=0)
    optimizer: OptimizerSpec
    data: DatasetSpec
    seed: int = 0
    backup_to: Name | None = None
    backup_interval: int = Field(default=1, ge=1)
    resume_round: int = Field(default=0, ge=0)
    restore: list[UnitSource] = Field(default_factory=list, max_length=65536)
    checkpoint: CheckpointSource | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StageAssign:
        if len(self.groups) != len(self.shares) or any(
                len(g) != len(s) for g, s in zip(self.groups, self.shares, strict=True)):
            raise ValueError("groups and shares need the same shape (one share per device)")
        if self.stage >= len(self.groups) or self.rank >= len(self.groups[self.stage]):
            raise ValueError(f"stage {self.stage} rank {self.rank} is not in the groups")
        if len({sum(s) for s in self.shares}) != 1:
            raise ValueError("every stage's shares must add up to the same micro-batch size")
        # The length first: [start, end) comes off the network, and a range of 2**63 units is no list to build.
        if self.restore and (len(self.restore) != self.end - self.start
                             or sorted(u.unit for u in self.restore) != list(range(self.start, self.end))):
            raise ValueError(f"restore must name one source for every unit in [{self.start}, {self.end})")
        if self.restore and self.checkpoint is not None:
            raise ValueError("give restore or checkpoint, not both")
        return self


@schema("edgeswarm.stage.ready", 1)
class StageReady(Message):
    """The answer to StageAssign: the stage is built; ``parameters`` counts its trainable values;
    ``restored_bytes`` is the state received from peers for a restore and ``restore_s`` the seconds from the
    assignment to the stage holding its restored state."""

    job_id: Name
    epoch: int
    stage: int
    rank: int
    parameters: int = Field(ge=0)
    restored_bytes: int = Field(default=0, ge=0)
    restore_s: float = Field(default=0.0, ge=0)


@schema("edgeswarm.stage.round", 1)
class RoundStart(Message):
    """Request: run round ``round`` of the assigned job and epoch. Answered with RoundDone or StageFailed
    when the round ends (it may take long: the requester waits with its own timeout)."""

    job_id: Name
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)


@schema("edgeswarm.stage.round_done", 1)
class RoundDone(Message):
    """One device's round: its loss statistics (last stage: the summed unscaled loss, correct predictions and
    loss terms); its time computing (emulated device time; ``compute_cpu_s`` is the host CPU time of it),
    blocked waiting for a peer's tensor, in the runtime's own work between (reading data, slicing, queueing
    sends: ``overhead_s``) and in the AllReduce and optimizer step; the compute of each micro-batch's forward
    and backward (``forward_s``, ``backward_s``, in micro-batch order); its peak live micro-batches, the most
    activation bytes it held for backward at once, and the bytes of its weights, gradients, optimizer state and
    buffers; ``snapshot_s`` is the time taken to snapshot the stage's state after the step (its backup is sent in
    the background); ``arrivals``: how the peers' activations, gradients and AllReduce slices of several chunks
    arrived, per peer (the closed loop fits the links from them)."""

    MAX_BYTES = 256 * 1024

    job_id: Name
    epoch: int
    round: int
    stage: int
    rank: int
    loss_sum: float = 0.0
    correct: int = 0
    terms: int = 0
    compute_s: float = Field(ge=0)
    compute_cpu_s: float = Field(default=0.0, ge=0)
    wait_s: float = Field(ge=0)
    overhead_s: float = Field(default=0.0, ge=0)
    forward_s: list[float] = Field(default_factory=list, max_length=4096)
    backward_s: list[float] = Field(default_factory=list, max_length=4096)
    allreduce_s: float = Field(ge=0)
    peak_live: int = Field(ge=0)
    peak_activation_bytes: int = Field(default=0, ge=0)
    static_bytes: int = Field(default=0, ge=0)
    snapshot_s: float = Field(default=0.0, ge=0)
    arrivals: list[LinkSample] = Field(default_factory=list, max_length=MAX_LINK_SAMPLES)


StageFailureReason = Literal["bad_request", "not_assigned", "timeout", "memory", "aborted", "error"]


@schema("edgeswarm.stage.failed", 1)
class StageFailed(Message):
    """The answer to an assignment, round or save the worker could not carry out, with ``detail``."""

    job_id: str
    reason: StageFailureReason
    detail: str = Field(max_length=4096)


@schema("edgeswarm.stage.abort", 1)
class StageAbort(Message):
    """Command (no answer): give up round ``round`` of the job and epoch now, because another device failed it
    or the job was cancelled; the worker's pending round answers StageFailed with reason ``aborted``."""

    job_id: Name
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    reason: str = Field(max_length=1024)


StageTensorKind = Literal["activation", "gradient"]


@schema("edgeswarm.stage.tensor", 1)
class StageTensor(Message):
    """A tensor between stage-workers; always carries the tensor.

    ``activation``: rows of micro-batch ``micro_batch`` from rank ``sender`` of stage ``stage`` - 1 to stage
    ``stage``. ``gradient``: the gradient rows back from rank ``sender`` of stage ``stage`` + 1. (The group's
    AllReduce sends its slices as ``CollectiveTensor``, ``messages.collectives``.)
    """

    job_id: Name
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    stage: int = Field(ge=0)
    kind: StageTensorKind
    sender: int = Field(ge=0)
    micro_batch: int = Field(default=0, ge=0)


@schema("edgeswarm.stage.save", 1)
class StageSave(Message):
    """Request: save this stage's parameters to the checkpoint store on ``store_node`` as ``version``.
    Answered with StageSaved or StageFailed."""

    job_id: Name
    epoch: int = Field(ge=0)
    store_node: Name
    version: int = Field(ge=0)


@schema("edgeswarm.stage.saved", 1)
class StageSaved(Message):
    """The answer to StageSave: the stage's checkpoint name in the store and its size in bytes."""

    job_id: Name
    stage: int
    version: int
    checkpoint_stage: str
    nbytes: int = Field(ge=0)


StatePurpose = Literal["backup", "migrate", "gather"]


@schema("edgeswarm.stage.state", 1)
class StageState(Message):
    """The training state of unit ``unit`` at the start of round ``round`` (always carries the tensor: the
    entries' raw bytes back to back, uint8). ``owner`` is the device whose state it is. ``backup``: a
    single-device stage's periodic backup to its backup device; ``migrate``: sent on StageSendState to a
    device restoring plan ``epoch``; ``gather``: sent on StageSendState to the device that collects the whole
    model for heavy rescheduling (it keeps the units as its own snapshot of that round)."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    unit: int = Field(ge=0)
    owner: Name
    purpose: StatePurpose
    entries: list[StateEntry] = Field(max_length=4096)


@schema("edgeswarm.stage.send_state", 1)
class StageSendState(Message):
    """Request: send the state of ``units`` at the start of round ``round`` to ``to``, which restores plan
    ``epoch`` (StageState, purpose ``migrate``): this worker's own snapshot (``owner`` None) or the backup it
    holds of device ``owner``. Answered with StageStateSent once every unit is sent, or StageFailed."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    units: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=65536)
    owner: Name | None = None
    to: Name
    purpose: Literal["migrate", "gather"] = "migrate"


@schema("edgeswarm.stage.state_sent", 1)
class StageStateSent(Message):
    """The answer to StageSendState: the units sent, the bytes on the wire and the seconds it took."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    to: Name
    units: list[int]
    nbytes: int = Field(ge=0)
    seconds: float = Field(ge=0)


@schema("edgeswarm.stage.inventory", 1)
class StageInventory(Message):
    """Request: which rounds' state of job ``job_id`` this worker holds. Answered with StageHeld."""

    job_id: Name


class HeldSnapshot(BaseModel):
    """A snapshot a worker holds of its own stage: ``units`` at the start of ``round``."""

    model_config = ConfigDict(frozen=True)

    round: int = Field(ge=0)
    units: list[int]


class HeldBackup(BaseModel):
    """A backup a worker holds: device ``owner``'s units at the start of ``round``."""

    model_config = ConfigDict(frozen=True)

    owner: Name
    round: int = Field(ge=0)
    units: list[int]


@schema("edgeswarm.stage.held", 1)
class StageHeld(Message):
    """The answer to StageInventory: the rounds at whose start this worker has snapshots of its own stage
    (with the units), and the backups it holds for other devices."""

    MAX_BYTES = 4 * MIB

    job_id: Name
    node: Name
    snapshots: list[HeldSnapshot] = Field(default_factory=list)
    backups: list[HeldBackup] = Field(default_factory=list)

    def snapshot_units(self, round_index: int) -> list[int]:
        """The units this worker's own snapshot holds at the start of ``round_index`` (empty: none)."""
        return next((s.units for s in self.snapshots if s.round == round_index), [])

"""The SmartSplit planner's contract: a model's per-unit costs, a device's profile, the options, the selection.

Units: FLOPs, bytes, seconds, bytes per second. A model is a chain of ``V`` cuttable units (a zoo model's layer
sequence); cut ``j`` (1..V-h) keeps units 1..j on the device, ``j+1..V-h`` on its MEC and the last ``h`` (the tail:
classifier and loss, so labels never leave the device) on the device again (spec 4.2). Everything here travels in
MQTT messages, so lists are bounded and floats finite.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.values.limits import MAX_MEMORY_BYTES, MAX_UNITS
from edgeswarm.wire.schema import Name

# The paper's scale is 100 devices under 5 MECs; a central manager may plan for a few hundred.
MAX_SPLIT_DEVICES = 1024
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Bytes = Annotated[int, Field(ge=0, le=MAX_MEMORY_BYTES)]
# Each unit's share of a training iteration's forward and backward seconds in a node's own profile; empty: each
# unit's share of the FLOPs. A node's speed still sets its level, the shares only where a cut falls in it.
UnitShares = Annotated[tuple[NonNegative, ...], Field(max_length=MAX_UNITS)]

Solver = Literal["bo", "exhaustive", "global"]
LatencyModel = Literal["usplit", "vanilla", "paper"]


class SplitPlanError(InfeasiblePlanError):
    """No device can train this round (none available, or no cut fits any budget), or the options ask for the
    impossible (a fixed cut beyond the model, a tail as long as the model): the message says what to change."""


class UnitCost(BaseModel):
    """One cuttable unit of the model at the profile's batch size ``B``: forward and backward FLOPs, the bytes of
    its output activation (what crosses a cut after it), of its parameters, of the activations it saves for
    backward, and of its peak while its backward runs (``backward_bytes``, l^b of Algorithm 3). ``expensive``
    units (conv, linear, attention) keep their outputs as recomputation checkpoints; cheap ones (activation,
    pooling, norm) may be recomputed (spec 6.3)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(max_length=256)
    flops_fwd: NonNegative
    flops_bwd: NonNegative
    out_bytes: Bytes
    param_bytes: Bytes
    act_bytes: Bytes
    backward_bytes: Bytes = 0
    expensive: bool = True


class ModelCost(BaseModel):
    """A model's units in order, profiled at ``batch_size`` samples; ``optimizer_states`` is s_opt (0 for SGD,
    1 for momentum SGD, 2 for Adam) and ``classes`` C, for normalising the skew Dis by ln C."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(max_length=128)
    batch_size: int = Field(ge=1, le=1 << 16)
    units: list[UnitCost] = Field(min_length=2, max_length=MAX_UNITS)
    optimizer_states: int = Field(default=1, ge=0, le=2)
    classes: int = Field(default=10, ge=2, le=1 << 20)


class SplitDevice(BaseModel):
    """One device as the central manager sees it: its MEC, speed, link rate to that MEC and what one message on that
    link costs beyond its bytes (``link_message_s``, seconds one way: the link's and the platform's per-message cost,
    ``LinkProfile.per_message_s``; 0 prices bytes only, as the paper does), memory budget for training now, local
    data set size, the MEC's estimates of its label skew (``dis``, Eq. 6, nats) and statistical utility
    (``stat``, Eq. 7), ``setup_s``, the seconds a round costs it before its first step whatever its cut (its part
    built, the weights loaded, its data read: as its earlier rounds measured it; 0 prices none, as the paper), and
    ``unit_share``, each unit's share of its profiled training iteration (``cost.unit_work``; empty: the FLOPs')."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    mec: Name
    speed_flops: Positive
    link_bytes_s: Positive
    link_message_s: NonNegative = 0.0
    budget_bytes: Bytes
    samples: int = Field(ge=0, le=1 << 31)
    dis: NonNegative = 0.0
    stat: NonNegative = 0.0
    available: bool = True
    setup_s: NonNegative = 0.0
    unit_share: UnitShares = ()


class SplitMec(BaseModel):
    """An edge server: its speed, shared by the devices it trains for in a round (processor sharing), and each unit's
    share of its profiled training iteration (``unit_share``, as a device's)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    speed_flops: Positive
    unit_share: UnitShares = ()


class SplitOptions(BaseModel):
    """The central manager's settings (spec 4.2-4.4). ``participants`` K train per round; the manager selects
    ``ceil(gamma * K)`` candidates for the MECs' importance scheduling (gamma 1: no re-selection). ``lam`` weighs
    round time against skew; ``normalise`` divides Dis by ln C and T by T_ref. ``tail`` is h, the units kept on
    the device after the MEC's part. ``epochs`` E local epochs of ``ceil(samples / batch)`` iterations.
    ``fixed_cut`` forces one cut for every device (the SplitFed baseline); ``local_only`` plans whole-model
    local training (FedAvg: a device whose budget cannot hold it is left out); both baselines select their
    devices uniformly at random (seeded by ``seed``). ``n_min``/``n_max`` make the count a search dimension,
    ``comm_buffers`` counts the cut's send/receive buffers in device memory, ``plan_with_recompute`` admits a cut
    whose cost-aware recomputation footprint fits (spec 4.2)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    participants: int = Field(default=10, ge=1, le=MAX_SPLIT_DEVICES)
    gamma: float = Field(default=2.0, ge=1.0, le=10.0, allow_inf_nan=False)
    lam: NonNegative = 1.0
    normalise: bool = True
    tail: int = Field(default=1, ge=0, le=MAX_UNITS)
    epochs: int = Field(default=5, ge=1, le=1000)
    d_threshold: int = Field(default=0, ge=0)
    overhead_bytes: Bytes = 0
    latency_model: LatencyModel = "usplit"
    solver: Solver = "bo"
    bo_budget: int = Field(default=20, ge=1, le=10_000)
    bo_init: int = Field(default=4, ge=0, le=1000)
    seed: int = Field(default=0, ge=0)
    fixed_cut: int | None = Field(default=None, ge=1, le=MAX_UNITS)
    local_only: bool = False
    previous_best: tuple[int, int] | None = None  # (target cut, count) of the previous round: BO starts there
    # The count n of section 4.3 ranges over n_min..n_max (both default to n_c = ceil(gamma * K)); a range makes
    # the BO space two-dimensional (target cut x count), as in the paper.
    n_min: int | None = Field(default=None, ge=1, le=MAX_SPLIT_DEVICES)
    n_max: int | None = Field(default=None, ge=1, le=MAX_SPLIT_DEVICES)
    # Send and receive buffers for the activations and gradients crossing the cuts count in device memory
    # (spec 4.2's 2*(O(j)+O(V-h)) term); off only for the paper's worked examples (U4).
    comm_buffers: bool = True
    # Spec 4.2: feasibility may count the cost-aware recomputation footprint M_persist + l_peak (Algorithm 3 with
    # theta = l_peak) where the full activations do not fit, and T_i(j) then includes T_recompute.
    plan_with_recompute: bool = False

    @model_validator(mode="after")
    def _counts(self) -> SplitOptions:
        lo, hi = self.n_min, self.n_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"n_min {lo} exceeds n_max {hi}")
        return self

    def candidates(self) -> int:
        """n_c = ceil(gamma * K): how many devices the central manager hands the MECs (spec 5.3)."""
        return min(MAX_SPLIT_DEVICES, math.ceil(self.gamma * self.participants - 1e-9))

    def count_range(self) -> tuple[int, int]:
        """(n_min, n_max) of the search space; each defaults to n_c."""
        n_c = self.candidates()
        lo = self.n_min if self.n_min is not None else min(n_c, self.n_max or n_c)
        hi = self.n_max if self.n_max is not None else max(n_c, lo)
        return lo, hi


class DeviceCut(BaseModel):
    """One selected device and its cut, with its predicted round time (seconds) and device-side memory (bytes). Of
    ``round_s``: ``compute_s`` the device computes, ``transfer_s`` its iterations' tensors take on its link and
    ``mec_s`` its MEC computes for it (shared with the MEC's other devices); the rest is its part's weights down and
    up and its setup."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    mec: Name
    cut: int = Field(ge=1, le=MAX_UNITS)
    round_s: NonNegative
    memory_bytes: Bytes
    compute_s: NonNegative = 0.0
    transfer_s: NonNegative = 0.0
    mec_s: NonNegative = 0.0


class SplitSelection(BaseModel):
    """The matrix S of one round: the selected devices with their cuts (Eq. 8/10), the objective F it reaches,
    the predicted round time T_system (Eq. 5), the BO point (target cut, count) it decodes from, how many points
    the solver evaluated, and the devices left out because no cut fits their budget."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    selected: list[DeviceCut] = Field(max_length=MAX_SPLIT_DEVICES)
    objective: float = Field(allow_inf_nan=False)
    t_system_s: NonNegative
    target_cut: int = Field(ge=1, le=MAX_UNITS)
    count: int = Field(ge=0, le=MAX_SPLIT_DEVICES)
    evaluations: int = Field(ge=0)
    solver: Solver
    infeasible: list[Name] = Field(default_factory=list, max_length=MAX_SPLIT_DEVICES)

    @model_validator(mode="after")
    def _distinct(self) -> SplitSelection:
        if len({d.node for d in self.selected}) != len(self.selected):
            raise ValueError("a device is selected twice")
        return self

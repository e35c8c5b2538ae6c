"""The HMP planner's contract: what a device's block profile holds, what the planner is asked, what it answers.

Units: seconds, bytes, bytes per second. Everything here travels in MQTT messages, so lists are bounded and floats
finite. Latencies are of one layer's block on one device at the profile's sequence length ``seq_len`` (batch 1):
``mha_s[i]`` for ``heads[i]`` query heads, ``mlp_s[i]`` for ``columns[i]`` MLP columns, ``con_s[i]`` for a
connective block (residual add and norm) on ``rows[i]`` rows (spec 1.1).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.planning.hmp.shares import MAX_SHARDS, HmpShares
from edgeswarm.values.limits import MAX_EPOCH, MAX_ID_CHARS, MAX_MEMORY_BYTES
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.text_model import TextModelConfig
from edgeswarm.wire.schema import Name

MAX_GRID = 64
MAX_SEQ = 1 << 17
MAX_LINKS = MAX_SHARDS * (MAX_SHARDS - 1)
MAX_PROFILED_S = 1e6  # a block's measured seconds: beyond, a profile is not a measurement (and sums of it overflow)
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
ProfiledSeconds = Annotated[float, Field(ge=0.0, le=MAX_PROFILED_S, allow_inf_nan=False)]
Grid = Annotated[list[Annotated[int, Field(ge=1, le=1 << 20)]], Field(min_length=1, max_length=MAX_GRID)]
Times = Annotated[list[ProfiledSeconds], Field(max_length=MAX_GRID)]

HmpMode = Literal["galaxy", "megatron", "sp", "local"]
ShiftMode = Literal["paper", "water"]


class HmpPlanError(InfeasiblePlanError):
    """No plan of the asked parallelism fits: the message says which device is short of how many bytes, or what
    the cluster lacks, and what to change (more devices, bigger budgets, a smaller model or sequence)."""


class BlockProfile(BaseModel):
    """One device's measured block latencies for one model at ``seq_len`` rows (spec 1.1).

    ``heads``/``columns``/``rows`` are ascending grids; ``mha_s``/``mlp_s``/``con_s`` the median seconds at each.
    ``mha_decode_s``/``mlp_decode_s`` (optional, same grids, may be empty): one new row against a KV cache of
    ``seq_len`` tokens, for the generation prediction and a GEMM's one-row cost (``latency.gemm_s``).
    ``mha_phases_s``/``mha_decode_phases_s`` (optional: three seconds or none): the MHA block at every head, on
    ``seq_len`` rows and on one, as its phases took them (QKV, core, output projection; ``latency.phase_fractions``).
    ``head_s``: a decoder's logits of one row over its whole vocabulary (the ``lm_head``, which the rank holding a
    pass's last row computes once a pass; 0 for an encoder or a profile from before it). ``embed_s``: the embeddings
    of ``seq_len`` rows (token and position lookups, the embedding norm where the model has one; 0 for a profile from
    before it). ``compute`` names the torch device it was timed on."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    node: Name
    device_class: str = Field(default="", max_length=MAX_ID_CHARS)
    memory_budget_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    seq_len: int = Field(ge=1, le=MAX_SEQ)
    heads: Grid
    mha_s: Times
    columns: Grid
    mlp_s: Times
    rows: Grid
    con_s: Times
    mha_decode_s: Times = Field(default_factory=list)
    mlp_decode_s: Times = Field(default_factory=list)
    mha_phases_s: Times = Field(default_factory=list)
    mha_decode_phases_s: Times = Field(default_factory=list)
    head_s: ProfiledSeconds = 0.0
    embed_s: ProfiledSeconds = 0.0
    compute: str = Field(default="cpu", max_length=128)
    method: Literal["measured", "synthetic"] = "measured"

    @model_validator(mode="after")
    def _shape(self) -> BlockProfile:
        for grid, times, what in ((self.heads, self.mha_s, "mha_s"), (self.columns, self.mlp_s, "mlp_s"),
                                  (self.rows, self.con_s, "con_s")):
            if grid != sorted(set(grid)):
                raise ValueError(f"the grid of {what} must be ascending and distinct")
            if len(times) != len(grid):
                raise ValueError(f"{what} has {len(times)} times for a grid of {len(grid)}")
        for times, grid, what in ((self.mha_decode_s, self.heads, "mha_decode_s"),
                                  (self.mlp_decode_s, self.columns, "mlp_decode_s")):
            if times and len(times) != len(grid):
                raise ValueError(f"{what} has {len(times)} times for a grid of {len(grid)}")
        for times, what in ((self.mha_phases_s, "mha_phases_s"), (self.mha_decode_phases_s, "mha_decode_phases_s")):
            if len(times) not in (0, 3):
                raise ValueError(f"{what} has {len(times)} times, not the MHA block's three phases")
        return self


class HmpCluster(BaseModel):
    """The planner's input: the model, the sequence length planned for, every device's profile and the links
    (symmetric: a pair missing in one direction uses the other; a missing pair is priced as the slowest link
    given, or fails when there is none and more than one device). ``model_name`` is for display."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: TextModelConfig
    model_name: str = Field(default="", max_length=MAX_ID_CHARS)
    seq_len: int = Field(ge=1, le=MAX_SEQ)
    devices: list[BlockProfile] = Field(min_length=1, max_length=MAX_SHARDS)
    links: list[LinkProfile] = Field(default_factory=list, max_length=MAX_LINKS)

    @model_validator(mode="after")
    def _names(self) -> HmpCluster:
        names = [d.node for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"a device appears twice in {names}")
        return self


class HmpOptions(BaseModel):
    """What to plan.

    ``mode``: ``galaxy`` (Algorithm 1), the baselines ``megatron`` (equal heads and columns), ``sp`` (every weight on
    every device), ``local`` (the fastest device that holds the model), or ``auto`` (the lowest predicted request time
    of those that fit, or one on fewer devices within 5% of it: ``plan.fewest_devices_within_margin``). ``exclude``:
    devices not to use. ``overlap``: allow tiling the collectives with the GEMMs (galaxy), where the model predicts the
    tiles faster. ``shift``: Algorithm 1's shifts as the paper has them (``paper``) or capped at each receiver's free
    memory (``water``, spec A4). ``paper``: the memory model is the weights alone (R_d = 0, spec 3.8); otherwise
    replicated parts, activations and the KV cache are reserved. ``prune``: try leaving out the slowest devices and keep
    the plan on the fewest devices predicted within 5% of the fastest (``plan.PRUNE_MARGIN``). ``max_tokens``: tokens
    the KV caches must hold (every request decoding at once; 0: prefill only). ``decode_cache``: the cache length of the
    per-token prediction (0: ``seq_len``). ``margin_bytes``: kept free on every device. ``direct_syncs``: passes of
    fewer rows than devices (decode steps) use direct collectives (``HmpShares.direct_syncs``), else ring ones.
    ``new_tokens``: the tokens a request generates; plans are compared on its predicted time, the prompt's prefill
    (which answers the first) and a decode step for each further token (``plan.request_s``; 0: the prefill alone)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: HmpMode | Literal["auto"] = "galaxy"
    exclude: list[Name] = Field(default_factory=list, max_length=MAX_SHARDS)
    overlap: bool = True
    shift: ShiftMode = "paper"
    paper: bool = False
    prune: bool = True
    max_tokens: int = Field(default=0, ge=0, le=MAX_SEQ * 64)
    decode_cache: int = Field(default=0, ge=0, le=MAX_SEQ)
    margin_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    direct_syncs: bool = True
    new_tokens: int = Field(default=0, ge=0, le=MAX_SEQ)


class LatencySplit(BaseModel):
    """Predicted seconds: ``total_s`` = ``compute_s`` + ``exposed_s``; ``comm_s`` is the raw communication time,
    of which ``exposed_s`` is not hidden behind compute."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    total_s: Seconds
    compute_s: Seconds
    comm_s: Seconds
    exposed_s: Seconds


class CommModel(BaseModel):
    """One layer's communication per device (spec 2.8): ``messages`` sent, ``bytes`` sent, ``broker_hops`` (every
    tensor goes sender -> receiver's broker -> receiver: one broker hop per message), and the link time of one
    ring step ``tau_s`` = message_s + latency_s + tile bytes / bandwidth on the slowest ring link."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    messages: int = Field(ge=0)
    bytes: int = Field(ge=0)
    broker_hops: int = Field(ge=0)
    tau_s: Seconds
    message_s: Seconds


class DecodePrediction(BaseModel):
    """One generated token with a KV cache of ``cache_tokens``: ``per_token_s`` seconds, of which ``network_s``
    is communication (``network_share`` = network_s / per_token_s)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    cache_tokens: int = Field(ge=0)
    per_token_s: Seconds
    network_s: Seconds
    network_share: float = Field(ge=0.0, le=1.0)


class HmpPlan(BaseModel):
    """A plan of one parallelism and its prediction.

    ``shares``: who computes which heads and columns (sp: every device holds all of them, ``heads`` = n_h and
    ``columns`` = f each; local: one device). ``rows``: the rows each device's connective blocks run on (galaxy and
    sp: the equal split, the first s mod D one more; megatron and local: all s). ``capacity``: V_d (Eq. 6, per
    second) of each planned device. ``memory_bytes``/``memory_budget_bytes``: per planned device.
    ``layer``/``model``: the predicted latency of one layer and of all layers. ``comm``: one layer's messages.
    ``decode``: the per-token prediction for decoders. ``logits_s``: the seconds of ``model.total_s`` that are the
    prompt's logits (its last row's lm_head, and their gather where the head is split), which a request generating
    no token never computes. ``left_out``: devices the plan does not use (excluded, or not worth their
    communication)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    workload: Literal["serve-hmp"] = "serve-hmp"
    model_name: str = Field(default="", max_length=MAX_ID_CHARS)
    seq_len: int = Field(ge=1, le=MAX_SEQ)
    shares: HmpShares
    rows: list[int] = Field(max_length=MAX_SHARDS)
    capacity: list[Seconds] = Field(max_length=MAX_SHARDS)
    memory_bytes: list[int] = Field(max_length=MAX_SHARDS)
    memory_budget_bytes: list[int] = Field(max_length=MAX_SHARDS)
    layer: LatencySplit
    model: LatencySplit
    comm: CommModel
    decode: DecodePrediction | None = None
    logits_s: Seconds = 0.0
    shift: ShiftMode = "paper"
    paper: bool = False
    left_out: list[Name] = Field(default_factory=list, max_length=MAX_SHARDS)
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)

    @property
    def mode(self) -> str:
        return self.shares.mode

    @property
    def devices(self) -> list[str]:
        return list(self.shares.devices)


class HmpVerdict(BaseModel):
    """One parallelism in a comparison: its plan, or why it does not fit (``reason``, said so a user can act)."""

    model_config = ConfigDict(frozen=True)

    mode: HmpMode
    plan: HmpPlan | None = None
    reason: str = Field(default="", max_length=4096)

    @property
    def feasible(self) -> bool:
        return self.plan is not None


class HmpComparison(BaseModel):
    """Galaxy, Megatron-TP, SP and Local on the same cluster and latency model."""

    model_config = ConfigDict(frozen=True)

    verdicts: list[HmpVerdict] = Field(max_length=4)

    def of(self, mode: str) -> HmpVerdict:
        return next(v for v in self.verdicts if v.mode == mode)

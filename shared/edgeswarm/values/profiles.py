"""What the profiler measures and the planner reads: pydantic models, saved as JSON and sent over MQTT.

Units: bytes, seconds, FLOPs, bytes per second. A "unit" is one element of a model's layer sequence
(edgeswarm.models.sequence): the planner may cut between any two consecutive units.

Profiles arrive from the network (in plan requests and profile reports), so every list, string and number is
bounded (edgeswarm.values.limits) and every float is finite: a profile that validates is one the planner
can hold and price.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.errors import ConfigError
from edgeswarm.values.limits import (
    MAX_BATCH_GRID,
    MAX_BATCH_SIZE,
    MAX_CONFIG_KEY_CHARS,
    MAX_CONFIG_KEYS,
    MAX_CONFIG_VALUE_CHARS,
    MAX_DEVICES,
    MAX_ID_CHARS,
    MAX_LINKS,
    MAX_MEMORY_BYTES,
    MAX_OPS_CHARS,
    MAX_SAMPLE_BYTES,
    MAX_UNIT_BYTES,
    MAX_UNIT_NAME_CHARS,
    MAX_UNITS,
)
from edgeswarm.wire.schema import Name

Optimizer = Literal["sgd", "momentum", "adam"]

Identifier = Annotated[str, Field(max_length=MAX_ID_CHARS)]
ConfigKey = Annotated[str, Field(max_length=MAX_CONFIG_KEY_CHARS)]
ConfigValue = int | float | Annotated[str, Field(max_length=MAX_CONFIG_VALUE_CHARS)] | bool
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
# One unit's times at every profiled batch size.
TimingRow = Annotated[list[Seconds], Field(min_length=1, max_length=MAX_BATCH_GRID)]
# How much longer (or shorter) units may take run in a row than timed one by one (ChainFactors): beyond this,
# something other than the caches is measured.
CHAIN_BOUNDS = (0.5, 2.0)
ChainFactor = Annotated[float, Field(ge=CHAIN_BOUNDS[0], le=CHAIN_BOUNDS[1], allow_inf_nan=False)]

# Optimizer state per parameter byte (spec section 2.2: k_opt).
# How far a measured compute speed may stray from its profile (measured over profiled): a tiny model's compute can
# run tens of times its profile (per-call overheads), and no fit may go further.
MIN_SCALE = 1 / 64
MAX_SCALE = 64.0

OPTIMIZER_STATE_FACTOR: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}


class ModelSpec(BaseModel):
    """A model by zoo name plus its config (for example {"num_classes": 10, "image_size": 32})."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Identifier
    config: dict[ConfigKey, ConfigValue] = Field(default_factory=dict, max_length=MAX_CONFIG_KEYS)


class UnitProfile(BaseModel):
    """One unit of the layer sequence, device independent.

    ``output_bytes_per_sample`` is a_l: the bytes per sample that cross a cut placed after this unit
    (for the last unit, the model's output). ``weight_bytes`` is w_l (trainable parameters);
    ``buffer_bytes`` are non-trainable buffers (BatchNorm statistics). Activation memory saved for
    backward at batch size b is ``activation_bytes_fixed + activation_bytes_per_sample * b``.
    ``flops_per_sample`` counts forward FLOPs of one sample.
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    index: int = Field(ge=0, lt=MAX_UNITS)
    name: str = Field(max_length=MAX_UNIT_NAME_CHARS)
    ops: str = Field(default="", max_length=MAX_OPS_CHARS)
    output_bytes_per_sample: int = Field(ge=0, le=MAX_SAMPLE_BYTES)
    weight_bytes: int = Field(ge=0, le=MAX_UNIT_BYTES)
    buffer_bytes: int = Field(default=0, ge=0, le=MAX_UNIT_BYTES)
    # May be negative: a unit can free more than it keeps (the cost model clips a stage's sum at zero).
    activation_bytes_fixed: int = Field(default=0, ge=-MAX_UNIT_BYTES, le=MAX_UNIT_BYTES)
    activation_bytes_per_sample: int = Field(default=0, ge=0, le=MAX_SAMPLE_BYTES)
    flops_per_sample: float = Field(default=0.0, ge=0)


class ModelProfile(BaseModel):
    """The device-independent part of a profile: the layer sequence of one model."""

    model_config = ConfigDict(frozen=True)

    model: ModelSpec
    fingerprint: Identifier
    input_bytes_per_sample: int = Field(ge=0, le=MAX_SAMPLE_BYTES)
    units: list[UnitProfile] = Field(min_length=1, max_length=MAX_UNITS)

    @model_validator(mode="after")
    def _indices(self) -> ModelProfile:
        if [u.index for u in self.units] != list(range(len(self.units))):
            raise ValueError("units must be numbered 0..L-1 in order")
        return self


class ChainFactors(BaseModel):
    """At one batch size of a ComputeProfile: the seconds of the whole model run as one stage (``whole``), and of
    its two halves each run as a stage (``half``, the two summed), over the sums of their units' times, each unit
    timed alone: forward, backward and served forward. Run in a row, units evict each other's weights and
    activations from the caches, the more the more of the model a stage holds, while the calls a row saves shrink
    it (MobileNetV2 at 32x32, one thread, forward and backward: whole 1.04x, half 0.96x at batch 4; 1.22x and 1.11x
    at batch 16, on this project's VM)."""

    model_config = ConfigDict(frozen=True)

    whole: tuple[ChainFactor, ChainFactor, ChainFactor]
    half: tuple[ChainFactor, ChainFactor, ChainFactor]


class ComputeProfile(BaseModel):
    """Per-unit forward and backward times of one model on one device, on a grid of batch sizes.

    ``forward_s[l][k]`` and ``backward_s[l][k]`` are the median seconds unit l takes at batch size
    ``batch_sizes[k]`` (ascending), in training mode. Backward covers the input gradient and the weight gradients.
    ``inference_s[l][k]`` is the forward as a served stage runs it (eval mode, no autograd): training's forward
    records autograd and took 1.3-1.7x longer on this project's models; None in profiles from before it.
    ``method`` says how the times were obtained: "measured" (every unit timed on the device) or
    "calibrated" (the host's timings scaled by the device's measured speed ratio, ``speed_ratio``).
    ``compute`` is the torch device the units were timed on ("cpu", "cuda:0 (NVIDIA ...)").
    ``cold_forward_s``, ``cold_backward_s`` and ``cold_inference_s`` are the seconds one call of a stage's forward,
    backward or served forward takes beyond its units' times when it starts after the device idled (caches and
    clocks gone cold: a stage waits on its peers between calls, and an emulated device sleeps), once per call
    whatever its units; 0 in profiles from before them.
    The unit times are their times alone scaled by ``chain[k].whole`` (a stage of every unit costs their sum);
    ``chain`` (one per batch size; None in profiles from before it) lets a planner price a shorter stage by its
    extent (``planning.vocabulary.extent_scale``).
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    model_fingerprint: Identifier
    device_fingerprint: Identifier
    batch_sizes: list[Annotated[int, Field(le=MAX_BATCH_SIZE)]] = Field(min_length=1, max_length=MAX_BATCH_GRID)
    forward_s: list[TimingRow] = Field(max_length=MAX_UNITS)
    backward_s: list[TimingRow] = Field(max_length=MAX_UNITS)
    inference_s: list[TimingRow] | None = Field(default=None, max_length=MAX_UNITS)
    method: Literal["measured", "calibrated"] = "measured"
    speed_ratio: float = Field(default=1.0, gt=0)
    compute: str = Field(default="cpu", max_length=128)
    cold_forward_s: Seconds = 0.0
    cold_backward_s: Seconds = 0.0
    cold_inference_s: Seconds = 0.0
    chain: list[ChainFactors] | None = Field(default=None, max_length=MAX_BATCH_GRID)

    @model_validator(mode="after")
    def _shape(self) -> ComputeProfile:
        if self.batch_sizes != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError("batch_sizes must be ascending, distinct and at least 1")
        k = len(self.batch_sizes)
        inference = self.inference_s if self.inference_s is not None else self.forward_s
        if len({len(self.forward_s), len(self.backward_s), len(inference)}) != 1 or any(
            len(row) != k for row in (*self.forward_s, *self.backward_s, *inference)
        ):
            raise ValueError("forward_s, backward_s and inference_s must be [unit][batch size] with one column per "
                             "batch size")
        if self.chain is not None and len(self.chain) != k:
            raise ValueError("chain must have one entry per batch size")
        return self

    def scaled(self, factor: float) -> ComputeProfile:
        """Every time of this profile (units' and cold calls') multiplied by ``factor``: the same device ``factor``
        times slower."""
        return self.model_copy(update={
            "forward_s": [[t * factor for t in row] for row in self.forward_s],
            "backward_s": [[t * factor for t in row] for row in self.backward_s],
            "inference_s": None if self.inference_s is None else [[t * factor for t in row]
                                                                  for row in self.inference_s],
            "cold_forward_s": self.cold_forward_s * factor, "cold_backward_s": self.cold_backward_s * factor,
            "cold_inference_s": self.cold_inference_s * factor})


# What a job measured of a device: training's forward and backward, serving's forward, or split learning's part
# against its FLOP count at the profiled rate (each its own ratio: a device's speeds at them differ).
Work = Literal["train", "serve", "split"]


class ComputeRefit(BaseModel):
    """One device's compute speed as jobs measured it: ``scale`` is its measured compute time over what its profile
    (of model ``model_fingerprint`` on device ``device_fingerprint``) says, fitted over ``rounds`` rounds of
    ``work`` (training rounds measure the forward and backward, serving items the served forward: a device's two
    speeds differ); a job of that work that profiles the same pair starts from the profile times ``scale``
    (profiling.refits)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    model_fingerprint: Identifier
    node: Name
    device_fingerprint: Identifier
    scale: float = Field(ge=MIN_SCALE, le=MAX_SCALE)
    rounds: int = Field(ge=1, le=1_000_000)
    work: Work = "train"


class LinkRefit(BaseModel):
    """A link's transfers as jobs measured them: ``scale`` is the time a tensor's chunks after its first took to
    arrive between nodes ``a`` and ``b`` (either way; ``a`` sorts first) over what the link's probed bandwidth and
    per-message cost price them at, fitted over ``rounds`` rounds; a job over both nodes prices the link at its
    probe's figures times ``scale`` (profiling.refits)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    a: Name
    b: Name
    scale: float = Field(ge=MIN_SCALE, le=MAX_SCALE)
    rounds: int = Field(ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _ordered(self) -> LinkRefit:
        if not self.a < self.b:
            raise ValueError(f"a link refit's nodes go in order, a before b: not {self.a!r}, {self.b!r}")
        return self


class DeviceInfo(BaseModel):
    """One device as the planner sees it. ``memory_budget_bytes`` is u_d; ``compute_flops`` is the
    measured training speed (forward+backward FLOPs per second on the profiled model)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    node: Name
    device_class: str = Field(default="", max_length=MAX_ID_CHARS)
    fingerprint: Identifier
    memory_budget_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    compute_flops: float = Field(default=0.0, ge=0)


class LinkProfile(BaseModel):
    """A measured link from ``src`` to ``dst``: bulk bandwidth (bytes per second) and round-trip
    latency (seconds) over the MQTT data path, and the fixed costs of a message on it.

    ``latency_s`` and ``message_s`` are the link's own, net of the brokers' processing: ``message_s`` is what
    one tensor message (one chunk) adds on the link beyond its bytes over the bandwidth, one way. ``hop_s`` is
    what a message costs in the platform wherever it goes (the sender's encoding, one broker's routing, the
    receiver's decoding and dispatch: seconds, measured with no link crossed), so a message is priced at
    ``per_message_s``, the two together. ``request_s`` is one small control request of ``src``'s and its reply
    through the hub broker (seconds, the whole round trip), what a coordinator pays per request it waits on from
    that node. The three default to 0, so profiles measured before they existed still validate (a profile from
    before ``hop_s`` has the hop inside its ``message_s``).
    """

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    src: Name
    dst: Name
    bandwidth_bps: float = Field(gt=0)
    latency_s: float = Field(default=0.0, ge=0)
    message_s: float = Field(default=0.0, ge=0)
    request_s: float = Field(default=0.0, ge=0)
    hop_s: float = Field(default=0.0, ge=0)

    @property
    def per_message_s(self) -> float:
        """What one message costs beyond its bytes over the bandwidth, one way: the link's and the hop's (seconds)."""
        return self.message_s + self.hop_s


class LinkSample(BaseModel):
    """What a device received from ``src`` in tensors of several chunks, summed over a round: the bytes after each
    tensor's first chunk, those chunks, and the seconds from each first chunk to its last (the receiver's clock, so
    no clocks need agree). Priced on a link profile, that time is ``bytes / bandwidth + chunks * per_message_s``:
    the closed loop fits the link from the two."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    src: Name
    bytes: int = Field(ge=0, le=1 << 50)
    chunks: int = Field(ge=0, le=1 << 40)
    seconds: float = Field(ge=0, le=1e6)


class DeviceProfileEntry(BaseModel):
    """A device and its compute profile for the cluster's model."""

    model_config = ConfigDict(frozen=True)

    device: DeviceInfo
    compute: ComputeProfile


class ClusterProfile(BaseModel):
    """Everything the planner needs: the model's sequence, every device's timings and budget, and links.

    Links are symmetric: a pair missing in one direction uses the other; a pair missing in both is an
    error at planning time.
    """

    model_config = ConfigDict(frozen=True)

    model: ModelProfile
    devices: list[DeviceProfileEntry] = Field(max_length=MAX_DEVICES)
    links: list[LinkProfile] = Field(default_factory=list, max_length=MAX_LINKS)

    def without(self, *nodes: str) -> ClusterProfile:
        """This profile without devices ``nodes`` and their links."""
        gone = set(nodes)
        return ClusterProfile(model=self.model, devices=[e for e in self.devices if e.device.node not in gone],
                              links=[lk for lk in self.links if not gone & {lk.src, lk.dst}])


def parse_config(items: list[str]) -> dict[str, int | float | str | bool]:
    """``KEY=VALUE`` strings (a model's ``--config`` options) as a ModelSpec config: true/false, integers and numbers
    are typed, the rest strings. Raises ConfigError for one without ``=``."""
    config: dict[str, int | float | str | bool] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--config {item!r} is not KEY=VALUE")
        config[key.strip()] = _typed(raw.strip())
    return config


def _typed(raw: str) -> int | float | str | bool:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw

"""The U-split of split federated learning (spec 4.2, 7): a zoo model cut into front, middle and tail parts, the
steps of one iteration on each side of the wire, the vanilla split of the SplitFed baseline, and the bytes an
iteration sends.

Units are those of ``edgeswarm.models.sequence`` (indices from 0). For V units, cut j (1..V-h) and tail h, the
device holds the front, units [0, j), and the tail, [V-h, V); the MEC holds the middle, [j, V-h). j = V-h leaves the
middle empty: plain local training. The vanilla split gives the server ("server" part) units [j, V) and the labels.

Every part keeps the full model's state-dict keys, so the parts of one device reassemble into exactly the global
model's state dict, and a part loads its share from the global one. Parts are built independently from the model
spec and the split point: the device never allocates the MEC's weights, nor the MEC the device's.

One U-split iteration, tensors crossing the wire between the calls (each call returns its tensor detached):

    a_j   = device.front_forward(x)          # D -> MEC
    a_mid = mec.forward(a_j)                  # MEC -> D
    step  = device.tail_step(a_mid, y)        # loss, tail backward and update; step.g_mid D -> MEC
    g_j   = mec.backward(step.g_mid)          # middle backward and update; MEC -> D
    device.front_backward(g_j)                # front backward and update

Each party updates its parameters right after computing their gradients (spec 7); since no party's gradients depend
on another's new weights, one such iteration equals one centralised step of the whole model (U10).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model, example_input, example_target, unit_count, without_weights
from edgeswarm.splitfed.recompute import ActivationLedger, UnitChain
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import OptimizerSpec

# Spec 7: SGD with momentum 0.9 and weight decay 5e-4 for CV; the learning rate is a config value (0.01 default).
SPLITFED_OPTIMIZER = OptimizerSpec(name="momentum", lr=0.01, momentum=0.9, weight_decay=5e-4)

Role = Literal["front", "middle", "tail", "server"]


class SplitProtocolError(EdgeswarmError):
    """A side of a split iteration was driven out of order (a backward without its forward) or given a tensor that
    does not belong to the iteration."""


class SplitPoint(BaseModel):
    """Where a model of ``units`` (V) units is cut: ``cut`` j in 1..V-h and ``tail`` h in 0..V-1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    units: int = Field(ge=2)
    cut: int = Field(ge=1)
    tail: int = Field(default=1, ge=0)

    @model_validator(mode="after")
    def _inside(self) -> SplitPoint:
        if self.tail >= self.units:
            raise ValueError(f"tail {self.tail} leaves no unit of {self.units} before it")
        if self.cut > self.units - self.tail:
            raise ValueError(f"cut {self.cut} is past the tail: use 1..{self.units - self.tail}")
        return self

    def bounds(self, role: Role) -> tuple[int, int]:
        """Units [start, end) of ``role`` (possibly empty: start == end)."""
        v, j, h = self.units, self.cut, self.tail
        return {"front": (0, j), "middle": (j, v - h), "tail": (v - h, v), "server": (j, v)}[role]

    @property
    def offloaded(self) -> bool:
        """Whether the MEC has any unit (false for j = V-h: local training)."""
        return self.cut < self.units - self.tail


def split_point(spec: ModelSpec, cut: int, tail: int = 1) -> SplitPoint:
    """The split point of zoo model ``spec`` at ``cut`` with ``tail`` units kept on the device after the MEC's part.
    Raises ConfigError for a bad spec or a cut outside 1..V-tail, ModelTraceError when the model cannot be traced."""
    units = unit_count(spec)
    try:
        return SplitPoint(units=units, cut=cut, tail=tail)
    except ValueError as exc:
        raise ConfigError(f"{spec.name} has {units} units: {exc}") from None


class SplitPart:
    """Units [start, end) of a model as a list of one-unit stage modules (``units``, possibly empty: an identity).

    Its state dict uses the full model's keys. ``forward`` runs the units in order with ordinary autograd (the MEC's
    way); a device trains its parts through ``recompute.UnitChain``."""

    def __init__(self, role: Role, start: int, end: int, units: list[nn.Module]) -> None:
        self.role, self.start, self.end, self.units = role, start, end, units

    def __len__(self) -> int:
        return len(self.units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The part's output for ``x`` (``x`` itself for an empty part)."""
        for unit in self.units:
            x = unit(x)
        return x

    __call__ = forward

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of the part's units, each once."""
        seen: set[int] = set()
        for unit in self.units:
            for p in unit.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def buffers(self) -> Iterator[torch.Tensor]:
        """Every buffer of the part's units, each once."""
        seen: set[int] = set()
        for unit in self.units:
            for b in unit.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    yield b

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The part's parameters and persistent buffers under the full model's keys (detached, not copied)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for key, value in unit.state_dict(keep_vars=False).items():
                out[key] = value
        return out

    def keys(self) -> list[str]:
        """The full-model state-dict keys this part owns."""
        return list(self.state_dict())

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy this part's share of a full-model ``state`` into it (extra keys are ignored: they are other parts').
        Raises ConfigError naming the first missing key or a shape mismatch."""
        for unit in self.units:
            own = unit.state_dict()
            missing = [k for k in own if k not in state]
            if missing:
                raise ConfigError(f"the {self.role} part needs {missing[0]!r}, which the state does not have")
            try:
                unit.load_state_dict({k: state[k] for k in own}, strict=True)
            except RuntimeError as exc:
                raise ConfigError(f"the {self.role} part cannot load the state: {exc}") from None

    def to(self, device: torch.device) -> SplitPart:
        """Move the part's units to ``device`` (in place); returns the part."""
        for unit in self.units:
            unit.to(device)
        return self

    def train(self, mode: bool = True) -> SplitPart:
        """Set training mode on every unit; returns the part."""
        for unit in self.units:
            unit.train(mode)
        return self

    def eval(self) -> SplitPart:
        """Evaluation mode (BatchNorm uses its running statistics); returns the part."""
        return self.train(False)

    def param_bytes(self) -> int:
        """Bytes of the part's parameters."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _has_volatile_buffers(units: Sequence[nn.Module]) -> bool:
    # Non-persistent buffers (position ids) are not in a state dict: a weightless build could not fill them.
    for unit in units:
        if len(unit.state_dict()) != sum(1 for _ in unit.parameters()) + sum(1 for _ in unit.buffers()):
            return True
    return False


def _check_point(spec: ModelSpec, point: SplitPoint, units: int) -> None:
    if units != point.units:
        raise ConfigError(f"the split point is for {point.units} units, but {spec.name} has {units}")


def build_parts(spec: ModelSpec, point: SplitPoint, roles: Sequence[Role], *,
                state: Mapping[str, torch.Tensor] | None = None,
                compute: torch.device | None = None) -> dict[Role, SplitPart]:
    """The ``roles`` parts of zoo model ``spec`` split at ``point`` (several roles of one side, the device's front
    and tail say, from one trace of the model), in training mode, on ``compute`` (None: where they were built, the
    CPU). An empty range (the middle at j = V-h) gives an empty part, an identity.

    Without ``state`` the parts have the zoo's seeded initial weights (those of ``build_model(spec)``). With a
    full-model ``state`` (the round's global model) the parts are built without weights and their share of
    ``state`` is loaded: no other part's weight is ever allocated. Raises ConfigError for a bad spec, a point that
    does not belong to it, or a state that lacks the parts' keys."""
    if state is not None:
        with without_weights():
            seq = layer_sequence(build_model(spec))
            _check_point(spec, point, len(seq))
            meta = {r: [seq.build_stage(i, i + 1) for i in range(*point.bounds(r))] for r in roles}
        if not any(_has_volatile_buffers(units) for units in meta.values()):
            on = compute if compute is not None else torch.device("cpu")
            out: dict[Role, SplitPart] = {}
            for r, units in meta.items():
                part = SplitPart(r, *point.bounds(r), [u.to_empty(device=on) for u in units])
                part.load_state(state)
                out[r] = part.train()
            return out
    seq = layer_sequence(build_model(spec))
    _check_point(spec, point, len(seq))
    out = {r: SplitPart(r, *point.bounds(r), [seq.build_stage(i, i + 1) for i in range(*point.bounds(r))])
           for r in roles}
    del seq  # the other units' weights go with the sequence: only these parts' stay referenced
    for part in out.values():
        if state is not None:
            part.load_state(state)
        if compute is not None:
            part.to(compute)
        part.train()
    return out


def make_optimizer(part: SplitPart, optimizer: OptimizerSpec = SPLITFED_OPTIMIZER) -> torch.optim.Optimizer | None:
    """The optimizer ``optimizer`` names over ``part``'s parameters (None for a part without any)."""
    params = list(part.parameters())
    if not params:
        return None
    if optimizer.name == "adam":
        return torch.optim.Adam(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay)
    momentum = optimizer.momentum if optimizer.name == "momentum" else 0.0
    return torch.optim.SGD(params, lr=optimizer.lr, momentum=momentum, weight_decay=optimizer.weight_decay)


def _step(opt: torch.optim.Optimizer | None) -> None:
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def sample_losses(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's cross-entropy (a token model's: the mean over its positions), without a graph."""
    with torch.no_grad():
        if output.dim() == 3:
            return nn.functional.cross_entropy(output.transpose(1, 2), labels, reduction="none").mean(dim=1)
        return nn.functional.cross_entropy(output, labels, reduction="none")


def split_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; token outputs [N, S, V] with labels [N, S] are flattened to N*S terms."""
    if output.dim() == 3:
        return nn.functional.cross_entropy(output.flatten(0, 1), labels.flatten())
    return nn.functional.cross_entropy(output, labels)


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(opt: torch.optim.Optimizer | None) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (momentum buffers, Adam's moments)."""
    if opt is None:
        return 0
    return _tensor_bytes(v for state in opt.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)


@dataclass(frozen=True)
class TailStep:
    """What the device's tail step gives: ``g_mid`` (dLoss/da_mid, to the MEC), the batch's mean ``loss`` and each
    sample's ``losses`` (detached, on the compute device: the loss prober's and the pruner's input)."""

    g_mid: torch.Tensor
    loss: float
    losses: torch.Tensor


@dataclass(frozen=True)
class ServerStep:
    """What the vanilla split's server step gives: ``g_j`` (dLoss/da_j, to the device) and the mean ``loss``."""

    g_j: torch.Tensor
    loss: float


@dataclass(frozen=True)
class DeviceMemory:
    """A device's measured training memory in bytes: the peak of activation bytes its runtime held (inputs, saved
    tensors, checkpoints, the tensors sent and received, gradients in flight) and its persistent bytes (parameters,
    their gradients, optimizer state, buffers)."""

    activation_peak_bytes: int
    persistent_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Activation peak plus persistent bytes."""
        return self.activation_peak_bytes + self.persistent_bytes


class DeviceSide:
    """The device's half of a split: the front (with the Memory Reducer's ``plan``, one strategy per segment of the
    front, see ``recompute.UnitChain``) and, for the U-split, the tail. ``tail`` None (or empty) is the vanilla
    split's device, which holds the front only. One ``ActivationLedger`` measures both parts."""

    def __init__(self, front: SplitPart, tail: SplitPart | None = None, *,
                 optimizer: OptimizerSpec = SPLITFED_OPTIMIZER, plan: Sequence[str] | None = None) -> None:
        if not len(front):
            raise ConfigError("the device's front part needs at least one unit")
        self.front, self.tail = front, tail if tail is not None and len(tail) else None
        self.ledger = ActivationLedger()
        self.front_chain = UnitChain(front.units, plan, ledger=self.ledger, input_grad=False, name="front")
        self.tail_chain = (UnitChain(self.tail.units, None, ledger=self.ledger, input_grad=True, name="tail")
                           if self.tail is not None else None)
        self.front_opt = make_optimizer(front, optimizer)
        self.tail_opt = make_optimizer(self.tail, optimizer) if self.tail is not None else None
        self._persistent = 0

    def front_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Step 1: a_j = front(x), detached, to send to the MEC. The front keeps what its backward needs; a_j counts
        as the device's send buffer until the MEC's answer (a_mid, or g_j for the vanilla split) arrives."""
        a_j = self.front_chain.forward(x)
        self.ledger.hold(("sent", "a_j"), a_j)
        return a_j

    def tail_step(self, a_mid: torch.Tensor, labels: torch.Tensor) -> TailStep:
        """Step 3: the tail on the MEC's ``a_mid``, the loss on ``labels``, the tail's backward and update; returns
        g_mid for the MEC. Raises SplitProtocolError for a vanilla-split device (no tail)."""
        if self.tail_chain is None:
            raise SplitProtocolError("this device has no tail: the vanilla split's server computes the loss")
        self.ledger.release(("sent", "a_j"))
        self.ledger.hold(("received", "a_mid"), a_mid)
        z = self.tail_chain.forward(a_mid).requires_grad_(True)
        loss = split_loss(z, labels)
        loss.backward()
        assert z.grad is not None
        losses = sample_losses(z.detach(), labels)
        g_mid = self.tail_chain.backward(z.grad)
        assert g_mid is not None
        self.ledger.release(("received", "a_mid"))
        g_mid = g_mid.detach()
        self.ledger.hold(("sent", "g_mid"), g_mid)  # the send buffer, until g_j comes back
        self._note_persistent()
        _step(self.tail_opt)
        return TailStep(g_mid=g_mid, loss=float(loss.detach()), losses=losses)

    def front_backward(self, g_j: torch.Tensor) -> None:
        """Step 5: the front's backward with the MEC's ``g_j`` and its update. Raises RecomputeError without a
        forward."""
        self.ledger.release(("sent", "a_j"))
        self.ledger.release(("sent", "g_mid"))
        self.ledger.hold(("received", "g_j"), g_j)
        self.front_chain.backward(g_j)
        self.ledger.release(("received", "g_j"))
        self._note_persistent()
        _step(self.front_opt)

    def _note_persistent(self) -> None:
        # Gradients exist between a backward and the step; optimizer state from the first step on: take the
        # largest sum seen (measured at each backward, before the step frees the gradients).
        parts = [self.front] + ([self.tail] if self.tail is not None else [])
        params = [p for part in parts for p in part.parameters()]
        now = (_tensor_bytes(params) + _tensor_bytes(p.grad for p in params if p.grad is not None)
               + _tensor_bytes(b for part in parts for b in part.buffers())
               + optimizer_state_bytes(self.front_opt) + optimizer_state_bytes(self.tail_opt))
        self._persistent = max(self._persistent, now)

    def memory(self) -> DeviceMemory:
        """The measured memory so far (the optimizer state appears after the first update)."""
        self._note_persistent()
        return DeviceMemory(activation_peak_bytes=self.ledger.peak_bytes, persistent_bytes=self._persistent)

    def reset(self) -> None:
        """Forget an unfinished iteration."""
        self.front_chain.reset()
        if self.tail_chain is not None:
            self.tail_chain.reset()
        self.ledger.clear()


class MecSide:
    """The MEC's half of a U-split: the middle part and its optimizer. It never sees labels."""

    def __init__(self, middle: SplitPart, *, optimizer: OptimizerSpec = SPLITFED_OPTIMIZER) -> None:
        self.middle = middle
        self.opt = make_optimizer(middle, optimizer)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, a_j: torch.Tensor) -> torch.Tensor:
        """Step 2: a_mid = middle(a_j), detached, to send back. Keeps the graph until ``backward``."""
        inp = a_j.detach().requires_grad_(a_j.is_floating_point())
        with torch.enable_grad():
            out = self.middle(inp)
        self._pending = (inp, out)
        return out.detach()

    def backward(self, g_mid: torch.Tensor) -> torch.Tensor:
        """Step 4: backward through the middle with the device's ``g_mid``, the middle's update; returns g_j.
        Raises SplitProtocolError without a forward, or for a gradient of another shape than a_mid."""
        if self._pending is None:
            raise SplitProtocolError("the MEC got g_mid without a forward")
        inp, out = self._pending
        self._pending = None
        if g_mid.shape != out.shape:
            raise SplitProtocolError(f"g_mid has shape {tuple(g_mid.shape)}, but a_mid had {tuple(out.shape)}")
        if out.requires_grad:
            torch.autograd.backward(out, g_mid)
        g_j = inp.grad if inp.grad is not None else g_mid
        _step(self.opt)
        return g_j.detach()

    def reset(self) -> None:
        """Forget an unfinished iteration."""
        self._pending = None


class ServerSide:
    """The vanilla split's server (SplitFed baseline): units [j, V) and the loss, with the labels the device sent."""

    def __init__(self, server: SplitPart, *, optimizer: OptimizerSpec = SPLITFED_OPTIMIZER) -> None:
        if not len(server):
            raise ConfigError("the server part needs at least one unit")
        self.server = server
        self.opt = make_optimizer(server, optimizer)

    def step(self, a_j: torch.Tensor, labels: torch.Tensor) -> ServerStep:
        """Forward, loss, backward and update of the server part; returns g_j for the device."""
        inp = a_j.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = split_loss(self.server(inp), labels)
            loss.backward()
        assert inp.grad is not None
        _step(self.opt)
        return ServerStep(g_j=inp.grad.detach(), loss=float(loss.detach()))


def run_usplit_iteration(device: DeviceSide, mec: MecSide, x: torch.Tensor, labels: torch.Tensor) -> float:
    """One U-split iteration in one process (the five steps in order); returns the batch's mean loss."""
    a_j = device.front_forward(x)
    a_mid = mec.forward(a_j)
    step = device.tail_step(a_mid, labels)
    device.front_backward(mec.backward(step.g_mid))
    return step.loss


# --- message accounting (U11) -----------------------------------------------------------------------------


class IterationBytes(BaseModel):
    """Bytes one iteration sends between a device and its MEC: ``up`` device -> MEC, ``down`` MEC -> device.
    ``labels`` is the part of ``up`` that is labels (vanilla split only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    up: int = Field(ge=0)
    down: int = Field(ge=0)
    labels: int = Field(default=0, ge=0)

    @property
    def total(self) -> int:
        """Both directions."""
        return self.up + self.down


def cut_numel(spec: ModelSpec, point: SplitPoint) -> tuple[int, int]:
    """Elements per sample of the tensors crossing cut j (a_j) and cut V-h (a_mid), from a weightless trace."""
    x = example_input(spec, 1)
    with without_weights():
        seq = layer_sequence(build_model(spec))
        a = torch.empty(x.shape, dtype=x.dtype) if x.is_floating_point() else torch.zeros(x.shape, dtype=x.dtype)
        sizes = []
        for i in range(point.units - point.tail):
            a = seq.build_stage(i, i + 1)(a)
            sizes.append(math.prod(a.shape))
    return sizes[point.cut - 1], sizes[-1]


def bytes_per_iteration(spec: ModelSpec, point: SplitPoint, batch_size: int, *, vanilla: bool = False,
                        dtype_bytes: int = 4, label_bytes: int = 8) -> IterationBytes:
    """U11: the bytes of one iteration at ``batch_size`` with activations of ``dtype_bytes`` (fp32: 4).

    U-split: up = B*(numel(j) + numel(V-h))*dtype_bytes (a_j and g_mid), down the same (a_mid and g_j): in all
    8*B*(numel(j) + numel(V-h)) for fp32. Vanilla: up = B*numel(j)*dtype_bytes plus the labels (``label_bytes``
    per label: int64), down = B*numel(j)*dtype_bytes (g_j). Local training (no middle, U-split) sends nothing."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, not {batch_size}")
    n_j, n_mid = cut_numel(spec, point)
    if vanilla:
        labels = batch_size * label_bytes * _labels_per_sample(spec)
        act = batch_size * n_j * dtype_bytes
        return IterationBytes(up=act + labels, down=act, labels=labels)
    if not point.offloaded:
        return IterationBytes(up=0, down=0)
    one_way = batch_size * (n_j + n_mid) * dtype_bytes
    return IterationBytes(up=one_way, down=one_way)


def _labels_per_sample(spec: ModelSpec) -> int:
    return example_target(spec, 1).numel()

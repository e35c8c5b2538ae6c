"""A train-splitfed party's part of the model, made and run: the device's front and tail (or the whole model for
FedAvg, or the front alone for the vanilla split), the MEC's middle (or everything after the cut for the vanilla
split), and the reassembly of a device's local model from both, with the MEC's estimate of its label distribution.

The torch of the split itself is ``split`` (the five U-split steps, built parts, the optimizer) and ``recompute``
(the memory reducer); this module ties it to a round's setup: the split point of a mode, the flat weight layouts
that cross the wire, the device's own data partition, its memory plan under its budget, and sample pruning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from edgeswarm.data import open_dataset
from edgeswarm.data.partition import Partition, device_view, partition_dataset
from edgeswarm.devices.compute import to_host
from edgeswarm.errors import ConfigError, MemoryBudgetError
from edgeswarm.messages.splitfed import RoundSetup
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model, example_input, without_weights
from edgeswarm.planning.splitfed.cost import device_memory
from edgeswarm.planning.splitfed.recompute import device_segments, plan_recompute
from edgeswarm.runtime.exchange import ExchangeAborted
from edgeswarm.splitfed.estimator import auxiliary_set, class_gradients, obtain_dis, oracle_distribution
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.splitfed.pruning import PruningSpec, prune_step
from edgeswarm.splitfed.split import (
    DeviceSide,
    MecSide,
    Role,
    ServerSide,
    SplitPoint,
    TailStep,
    build_parts,
)
from edgeswarm.splitfed.weights import Layout, flatten, layout_of, unflatten
from edgeswarm.values.specs import OptimizerSpec

if TYPE_CHECKING:
    from edgeswarm.data.base import Dataset
    from edgeswarm.runtime.program import ComputeGate
    from edgeswarm.values.profiles import ModelSpec

T = TypeVar("T")


def _direct(fn: Callable[[], T]) -> T:
    return fn()


def point_of(setup: RoundSetup, cut: int) -> SplitPoint:
    """The split point of ``cut`` in ``setup``'s mode: the U-split keeps the tail on the device; the vanilla split
    has none; local training is the cut that leaves the MEC nothing. The model's unit count is traced once per model
    (the first call must hold the compute gate alone); later calls trace nothing. Raises ConfigError for a cut the
    model does not have."""
    training = setup.training
    units = _unit_count(setup.model.model_dump_json())
    tail = 0 if training.mode == "vanilla" else training.tail
    if training.mode == "local":
        cut = units - tail
    try:
        return SplitPoint(units=units, cut=cut, tail=tail)
    except ValueError as exc:
        raise ConfigError(f"{setup.model.name} has {units} units: {exc}") from None


def device_roles(setup: RoundSetup) -> tuple[Role, ...]:
    """The parts a device holds in ``setup``'s mode."""
    return ("front",) if setup.training.mode == "vanilla" else ("front", "tail")


def trains_alone(setup: RoundSetup, point: SplitPoint) -> bool:
    """Whether a device split at ``point`` trains without its MEC: local training, or the U-split's cut that leaves
    the MEC an empty middle (j = V-h), which the central manager prices as local training. Sending the tensors
    through an identity middle would cost four messages an iteration for nothing (on a 50 Mbps Wi-Fi link, LeNet-5's
    round 0.65 s against 0.45 s alone). The vanilla split's server always computes the loss."""
    mode = setup.training.mode
    return mode == "local" or (mode == "usplit" and not point.offloaded)


def mec_roles(setup: RoundSetup) -> tuple[Role, ...]:
    """The parts an MEC holds in ``setup``'s mode (none for local training)."""
    return {"usplit": ("middle",), "vanilla": ("server",), "local": ()}[setup.training.mode]  # type: ignore[return-value]


def optimizer_of(setup: RoundSetup) -> OptimizerSpec:
    """Both parties' optimizer (spec section 7): SGD with the round's momentum and weight decay."""
    t = setup.training
    return OptimizerSpec(name="momentum" if t.momentum > 0 else "sgd", lr=t.lr, momentum=t.momentum,
                         weight_decay=t.weight_decay)


@lru_cache(maxsize=16)
def _unit_count(model_json: str) -> int:
    from edgeswarm.values.profiles import ModelSpec

    with without_weights():
        return len(layer_sequence(build_model(ModelSpec.model_validate_json(model_json))))


@lru_cache(maxsize=16)
def _global_layout(model_json: str) -> Layout:
    from edgeswarm.values.profiles import ModelSpec

    with without_weights():
        return layout_of(build_model(ModelSpec.model_validate_json(model_json)).state_dict())


@lru_cache(maxsize=64)
def _part_keys(model_json: str, units: int, bounds: tuple[tuple[int, int], ...]) -> tuple[str, ...]:
    from edgeswarm.values.profiles import ModelSpec

    with without_weights():
        seq = layer_sequence(build_model(ModelSpec.model_validate_json(model_json)))
        return tuple(k for start, end in bounds for i in range(start, end)
                     for k in seq.build_stage(i, i + 1).state_dict())


def global_layout(model: ModelSpec) -> Layout:
    """The whole model's flat layout (what SplitGlobal and SplitUpdate carry)."""
    return _global_layout(model.model_dump_json())


def part_layout(setup: RoundSetup, cut: int, roles: tuple[Role, ...]) -> Layout:
    """The flat layout of the parts ``roles`` at ``cut``: the whole model's entries those units hold, in its
    order."""
    point = point_of(setup, cut)
    keys = _part_keys(setup.model.model_dump_json(), point.units, tuple(point.bounds(r) for r in roles))
    return global_layout(setup.model).subset(keys)


@lru_cache(maxsize=8)
def _partition(setup_json: str) -> tuple[Dataset, Partition]:
    setup = RoundSetup.model_validate_json(setup_json)
    dataset = open_dataset(setup.dataset, setup.model)
    return dataset, partition_dataset(dataset, setup.partition.devices, setup.partition)


def partition_of(setup: RoundSetup) -> tuple[Dataset, Partition]:
    """The data set and its division among the job's devices (the same on every node: seeded)."""
    key = RoundSetup(model=setup.model, dataset=setup.dataset, partition=setup.partition,
                     training=setup.training.model_copy(update={"mode": "usplit"})).model_dump_json()
    return _partition(key)


class DeviceData:
    """One device's partition: its sample count and batches on the compute device."""

    def __init__(self, view: Dataset, compute: torch.device) -> None:
        self.view, self.compute = view, compute

    @property
    def size(self) -> int:
        return self.view.train_size

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.view.batch(ids)
        return x.to(self.compute), y.to(self.compute)


def input_bytes(model: ModelSpec, batch_size: int) -> int:
    """Bytes of one mini-batch of ``model``'s input: the device holds it through the iteration, so the central
    manager counts it in the device's memory (its ``overhead_bytes``)."""
    x = example_input(model, 1)
    return batch_size * x.numel() * x.element_size()


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` (a batch's per-sample losses, on the compute device) as a numpy array in host memory, where the
    pruner and the round's report read it."""
    host, ready = to_host(tensor)
    ready()
    return host.numpy()


def local_batches(active: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One local epoch over the ``active`` sample ids: shuffled, in batches of ``batch_size`` (the last may be
    smaller)."""
    order = rng.permutation(active)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@dataclass
class Epochs:
    """What a device's local epochs of one round did: iterations, samples seen (a pruned sample is not), the sum
    of their losses, each sample's last loss (by id), and the samples pruned."""

    iterations: int
    seen: int
    loss_sum: float
    losses: np.ndarray
    pruned: int


def run_epochs(part: DevicePart, data: DeviceData, index: int, round_index: int,
               step: Callable[[int, torch.Tensor, torch.Tensor, bool], np.ndarray],
               stop: threading.Event | None = None) -> Epochs:
    """Device ``index``'s local epochs of round ``round_index`` over ``data``: each epoch shuffles its active
    samples from a generator seeded by (the partition's seed, the round, the device), so any runtime that trains
    this device in this round sees the same batches in the same order; ``step(step, x, y, last)`` trains on one
    batch and returns its per-sample losses; the round's pruning (``training.sample_pruning``) follows every epoch
    but the last. Raises ExchangeAborted when ``stop`` is set between batches."""
    training = part.setup.training
    rng = np.random.default_rng((part.setup.partition.seed, round_index, index))
    active = np.arange(data.size)
    losses = np.zeros(data.size)
    iterations = seen = pruned = 0
    loss_sum = 0.0
    for epoch in range(training.epochs):
        batches = local_batches(active, training.batch_size, rng)
        for i, ids in enumerate(batches):
            if stop is not None and stop.is_set():
                raise ExchangeAborted("the round was replaced")
            x, y = data.batch(ids)
            per_sample = step(iterations, x, y, epoch == training.epochs - 1 and i == len(batches) - 1)
            losses[ids] = per_sample
            iterations += 1
            seen += len(ids)
            loss_sum += float(per_sample.sum())
        if training.sample_pruning and epoch + 1 < training.epochs:
            active, dropped = part.prune(active, losses, index, round_index, epoch + 1)
            pruned += dropped
    return Epochs(iterations=iterations, seen=seen, loss_sum=loss_sum, losses=losses, pruned=pruned)


class DevicePart:
    """The device's part of the model at ``cut`` for one round (see the module's docstring)."""

    def __init__(self, setup: RoundSetup, cut: int, *, compute: torch.device, gate: ComputeGate,
                 run: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """``run`` runs each compute as the device computes (``DeviceProfile.run``: its emulated slow-down; None:
        as it is)."""
        self.setup, self.cut, self.compute, self.gate = setup, cut, compute, gate
        self._device_run: Callable[[Callable[[], Any]], Any] = run or _direct
        self.compute_s = 0.0  # seconds its computes took, as the device computes them (the closed loop's measure)
        self.roles = device_roles(setup)
        # Tracing patches torch for every thread of the process: only with the gate held alone.
        with gate.building():
            self.point = point_of(setup, cut)
            self.layout = part_layout(setup, cut, self.roles)
            self.parts = build_parts(setup.model, self.point, self.roles, compute=compute)
        self.side = DeviceSide(self.parts["front"], self.parts.get("tail"), optimizer=optimizer_of(setup))
        self.alone = trains_alone(setup, self.point)
        self.recompute_summary = "none"

    def static_bytes(self) -> int:
        """The part's persistent training bytes: weights, gradients, the momentum buffer, buffers."""
        params = sum(p.param_bytes() for p in self.parts.values())
        buffers = sum(b.numel() * b.element_size() for p in self.parts.values() for b in p.buffers())
        return params * (3 if self.setup.training.momentum > 0 else 2) + buffers

    def load(self, flat: torch.Tensor) -> None:
        """Load the round's weights of the part (SplitPartWeights' vector). Raises WeightsError."""
        state = unflatten(flat, self.layout, device=self.compute)
        for part in self.parts.values():
            part.load_state(state)

    def flat(self) -> torch.Tensor:
        """The trained part as SplitDone carries it."""
        state: dict[str, torch.Tensor] = {}
        for part in self.parts.values():
            state.update(part.state_dict())
        return flatten(state, self.layout)

    def plan_memory(self, budget_bytes: int) -> None:
        """Choose the front's recomputation under ``budget_bytes`` of training memory (Algorithm 3 with the
        round's policy). Raises MemoryBudgetError when not even memory-centric recomputation fits: the MEC must
        move the cut."""
        training = self.setup.training
        if training.recompute == "off" or training.mode == "local":
            return
        with self.gate.building():
            cost = model_cost(self.setup.model, training.batch_size, optimizer_states=1 if training.momentum else 0)
        overhead = input_bytes(self.setup.model, training.batch_size)
        if training.recompute == "adaptive" and \
                device_memory(cost, self.cut, self.point.tail, overhead) <= budget_bytes:
            return  # it fits as the central manager planned it (the same memory model): nothing to recompute
        segs = device_segments(cost, self.cut, self.point.tail)
        allowance = budget_bytes - self.static_bytes() - overhead
        plan = plan_recompute(segs, allowance, theta_mode=training.theta, policy=training.recompute)
        if plan.outcome == "infeasible":
            raise MemoryBudgetError(f"cut {self.cut} needs {plan.l_peak_bytes / 2**20:.1f} MiB of activations at "
                                    f"its peak, but {max(allowance, 0) / 2**20:.1f} MiB of the budget are left after "
                                    "the weights: a shallower cut is needed")
        if plan.outcome == "recompute":
            # The planner's segments carry model positions; the front chain's start at its own unit 0 = position 0.
            by_start = {seg.units[0]: r for seg, r in zip(segs, plan.strategies, strict=True)
                        if seg.units[0] < self.cut}
            front = [by_start.get(seg.start, "memory") for seg in self.side.front_chain.segments]
            self.side.front_chain.set_plan(front)
            counts = {r: front.count(r) for r in ("speed", "memory") if r in front}
            self.recompute_summary = ", ".join(f"{n} {r}-centric" for r, n in counts.items()) or "none"

    def _run(self, fn: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return self._device_run(fn)  # type: ignore[no-any-return]
        finally:
            self.compute_s += time.perf_counter() - started

    def partition_data(self, index: int) -> DeviceData:
        """This device's own samples (partition ``index``)."""
        dataset, partition = partition_of(self.setup)
        return DeviceData(device_view(dataset, partition, index), self.compute)

    def front_forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.gate.computing():
            return self._run(partial(self.side.front_forward, x))

    def tail_step(self, middle: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """The tail's loss on this device's labels, its backward and update: per-sample losses and g_mid."""
        with self.gate.computing():
            step = self._run(partial(self.side.tail_step, middle, y))
        return host_array(step.losses), step.g_mid

    def front_backward(self, gradient: torch.Tensor) -> None:
        with self.gate.computing():
            self._run(partial(self.side.front_backward, gradient))

    def local_step(self, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
        """One step of whole-model local training (FedAvg): the same parts, nothing between them."""
        def step() -> TailStep:
            done = self.side.tail_step(self.side.front_forward(x), y)
            self.side.front_backward(done.g_mid)
            return done

        with self.gate.computing():
            return host_array(self._run(step).losses)

    def prune(self, active: np.ndarray, losses: np.ndarray, index: int, round_index: int,
              epoch: int) -> tuple[np.ndarray, int]:
        """Sample pruning after local epoch ``epoch`` (1-based, spec 5.4) of ``losses`` (by sample id): the ids
        that stay, and how many left."""
        t = self.setup.training
        spec = PruningSpec(percentile=t.prune_percentile, prune_ratio=t.prune_ratio, seed=self.setup.partition.seed)
        step = prune_step(active, losses[active], spec, device=index, round_index=round_index, epoch=epoch)
        return step.active, len(active) - len(step.active)

    @property
    def peak_bytes(self) -> int:
        """The measured peak of training memory so far (bytes)."""
        return self.side.memory().peak_bytes


class MecPart:
    """The MEC's replica of the middle of the model (or the vanilla split's server part) for one device."""

    def __init__(self, setup: RoundSetup, cut: int, *, compute: torch.device) -> None:
        self.setup = setup
        point = point_of(setup, cut)
        roles = mec_roles(setup)
        self.parts = build_parts(setup.model, point, roles, compute=compute)
        if setup.training.mode == "vanilla":
            self.server: ServerSide | None = ServerSide(self.parts["server"], optimizer=optimizer_of(setup))
            self.side: MecSide | None = None
        else:
            self.side, self.server = MecSide(self.parts["middle"], optimizer=optimizer_of(setup)), None
        self.losses: list[float] = []

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for part in self.parts.values():
            part.load_state(state)

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        assert self.side is not None
        return self.side.forward(activation)

    def backward(self, gradient: torch.Tensor) -> torch.Tensor:
        assert self.side is not None
        return self.side.backward(gradient)

    def vanilla_step(self, activation: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The vanilla split's server step with the device's labels; the cut gradient."""
        assert self.server is not None
        step = self.server.step(activation, labels)
        self.losses.append(step.loss)
        return step.g_j

    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.parts.values():
            out.update(part.state_dict())
        return out


class Reassembly:
    """What the MEC knows of the whole model in a round: the global weights' layout, each device's part of them,
    the reassembled local models, and the label-distribution estimate (Algorithm 1)."""

    def __init__(self, setup: RoundSetup, *, compute: torch.device) -> None:
        """Made with the worker's compute gate held alone (it traces the model)."""
        self.setup, self.compute = setup, compute
        self.layout = global_layout(setup.model)
        self._grads: torch.Tensor | None = None
        self._lock = threading.Lock()

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The round's global state from SplitGlobal's vector. Raises WeightsError."""
        return unflatten(flat, self.layout, device=self.compute)

    def prepare(self, cuts: list[int]) -> None:
        """Trace the device parts of ``cuts`` now (with the gate held alone), so the devices' threads later read
        their layouts without tracing."""
        for cut in cuts:
            part_layout(self.setup, cut, device_roles(self.setup))

    def device_flat(self, state: dict[str, torch.Tensor], cut: int) -> torch.Tensor:
        """The device's part of ``state`` at ``cut``, as SplitPartWeights carries it."""
        return flatten(state, part_layout(self.setup, cut, device_roles(self.setup)))

    def full_state(self, cut: int, device_flat: torch.Tensor, mec_state: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
        """A device's local model: its trained part (SplitDone's vector) and the MEC's replica. Raises
        WeightsError for a vector that does not fit the part or holds NaN or infinite values."""
        own = unflatten(device_flat, part_layout(self.setup, cut, device_roles(self.setup)), device=self.compute)
        full = {**own, **{k: v.to(self.compute) for k, v in mec_state.items()}}
        missing = [k for k in self.layout.names if k not in full]
        if missing:
            raise ConfigError(f"the reassembled model lacks {missing[0]!r}: the parts do not cover the model")
        return {k: full[k] for k in self.layout.names}

    def warm(self) -> None:
        """The label-distribution estimate's class gradients once, on the model's initial weights, discarded: the
        data set's first read and the model's first backward on this node, which a round's first estimate would
        pay otherwise (nothing for data sets with per-token labels: the estimator does not apply)."""
        dataset, _ = partition_of(self.setup)
        if dataset.label_shape != ():
            return
        model = build_model(self.setup.model).to(self.compute)
        class_gradients(model, output_weight(self.layout), auxiliary_set(dataset), compute=self.compute)

    def label_distribution(self, global_state: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                           index: int, mode: str) -> list[float]:
        """The device's estimated label distribution: from its output layer's update (``grad_nnls``) or its
        partition's true histogram (``oracle``, for simulations and upper bounds)."""
        if mode == "oracle":
            _, partition = partition_of(self.setup)
            return list(oracle_distribution(partition.histogram(index)).probabilities)
        name = output_weight(self.layout)
        with self._lock:
            if self._grads is None:
                dataset, _ = partition_of(self.setup)
                model = build_model(self.setup.model).to(self.compute)
                model.load_state_dict(global_state)
                self._grads = class_gradients(model, name, auxiliary_set(dataset), compute=self.compute)
        return list(obtain_dis(local[name], global_state[name], self._grads).probabilities)


def output_weight(layout: Layout) -> str:
    """The output layer's weight: the last two-dimensional floating entry of the model."""
    entries = zip(layout.names, layout.shapes, layout.dtypes, strict=True)
    for name, shape, dtype in reversed(list(entries)):
        if len(shape) == 2 and dtype.is_floating_point:
            return name
    raise ConfigError("the model has no two-dimensional output weight to estimate its label distribution from")

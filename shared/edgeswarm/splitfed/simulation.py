"""An in-process simulation of SmartSplit, FedAvg and SplitFed at the paper's scale (spec 10): many devices under a
few MECs, K trainers a round, no MQTT. It drives the same code a real cluster runs, in the same order as the
coordinator and MECs: the central manager's ``plan_round``, the MECs' Algorithm 2 (``scheduling.fine_select``
with per-MEC quotas, epsilon exploration), the Distribution Estimator (``estimator.class_gradients`` and
``obtain_dis`` on each trained device's output layer: Dis is never read from labels), Stat from the per-sample
losses (``statistics.stat_from_sums``), sample pruning (``pruning.RoundPruner``) and FedAvg (``aggregation.FedAvg``).

Local training runs the whole model in one process: the U-split and the vanilla split compute exactly the
centralised gradients (tests/test_splitfed_split.py), so where the model is cut changes memory and time, not
the trained weights. The methods therefore differ in who trains (selection, budgets) and, for SmartSplit, in
pruning, as on a real cluster.

Budgets: each round a device's budget is RAM x U[0.1, 0.4] (spec 10.1) times a scale that maps the fleet's median
budget to LeNet-5's whole-model training memory (the planner's memory model at the batch size): phones' real
RAM holds a LeNet-5 many times over, and FedAvg would then lose nobody.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.aggregation import FedAvg
from edgeswarm.data import open_dataset
from edgeswarm.data.partition import device_view, partition_dataset
from edgeswarm.evaluation import held_out
from edgeswarm.models.zoo import build_model
from edgeswarm.planning.splitfed.cost import cut_costs, effective_tail
from edgeswarm.planning.splitfed.plan import plan_round
from edgeswarm.planning.splitfed.scheduling import fine_select
from edgeswarm.planning.splitfed.statistics import dis as skew_of
from edgeswarm.planning.splitfed.statistics import stat_from_sums
from edgeswarm.planning.splitfed.synthetic import budget_fraction, paper_devices
from edgeswarm.planning.splitfed.types import SplitDevice, SplitOptions, SplitPlanError, SplitSelection
from edgeswarm.splitfed.compute import local_batches, output_weight
from edgeswarm.splitfed.estimator import auxiliary_set, class_gradients, obtain_dis
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.splitfed.pruning import PruningSpec, RoundPruner
from edgeswarm.splitfed.weights import layout_of
from edgeswarm.values.federated import PartitionSpec
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import DatasetSpec

Method = Literal["smartsplit", "fedavg", "splitfed"]
SETTINGS = {
    "dirichlet-0.1": {"kind": "dirichlet", "alpha": 0.1},
    "dirichlet-1.0": {"kind": "dirichlet", "alpha": 1.0},
    "label-skew-2": {"kind": "label-skew", "classes_per_device": 2},
    "iid": {"kind": "iid"},
}
SPLITFED_CUT = 3  # after LeNet-5's first pooling, the cluster's default
BUDGET_NOTE = ("budgets: RAM x U[0.1, 0.4] each round, scaled so the fleet's median budget equals LeNet-5's "
               "whole-model training memory by the planner's memory model (batch 32, momentum SGD)")


class SimulationConfig(BaseModel):
    """One simulated run: ``method`` on the ``digits`` data split by ``setting`` (a SETTINGS key) over ``devices``
    devices under ``mecs`` MECs, K ``participants`` a round for ``rounds`` rounds, LeNet-5 trained with SGD
    (``lr``, ``momentum``) for ``local_epochs`` local epochs of ``batch_size``; SmartSplit's gamma and epsilon;
    ``budget_scale`` multiplies the scaled budgets (1: the median fits the whole model exactly). Seeded by
    ``seed``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method
    setting: str = "dirichlet-0.1"
    seed: int = Field(default=0, ge=0)
    rounds: int = Field(default=20, ge=1, le=1000)
    devices: int = Field(default=100, ge=2, le=1000)
    mecs: int = Field(default=5, ge=1, le=100)
    participants: int = Field(default=10, ge=1, le=1000)
    local_epochs: int = Field(default=1, ge=1, le=20)
    batch_size: int = Field(default=32, ge=1, le=1024)
    lr: float = Field(default=0.05, gt=0.0, le=10.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    gamma: float = Field(default=2.0, ge=1.0, le=10.0)
    epsilon: float = Field(default=0.1, ge=0.0, le=1.0)
    budget_scale: float = Field(default=1.0, gt=0.0)


class SimulationResult(BaseModel):
    """Held-out accuracy after each round, trainers per round, and the devices that never could train (no cut
    of the method fit their budget in any round)."""

    accuracies: list[float]
    participants: list[int]
    excluded_devices: int


def _options(config: SimulationConfig, r: int, previous: tuple[int, int] | None) -> SplitOptions:
    """The round's planner options as the coordinator builds them for the job's mode."""
    base = SplitOptions(participants=config.participants, epochs=config.local_epochs, seed=config.seed * 1000 + r,
                        gamma=config.gamma if config.method == "smartsplit" else 1.0, previous_best=previous)
    if config.method == "fedavg":
        return base.model_copy(update={"local_only": True})
    if config.method == "splitfed":
        return base.model_copy(update={"fixed_cut": SPLITFED_CUT, "tail": 0, "latency_model": "vanilla"})
    return base


def simulate(config: SimulationConfig) -> SimulationResult:
    """Run ``config`` (see the module's docstring) and return its accuracies. Raises ConfigError for an unknown
    setting."""
    from edgeswarm.errors import ConfigError

    if config.setting not in SETTINGS:
        raise ConfigError(f"unknown setting {config.setting!r}: one of {', '.join(SETTINGS)}")
    spec = ModelSpec(name="lenet5")
    dataset = open_dataset(DatasetSpec(kind="digits"), spec)
    partition = partition_dataset(dataset, config.devices,
                                  PartitionSpec(devices=config.devices, seed=config.seed, **SETTINGS[config.setting]))
    views = [device_view(dataset, partition, i) for i in range(config.devices)]
    sizes = partition.sizes()
    cost = model_cost(spec, config.batch_size, optimizer_states=1)
    whole = float(cut_costs(cost, SplitOptions()).memory[len(cost.units) - effective_tail(cost, SplitOptions()) - 1])
    rng = np.random.default_rng([config.seed, 0x51])
    fleet, mecs = paper_devices(rng, per_type=max(1, config.devices // 5), mecs=config.mecs)
    fleet = fleet[:config.devices]
    ram_of = _phone_ram(config.devices)
    scale = config.budget_scale * whole / float(np.median(ram_of) * 0.25)
    devices = [d.model_copy(update={"samples": int(sizes[i]), "dis": 0.0, "stat": 0.0}) for i, d in enumerate(fleet)]
    torch.manual_seed(config.seed)
    model = build_model(spec)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out_name = output_weight(layout_of(state))
    aux = auxiliary_set(dataset)
    pruning = PruningSpec(enabled=config.method == "smartsplit", seed=config.seed)
    pruners = {i: RoundPruner(np.arange(int(sizes[i])), pruning, device=i) for i in range(config.devices)}
    previous: tuple[int, int] | None = None
    accuracies: list[float] = []
    counts: list[int] = []
    ever: set[int] = set()
    for r in range(config.rounds):
        devices = [d.model_copy(update={"budget_bytes": int(ram_of[i] * budget_fraction(rng) * scale),
                                        "available": bool(sizes[i] > 0)}) for i, d in enumerate(devices)]
        options = _options(config, r, previous)
        try:
            selection = plan_round(cost, devices, mecs, options)
        except SplitPlanError:
            accuracies.append(accuracies[-1] if accuracies else 0.0)
            counts.append(0)
            continue
        previous = (selection.target_cut, selection.count)
        index = {d.node: i for i, d in enumerate(devices)}
        ever.update(index[n] for n in devices_fitting(selection, devices))
        chosen = selection.selected
        if config.method == "smartsplit":
            chosen = fine_select(chosen, devices, config.participants, config.epsilon,
                                 np.random.default_rng([config.seed, r, 0x5e]))
        model.load_state_dict(state)
        grads = class_gradients(model, out_name, aux) if config.method == "smartsplit" else None
        total = FedAvg(state)
        for c in chosen:
            i = index[c.node]
            local, sq, n = _train(model, state, views[i], pruners[i], r, config)
            total.add(local, float(sizes[i]), who=c.node)
            update: dict[str, object] = {"stat": stat_from_sums(n, sq)}
            if grads is not None:
                estimate = obtain_dis(local[out_name], state[out_name], grads)
                update["dis"] = skew_of(list(estimate.probabilities))
            devices[i] = devices[i].model_copy(update=update)
        counts.append(len(chosen))
        if total.count:
            state = {k: v.to(state[k].dtype) for k, v in total.result().items()}
        model.load_state_dict(state)
        accuracy, _ = held_out(model, dataset, batch_size=256)
        accuracies.append(float(accuracy))
    return SimulationResult(accuracies=accuracies, participants=counts,
                            excluded_devices=config.devices - len(ever))


def devices_fitting(selection: SplitSelection, devices: list[SplitDevice]) -> list[str]:
    """The devices some allowed cut fit this round (those the planner did not list as infeasible)."""
    left = set(selection.infeasible)
    return [d.node for d in devices if d.available and d.node not in left]


def _phone_ram(devices: int) -> np.ndarray:
    """Each slot's phone RAM (bytes), in paper_devices' order (per_type of each Table I phone)."""
    from edgeswarm.planning.splitfed.synthetic import PHONES

    per_type = max(1, devices // len(PHONES))
    return np.array([p.ram_bytes for p in PHONES for _ in range(per_type)][:devices], dtype=np.float64)


def _train(model: torch.nn.Module, state: dict[str, torch.Tensor], view: object, pruner: RoundPruner, r: int,
           config: SimulationConfig) -> tuple[dict[str, torch.Tensor], float, int]:
    """One device's local round from the global ``state``: ``local_epochs`` epochs of momentum SGD over its
    active samples (pruned after each epoch when the pruner is enabled). Returns its weights, the sum of its
    first epoch's squared per-sample losses and how many samples that epoch saw (Stat's inputs)."""
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    pruner.new_round(r)
    rng = np.random.default_rng([config.seed, r, 0x7a])
    squared, seen = 0.0, 0
    for epoch in range(config.local_epochs):
        ids, losses = [], []
        for batch in local_batches(pruner.active, config.batch_size, rng):
            x, y = view.batch(batch)  # type: ignore[attr-defined]
            per_sample = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            opt.zero_grad()
            per_sample.mean().backward()
            opt.step()
            ids.append(batch)
            losses.append(per_sample.detach().double().numpy())
        if not ids:
            break
        all_ids, all_losses = np.concatenate(ids), np.concatenate(losses)
        if epoch == 0:
            squared, seen = float((all_losses ** 2).sum()), int(all_losses.size)
        pruner.end_epoch(all_ids, all_losses)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, squared, seen

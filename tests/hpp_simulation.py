"""One HPP round in one process, for the tests: every device of every stage a separate replica, the messages
direct calls.

This is the semantic reference the distributed runtime is checked against, and a way to run a plan's exact
arithmetic without MQTT: each device follows its strict 1F1B order with K_p warm-up forwards, activations
and gradients move by the routing of spec 6.1, each data-parallel group sums its gradients, and every
replica steps its own optimizer. The per-device part is the executor the stage-workers run
(``edgeswarm.hpp.executor``); only the transport here is direct.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from edgeswarm.data import open_dataset
from edgeswarm.data.base import Dataset, round_sample_ids
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.hpp.compute import StageCompute, loss_terms
from edgeswarm.hpp.evaluation import accuracy
from edgeswarm.hpp.executor import DeviceIO, GroupSum, Position, Recv, Request, device_round
from edgeswarm.hpp.routing import stage_sample_ids
from edgeswarm.hpp.spec import JobSpec, make_optimizer
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model
from edgeswarm.planning.hpp.schedule import warmup_counts
from edgeswarm.planning.hpp.types import Plan


@dataclass(frozen=True)
class StageLayout:
    """Units [start, end) held by devices with these samples per micro-batch (shares)."""

    start: int
    end: int
    shares: tuple[int, ...]


@dataclass
class RoundResult:
    """The mean loss over the mini-batch, the accuracy of its predictions and each device's peak live
    micro-batches ([stage][device])."""

    loss: float
    accuracy: float
    peak_live: list[list[int]] = field(default_factory=list)


def build_replicas(model: nn.Module, layout: list[StageLayout], loss_scale: float) -> list[list[StageCompute]]:
    """A StageCompute per device, each on its own deep copy of ``model`` (so replicas start identical)."""
    replicas = []
    for p, stage in enumerate(layout):
        group = []
        for _ in stage.shares:
            seq = layer_sequence(copy.deepcopy(model))
            group.append(StageCompute(seq.build_stage(stage.start, stage.end), first=p == 0,
                                      last=p == len(layout) - 1, loss_scale=loss_scale))
        replicas.append(group)
    return replicas


def run_round(replicas: list[list[StageCompute]], layout: list[StageLayout], inputs: torch.Tensor,
              labels: torch.Tensor, micro_batches: int,
              step: Callable[[StageCompute], None] | None = None) -> RoundResult:
    """Train one round on the mini-batch (``inputs``/``labels``: M*B samples in micro-batch order).

    Every device runs the shared executor (``hpp.executor.device_round``); its sends land in a mailbox here
    and a device resumes when what it waits for is there. ``step`` is called on every replica after its group's
    gradient sum (e.g. an optimizer step). Raises EdgeswarmError if the schedules deadlock (which the warm-up
    counts rule out).
    """
    n_stages = len(layout)
    b = sum(layout[0].shares)
    if inputs.shape[0] != micro_batches * b:
        raise EdgeswarmError(f"{inputs.shape[0]} samples for {micro_batches} micro-batches of {b}")
    ks = warmup_counts(n_stages, micro_batches)
    shares = [list(s.shares) for s in layout]
    held = [stage_sample_ids(shares, np.arange(i * b, (i + 1) * b)) for i in range(micro_batches)]
    # Rows in flight: (to stage, to rank, kind, micro-batch, from rank) -> rows.
    mail: dict[tuple[int, int, str, int, int], torch.Tensor] = {}
    devices = [(p, d) for p in range(n_stages) for d in range(len(layout[p].shares))]
    rounds = {(p, d): device_round(replicas[p][d], Position(p, d, shares, micro_batches, ks[p]),
                                   _device_io(replicas[p][d], p, d, n_stages, held, inputs, labels, mail, step))
              for p, d in devices}
    waiting: dict[tuple[int, int], Request | None] = {}

    def resume(device: tuple[int, int], value: torch.Tensor | None) -> Request | None:
        try:
            waiting[device] = rounds[device].send(value)  # type: ignore[arg-type]
        except StopIteration:
            waiting[device] = None
        return waiting[device]

    for device in devices:
        resume(device, None)
    while any(request is not None for request in waiting.values()):
        progressed = False
        for p, d in devices:
            request = waiting[(p, d)]
            while isinstance(request, Recv) and (key := (p, d, request.kind, request.micro_batch,
                                                         request.peer)) in mail:
                request = resume((p, d), mail.pop(key))
                progressed = True
        for p in range(n_stages):
            group = [(p, d) for d in range(len(layout[p].shares))]
            requests = [waiting[device] for device in group]
            if all(isinstance(request, GroupSum) for request in requests):
                summed = torch.stack([request.flat for request in requests]).sum(dim=0)  # type: ignore[union-attr]
                for device in group:
                    resume(device, summed)
                progressed = True
        if not progressed:
            stuck = {device: request for device, request in waiting.items() if request is not None}
            raise EdgeswarmError(f"the schedules deadlocked: {stuck}")

    last = replicas[-1]
    loss = sum(r.loss_sum for r in last) / max(1, sum(r.terms for r in last))
    accuracy = sum(r.correct for r in last) / max(1, sum(r.terms for r in last))
    peak = [[r.peak_live for r in group] for group in replicas]
    for group in replicas:
        for r in group:
            r.end_round()
    return RoundResult(loss=loss, accuracy=accuracy, peak_live=peak)


def _device_io(stage: StageCompute, p: int, d: int, n_stages: int, held: list[list[list[np.ndarray]]],
               inputs: torch.Tensor, labels: torch.Tensor, mail: dict[tuple[int, int, str, int, int], torch.Tensor],
               step: Callable[[StageCompute], None] | None) -> DeviceIO:
    """Device ``d`` of stage ``p``'s view of the round: its samples by id, sends straight into ``mail``."""

    def batch(mb: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ids = held[mb][p][d]
        return (inputs[ids] if p == 0 else None, labels[ids] if p == n_stages - 1 else None)

    def send(kind: str, to_stage: int, to_rank: int, mb: int, rows: torch.Tensor) -> None:
        mail[(to_stage, to_rank, kind, mb, d)] = rows

    def step_this() -> None:
        if step is not None:
            step(stage)

    return DeviceIO(batch=batch, send=send, step=step_this)


def layout_of(plan: Plan) -> list[StageLayout]:
    """The stage layouts a plan prescribes (units and per-device shares, devices in the plan's order)."""
    return [StageLayout(s.start, s.end, tuple(s.shares)) for s in plan.stages]


@dataclass
class TrainingRun:
    """Every round's result and the accuracy of the trained model on the held-out split."""

    rounds: list[RoundResult]
    test_accuracy: float


def evaluate(replicas: list[list[StageCompute]], dataset: Dataset, batch_size: int = 256) -> float:
    """Held-out accuracy (evaluation mode) of the model the first replica of every stage forms, chained; the
    replicas are left in training mode."""
    chained = torch.nn.Sequential(*(group[0].module for group in replicas))
    try:
        return accuracy(chained, dataset, batch_size)
    finally:
        chained.train()


def train_in_process(job: JobSpec, plan: Plan, rounds: int | None = None) -> TrainingRun:
    """Train ``job`` on ``plan`` in this process for ``rounds`` (default: the job's), every device a replica
    with its own optimizer, then evaluate on the held-out split. Raises ConfigError when the plan was made for
    another global batch than the job's."""
    dataset = open_dataset(job.data, job.model)
    if plan.options.global_batch != job.global_batch:
        raise ConfigError(f"the plan is for a global batch of {plan.options.global_batch}, the job has "
                          f"{job.global_batch}")
    layout = layout_of(plan)
    m = plan.options.micro_batches
    replicas = build_replicas(build_model(job.model), layout, loss_scale=0.0)
    # A stage of weightless units (an activation, a flatten) has nothing to optimise.
    optimizers = {id(r): make_optimizer(job.optimizer, params) for group in replicas for r in group
                  if (params := list(r.parameters()))}

    def step(stage: StageCompute) -> None:
        optimizer = optimizers.get(id(stage))
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    results = []
    for index in range(rounds if rounds is not None else job.total_rounds(dataset.train_size)):
        ids = round_sample_ids(index, job.global_batch, dataset.train_size, job.seed)
        inputs, labels = dataset.batch(ids)
        scale = 1.0 / loss_terms(labels)
        for group in replicas:
            for r in group:
                r.loss_scale = scale
        results.append(run_round(replicas, layout, inputs, labels, m, step=step))
    return TrainingRun(results, evaluate(replicas, dataset))

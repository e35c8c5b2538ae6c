"""One HPP round in one process: every device of every stage a separate replica, the messages direct calls.

This is the semantic reference the distributed runtime is checked against, and a way to run a plan's exact
arithmetic without MQTT: each device follows its strict 1F1B order with K_p warm-up forwards, activations
and gradients move by the routing of spec 6.1, each data-parallel group sums its gradients, and every
replica steps its own optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model
from edgeswarm.planning.schedule import stage_order, warmup_counts
from edgeswarm.planning.types import Plan
from edgeswarm.training.data import Dataset, open_dataset, round_sample_ids
from edgeswarm.training.evaluation import accuracy
from edgeswarm.training.jobs import JobSpec, make_optimizer
from edgeswarm.training.routing import Piece, pieces, routing_matrix, stage_sample_ids
from edgeswarm.training.stage import StageCompute, loss_terms


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

    ``step`` is called on every replica after its group's gradient sum (e.g. an optimizer step). Raises
    EdgeswarmError if the schedules deadlock (which the warm-up counts rule out).
    """
    n_stages = len(layout)
    b = sum(layout[0].shares)
    if inputs.shape[0] != micro_batches * b:
        raise EdgeswarmError(f"{inputs.shape[0]} samples for {micro_batches} micro-batches of {b}")
    ks = warmup_counts(n_stages, micro_batches)
    orders = [[stage_order(ks[p], micro_batches) for _ in stage.shares] for p, stage in enumerate(layout)]
    position = [[0] * len(stage.shares) for stage in layout]
    links: list[list[Piece]] = [pieces(routing_matrix(layout[p].shares, layout[p + 1].shares))
                                for p in range(n_stages - 1)]
    shares = [list(s.shares) for s in layout]
    held = [stage_sample_ids(shares, np.arange(i * b, (i + 1) * b)) for i in range(micro_batches)]
    # Messages in flight: forward pieces to (stage, device, micro-batch), and gradient pieces back.
    fwd_in: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
    bwd_in: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}

    def expected(p: int, d: int, backward: bool) -> list[Piece]:
        if backward:
            return [pc for pc in links[p] if pc.sender == d]
        return [pc for pc in links[p - 1] if pc.receiver == d]

    def ready(p: int, d: int, kind: str, mb: int) -> bool:
        if kind == "F":
            if p == 0:
                return True
            got = fwd_in.get((p, d, mb), {})
            return all(pc.sender in got for pc in expected(p, d, False))
        if p == n_stages - 1:
            return True
        got = bwd_in.get((p, d, mb), {})
        return all(pc.receiver in got for pc in expected(p, d, True))

    total = sum(len(o) for group in orders for o in group)
    done = 0
    while done < total:
        progressed = False
        for p in range(n_stages):
            for d in range(len(layout[p].shares)):
                if position[p][d] == len(orders[p][d]) or not ready(p, d, *orders[p][d][position[p][d]]):
                    continue
                kind, mb = orders[p][d][position[p][d]]
                _run(replicas[p][d], p, d, kind, mb, links, held, inputs, labels, fwd_in, bwd_in)
                position[p][d] += 1
                done += 1
                progressed = True
        if not progressed:
            raise EdgeswarmError(f"the schedules deadlocked after {done} of {total} operations")

    last = replicas[-1]
    loss = sum(r.loss_sum for r in last) / max(1, sum(r.terms for r in last))
    accuracy = sum(r.correct for r in last) / max(1, sum(r.terms for r in last))
    peak = [[r.peak_live for r in group] for group in replicas]
    for group in replicas:
        summed = torch.stack([r.flat_gradients() for r in group]).sum(dim=0)
        for r in group:
            r.set_flat_gradients(summed)
            if step is not None:
                step(r)
            r.end_round()
    return RoundResult(loss=loss, accuracy=accuracy, peak_live=peak)


def _run(stage: StageCompute, p: int, d: int, kind: str, mb: int, links: list[list[Piece]],
         held: list[list[list[np.ndarray]]], inputs: torch.Tensor, labels: torch.Tensor,
         fwd_in: dict[tuple[int, int, int], dict[int, torch.Tensor]],
         bwd_in: dict[tuple[int, int, int], dict[int, torch.Tensor]]) -> None:
    n_stages = len(links) + 1
    ids = held[mb][p][d]
    if len(ids) == 0:
        return  # Alg. 1 may give a device no samples: it keeps its weights and adds a zero gradient
    if kind == "F":
        if p == 0:
            x = inputs[ids]
        else:
            got = fwd_in.pop((p, d, mb))
            x = torch.cat([got[s] for s in sorted(got)])
        y = labels[ids] if p == n_stages - 1 else None
        out = stage.forward(mb, x, y)
        if p < n_stages - 1:
            for pc in links[p]:
                if pc.sender == d:
                    rows = out[pc.sender_start:pc.sender_start + pc.rows]
                    fwd_in.setdefault((p + 1, pc.receiver, mb), {})[d] = rows
        return
    grad = None
    if p < n_stages - 1:
        got = bwd_in.pop((p, d, mb))
        grad = torch.cat([got[r] for r in sorted(got)])
    grad_in = stage.backward(mb, grad)
    if p > 0 and grad_in is not None:
        for pc in links[p - 1]:
            if pc.receiver == d:
                rows = grad_in[pc.receiver_start:pc.receiver_start + pc.rows]
                bwd_in.setdefault((p - 1, pc.sender, mb), {})[d] = rows


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

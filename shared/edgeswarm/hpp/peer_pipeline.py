"""One rank of the torch pipeline-training peer of ``bench peers`` (``python -m edgeswarm.hpp.peer_pipeline``): a
stage per device, in the device's namespace, joined over gloo, computing as the device's class. With ``--replicas
R`` the ranks are R pipelines of the same stages (rank = replica x stages + stage), each pipeline training its R-th
of the round's batch, every stage's replicas averaging their gradients with ``DistributedDataParallel`` (torch's
pipelining + DDP: the same replica count for every stage, as torch's 2-D layout needs).

Every rank builds the zoo model from its seed (``models.zoo.build_model``, as the stage-workers do) and keeps the
units of its stage (``models.sequence``: the same cut points and stage boundaries as our plan), runs them with
``torch.distributed.pipelining`` (a ``PipelineStage`` and GPipe's schedule over the round's micro-batches, mean
cross-entropy) and steps SGD: a warm-up round, then ``rounds`` timed rounds on the data set's rounds of samples
(``data.base.round_sample_ids``). Rank 0 times them from a barrier to a barrier and writes a ``PipelineResult``
with the cross-check: after the first round's backward, each stage's gradients against the same model's on one
device over the same micro-batches (the largest difference over all stages, and the largest gradient). An emulated
device stretches its stage's forward and its backward by its class's slow-down (``DeviceProfile.run``'s rule: the
calling thread's CPU time times the slow-down), not the sends and receives between stages.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    import torch
    from torch import nn

    from edgeswarm.devices.emulation import DeviceProfile


class PipelineResult(BaseModel):
    """What rank 0 measured: samples a second over the timed rounds, the rounds' seconds, and the cross-check."""

    world: int
    samples_per_s: float | None = None
    round_s: list[float] = []
    max_difference: float | None = None
    scale: float | None = None
    error: str = ""


def main(argv: list[str] | None = None) -> int:
    from edgeswarm.workloads.peers import finish_rank, rank_parser

    p = rank_parser("python -m edgeswarm.hpp.peer_pipeline", __doc__)
    p.add_argument("--model", required=True, help="the zoo model's spec (JSON)")
    p.add_argument("--data", required=True, help="the data set's spec (JSON)")
    p.add_argument("--bounds", required=True, help="each stage's first unit, then the last stage's end: 0,5,12,20")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batches", type=int, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, default=1, help="pipelines of the same stages, DDP between replicas")
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args(argv)
    result = run_rank(args)
    return finish_rank(args, result, result.error)


def run_rank(args: argparse.Namespace) -> PipelineResult:
    """This rank's part of the run (see the module's docstring); rank 0's result."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from edgeswarm.data import open_dataset
    from edgeswarm.data.base import round_sample_ids
    from edgeswarm.models.sequence import layer_sequence
    from edgeswarm.models.zoo import build_model, example_stage_input
    from edgeswarm.values.profiles import ModelSpec
    from edgeswarm.values.specs import DatasetSpec
    from edgeswarm.workloads.peers import rank_device

    device, compute = rank_device(args.device_class)
    spec = ModelSpec.model_validate_json(args.model)
    data = DatasetSpec.model_validate_json(args.data)
    bounds = [int(b) for b in args.bounds.split(",")]
    stages, replicas = len(bounds) - 1, args.replicas
    if stages < 2 or replicas < 1 or stages * replicas != args.world:
        return PipelineResult(world=args.world, error=f"{stages} stages x {replicas} replicas for {args.world} ranks: "
                                                      "a pipeline has two stages or more, a rank each")
    if args.global_batch % (replicas * args.micro_batches):
        return PipelineResult(world=args.world, error=f"a batch of {args.global_batch} does not split into "
                                                      f"{replicas} x {args.micro_batches} equal micro-batches")
    index, replica = args.rank % stages, args.rank // stages
    start, end = bounds[index], bounds[index + 1]
    model = build_model(spec)
    sequence = layer_sequence(model)
    share = args.global_batch // replicas  # this pipeline's part of the round's batch
    # One micro-batch as it enters the stage, for the stage's shapes (BatchNorm's statistics untouched), made before
    # the model moves: the example is a host tensor.
    sample = example_stage_input(spec, sequence, start, share // args.micro_batches).to(compute)
    stage_module = sequence.build_stage(start, end).to(compute)  # in place: the stage shares the model's modules
    whole = copy.deepcopy(model.to(compute))  # the single-device reference
    first, last = index == 0, index == stages - 1
    dataset = open_dataset(data, spec)

    def batch(round_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = dataset.batch(round_sample_ids(round_index, args.global_batch, dataset.train_size, data.seed))
        return x.to(compute), y.to(compute)

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    try:
        # Every rank makes every group, in the same order (torch's rule); each keeps its pipeline's and its stage's.
        pipes = [dist.new_group(list(range(k * stages, (k + 1) * stages))) for k in range(replicas)]
        peers = [dist.new_group([s + k * stages for k in range(replicas)]) for s in range(stages)]
        module = emulated(stage_module, device)
        if replicas > 1:
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(module, process_group=peers[index])
            # DDP learns its gradients' order from the first backward of its first iteration; GPipe's first
            # iteration runs a backward a micro-batch, and DDP then counts every parameter once each and asserts
            # (torch 2.13's reducer). One synced backward of the example first, its gradients dropped, settles it.
            module(sample.detach().requires_grad_(not first)).sum().backward()
            stage_module.zero_grad(set_to_none=True)
        stage = PipelineStage(module, index, stages, compute, input_args=(sample,), group=pipes[replica])
        schedule = ScheduleGPipe(stage, args.micro_batches, loss_fn=_loss, scale_grads=True)
        params = [p for p in stage_module.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=args.lr) if params else None
        times, difference, scale = [], 0.0, 0.0
        for r in range(args.rounds + 1):  # round 0: the warm-up, and the cross-check's
            whole_x, whole_y = batch(r)
            x, y = (t[replica * share:(replica + 1) * share] for t in (whole_x, whole_y))
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            began = time.perf_counter()
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y)
            else:
                schedule.step()
            if r == 0:  # untimed: the weights are still the seed's, as the reference's
                # DDP's mean over the replicas of GPipe's mean over micro-batches: the mean over all of them
                difference, scale = _against_one_device(whole, stage_module, whole_x, whole_y,
                                                        args.micro_batches * replicas)
            if optimizer is not None:
                optimizer.step()
            dist.barrier()
            if r:
                times.append(time.perf_counter() - began)
        found = torch.tensor([difference, scale], device=compute)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    finally:
        dist.destroy_process_group()
    return PipelineResult(world=args.world, samples_per_s=args.global_batch * len(times) / sum(times),
                          round_s=times, max_difference=float(found[0]), scale=float(found[1]))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.nn.functional.cross_entropy(output, target)


def _against_one_device(whole: nn.Module, stage: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int
                        ) -> tuple[float, float]:
    """The largest difference between ``stage``'s gradients and ``whole``'s for the same parameters after the mean
    cross-entropy of each of ``micro_batches`` micro-batches of (``x``, ``y``), averaged as GPipe's schedule does;
    and the largest of those gradients."""
    whole.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        (_loss(whole(xs), ys) / micro_batches).backward()
    mine = dict(stage.named_parameters())
    difference = scale = 0.0
    for name, p in whole.named_parameters():
        if name in mine and p.grad is not None and mine[name].grad is not None:
            difference = max(difference, float((p.grad - mine[name].grad).abs().max()))
            scale = max(scale, float(p.grad.abs().max()))
    return difference, scale


class _Clock:
    """Where one micro-batch's backward through a stage began: wall and thread CPU seconds."""

    wall = 0.0
    cpu = 0.0


def _functions() -> tuple[Any, Any]:
    """The two autograd functions that bracket a stage's backward (made when torch is imported)."""
    import torch

    class Leave(torch.autograd.Function):
        """At the stage's output: its backward starts the clock."""

        @staticmethod
        def forward(ctx: Any, y: torch.Tensor, clock: _Clock) -> torch.Tensor:
            ctx.clock = clock
            return y.view_as(y)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            ctx.clock.wall, ctx.clock.cpu = time.perf_counter(), time.thread_time()
            return grad, None

    class Enter(torch.autograd.Function):
        """At the stage's input: its backward, the stage's last, sleeps out the slow-down."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, clock: _Clock, device: DeviceProfile) -> torch.Tensor:
            ctx.clock, ctx.device = clock, device
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            c, slowdown = ctx.clock, ctx.device.compute_slowdown
            left = (time.thread_time() - c.cpu) * slowdown - (time.perf_counter() - c.wall)
            if slowdown > 1.0 and left > 0:
                time.sleep(left)
            return grad, None, None

    return Leave, Enter


def emulated(stage: nn.Module, device: DeviceProfile) -> nn.Module:
    """``stage`` computing as ``device``: its forward through ``DeviceProfile.run``, its backward stretched the
    same way between the two bracketing functions (the backward of a CPU graph runs on the calling thread)."""
    from torch import nn

    leave, enter = _functions()

    class _Emulated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock = _Clock()
            if not x.requires_grad:  # the first stage's input: bracketed all the same
                x = x.detach().requires_grad_(True)
            x = enter.apply(x, clock, device)
            y = device.run(lambda: self.stage(x))
            return leave.apply(y, clock)

    return _Emulated()


if __name__ == "__main__":
    from edgeswarm.workloads.peers import exit_rank

    exit_rank(main())

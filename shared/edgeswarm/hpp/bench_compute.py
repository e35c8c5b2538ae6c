"""One pipeline stage's training step on an accelerator against the CPU, measured in the same run.

A stage (units [start, end) of a zoo model) runs what a stage-worker runs per micro-batch: a training forward, the
summed cross-entropy (the last stage) or a backward from a random output gradient, on each compute device in
turn, from the same seeded weights and inputs. Each figure is the median of ``repeats`` timed steps after
``warmup`` untimed ones, synchronised with the device. Run it as ``edgeswarm bench compute`` on a machine
with CUDA (``--json`` for one JSON object); tests/test_gpu.py prints the same figures.
"""

from __future__ import annotations

import statistics
import time

import torch
from pydantic import BaseModel

from edgeswarm.devices.compute import describe, synchronize
from edgeswarm.errors import ConfigError
from edgeswarm.hpp.compute import classification_loss
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model, example_stage_input, example_target, unit_count
from edgeswarm.values.profiles import ModelSpec


class StageTiming(BaseModel):
    """Median seconds of one forward + backward of the stage on ``compute`` at ``batch`` samples."""

    compute: str
    step_s: float
    samples_per_s: float


class StageSpeed(BaseModel):
    """The stage on each compute device; ``speedup`` is the CPU's step time over the accelerator's."""

    model: str
    start: int
    end: int
    batch: int
    timings: list[StageTiming]
    speedup: float | None


def time_stage(spec: ModelSpec, start: int, end: int | None, batch: int, compute: torch.device, *,
               repeats: int = 10, warmup: int = 3) -> StageTiming:
    """Time units [start, end) of ``spec`` (end None: to the last unit) on ``compute``: median seconds of a
    training forward and backward of ``batch`` samples, after ``warmup`` untimed steps. Raises ConfigError for a
    stage outside the model."""
    sequence = layer_sequence(build_model(spec))
    stop = len(sequence) if end is None else end
    if not 0 <= start < stop <= len(sequence):
        raise ConfigError(f"{spec.name} has units 0 to {len(sequence) - 1}: a stage [{start}, {stop}) "
                          "is not among them")
    last = stop == len(sequence)
    module = sequence.build_stage(start, stop).train().to(compute)
    x = example_stage_input(spec, sequence, start, batch).to(compute)
    x = x.requires_grad_(True) if start > 0 and x.is_floating_point() else x
    labels = example_target(spec, batch).to(compute)
    grad = None
    if not last:
        with torch.no_grad():
            shape = module(x).shape
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(compute)

    def step() -> None:
        out = module(x)
        if last:
            classification_loss(out, labels).backward()
        else:
            out.backward(grad)
        for p in module.parameters():
            p.grad = None

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        synchronize(compute)
        t0 = time.perf_counter()
        step()
        synchronize(compute)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return StageTiming(compute=describe(compute), step_s=median, samples_per_s=batch / median)


def stage_speed(spec: ModelSpec, start: int, end: int | None, batch: int, accelerator: torch.device | None, *,
                repeats: int = 10, warmup: int = 3) -> StageSpeed:
    """The stage timed on the CPU and, when given, on ``accelerator``, in this run."""
    stop = unit_count(spec) if end is None else end
    # The CPU by name: it is the baseline this benchmark compares the accelerator with, not where work should run.
    timings = [time_stage(spec, start, stop, batch, torch.device("cpu"), repeats=repeats, warmup=warmup)]
    if accelerator is not None:
        timings.append(time_stage(spec, start, stop, batch, accelerator, repeats=repeats, warmup=warmup))
    speedup = timings[0].step_s / timings[1].step_s if len(timings) > 1 else None
    return StageSpeed(model=spec.name, start=start, end=stop, batch=batch, timings=timings, speedup=speedup)


def summary(speed: StageSpeed) -> str:
    """One line per device and the ratio, for a terminal or a test's output."""
    lines = [f"{speed.model} units [{speed.start}, {speed.end}), batch {speed.batch}: forward + backward"]
    for t in speed.timings:
        lines.append(f"  {t.compute}: {t.step_s * 1e3:.2f} ms ({t.samples_per_s:,.0f} samples/s)")
    if speed.speedup is not None:
        lines.append(f"  accelerator / CPU speed-up: {speed.speedup:.1f}x")
    return "\n".join(lines)

"""A device's measured training memory at a cut: one U-split iteration on synthetic data, measured by the runtime.

This is what the I1 memory figure compares: the device side (front, tail, the activations sent and received) at
the chosen cut against whole-model training, which is the cut j = V-h (no middle: the device trains everything).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgeswarm.models.zoo import example_input, example_target
from edgeswarm.splitfed.split import (
    DeviceMemory,
    DeviceSide,
    MecSide,
    SplitPoint,
    build_parts,
    run_usplit_iteration,
)
from edgeswarm.values.profiles import ModelSpec


def measure_device_memory(spec: ModelSpec, point: SplitPoint, batch_size: int, *,
                          plan: Sequence[str] | None = None, compute: torch.device | None = None,
                          seed: int = 0) -> DeviceMemory:
    """The device's memory over one U-split iteration of zoo model ``spec`` at ``point`` on a synthetic batch of
    ``batch_size`` (seeded by ``seed``), its front trained under ``plan`` (one strategy per front segment, None: no
    recomputation), on ``compute`` (None: the CPU). Bytes, as ``DeviceSide.memory`` measures them: the activation
    peak (sent and received tensors included) plus parameters, gradients, momentum state and buffers."""
    parts = build_parts(spec, point, ("front", "middle", "tail"), compute=compute)
    device = DeviceSide(parts["front"], parts["tail"], plan=plan)
    x, y = example_input(spec, batch_size, seed), example_target(spec, batch_size, seed)
    if compute is not None:
        x, y = x.to(compute), y.to(compute)
    run_usplit_iteration(device, MecSide(parts["middle"]), x, y)
    return device.memory()

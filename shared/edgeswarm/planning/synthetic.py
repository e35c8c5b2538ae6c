"""Synthetic cluster profiles: planner inputs of any size without profiling, for tests, planning-time
benchmarks and what-if questions. Shapes follow the spec's descriptions (AC-10): a CNN's activations shrink
and its parameters grow with depth, ending in a dense classifier; a Transformer has uniform small activations
and large weights. Times follow a sub-linear batch curve (small batches underuse the device, spec 2.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edgeswarm.values.profiles import (
    ClusterProfile,
    ComputeProfile,
    DeviceInfo,
    DeviceProfileEntry,
    LinkProfile,
    ModelProfile,
    ModelSpec,
    UnitProfile,
)

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class SyntheticDevice:
    """A device by how many times slower than the reference it is, and its memory budget in bytes."""

    node: str
    slowdown: float
    memory_budget_bytes: int
    device_class: str = "synthetic"


def synthetic_cluster(units: int, devices: Sequence[SyntheticDevice], *, bandwidth_bps: float = 12.5e6,
                      shape: Literal["cnn", "transformer"] = "cnn", seed: int = 0,
                      batch_sizes: Sequence[int] = GRID, step_s: float = 2e-3,
                      bandwidths: dict[tuple[str, str], float] | None = None) -> ClusterProfile:
    """A ClusterProfile for a model of ``units`` units on ``devices``, every link at ``bandwidth_bps`` unless
    ``bandwidths`` overrides a pair. ``step_s`` is roughly the reference forward seconds per unit at batch 32."""
    rng = np.random.default_rng(seed)
    depth = np.linspace(0.0, 1.0, units)
    if shape == "cnn":
        act = 64 * 32 * 32 * 4 * 2.0 ** (-5 * depth) * rng.uniform(0.8, 1.2, units)
        weights = 4 * 9 * (16 * 2.0 ** (5 * depth)) ** 2 * rng.uniform(0.5, 1.5, units)
        weights[-1] = 4 * 4096 * 1000.0  # the dense classifier tail
        if units > 2:
            weights[-2] = 4 * 4096 * 4096.0
        flops = 2e7 * rng.uniform(0.5, 1.5, units)
    else:
        # A BERT-small-like encoder cut into fine units: 32 tokens x 512 hidden per sample (spec 7.1).
        act = np.full(units, 32 * 512 * 4.0)
        weights = np.full(units, 4 * 512 * 512 * 4.0) * rng.uniform(0.9, 1.1, units)
        flops = np.full(units, 2 * 32 * 4 * 512 * 512.0)
    unit_profiles = [
        UnitProfile(index=u, name=f"unit{u}", output_bytes_per_sample=int(act[u]), weight_bytes=int(weights[u]),
                    activation_bytes_per_sample=int((3 if shape == "cnn" else 1) * act[u]),
                    flops_per_sample=float(flops[u]))
        for u in range(units)
    ]
    model = ModelProfile(model=ModelSpec(name=f"synthetic-{shape}", config={"units": units, "seed": seed}),
                         fingerprint=f"synthetic-{shape}-{units}-{seed}", input_bytes_per_sample=3 * 32 * 32 * 4,
                         units=unit_profiles)
    base = step_s * flops / flops.mean()
    grid = np.asarray(batch_sizes, dtype=float)
    curve = (4.0 + grid) ** 0.95 / (4.0 + 32.0) ** 0.95  # sub-linear: fixed cost plus per-sample cost
    entries = []
    for d in devices:
        fwd = (d.slowdown * base[:, None] * curve[None, :]).tolist()
        bwd = (2.0 * d.slowdown * base[:, None] * curve[None, :]).tolist()
        fp = f"synthetic-{d.slowdown}"
        entries.append(DeviceProfileEntry(
            device=DeviceInfo(node=d.node, device_class=d.device_class, fingerprint=fp,
                              memory_budget_bytes=d.memory_budget_bytes),
            compute=ComputeProfile(model_fingerprint=model.fingerprint, device_fingerprint=fp,
                                   batch_sizes=list(batch_sizes), forward_s=fwd, backward_s=bwd)))
    overrides = bandwidths or {}
    links = [
        LinkProfile(src=a.node, dst=b.node,
                    bandwidth_bps=overrides.get((a.node, b.node), overrides.get((b.node, a.node), bandwidth_bps)))
        for i, a in enumerate(devices) for b in devices[i + 1:]
    ]
    return ClusterProfile(model=model, devices=entries, links=links)

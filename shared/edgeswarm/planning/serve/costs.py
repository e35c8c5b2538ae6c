"""A ClusterProfile as arrays for pipelined inference at one micro-batch size.

Per device: forward seconds of any unit range at micro-batch b (prefix sums of per-unit times, interpolated
piecewise-linearly over the profiled batch grid with t(0) = 0, never extrapolated: the Asteroid cost
model's rule); per unit range: inference memory = weights + buffers + the largest live activation (a unit's
input plus its output, b samples); per link: bandwidth (bytes/s, the slower direction) and latency (s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.errors import InfeasiblePlanError, ProfileError
from edgeswarm.profiling.types import ClusterProfile, ComputeProfile


def forward_prefix(compute: ComputeProfile, units: int, batch: int, node: str) -> np.ndarray:
    """Cumulative forward seconds of units [0, l) at ``batch`` samples, l = 0..units."""
    if len(compute.forward_s) != units:
        raise ProfileError(f"device {node}'s profile has {len(compute.forward_s)} units but the model has {units}")
    grid = compute.batch_sizes
    if grid[-1] < batch:
        raise ProfileError(f"device {node} is profiled up to batch size {grid[-1]} but the plan needs micro-batch "
                           f"{batch}: re-profile with --batch-sizes including {batch}, or plan a smaller one")
    xs = np.concatenate(([0.0], np.asarray(grid, dtype=float)))
    times = np.asarray(compute.forward_s, dtype=float)  # [unit, grid]
    per_unit = np.array([np.interp(batch, xs, np.concatenate(([0.0], row))) for row in times])
    return np.concatenate(([0.0], np.cumsum(per_unit)))


@dataclass(frozen=True)
class ServeCosts:
    """Array view of a cluster for serving: devices 0..N-1 in profile order (excluded ones removed)."""

    nodes: tuple[str, ...]
    budgets: np.ndarray          # (N,) bytes
    fwd: np.ndarray              # (N, L+1) cumulative forward seconds at micro-batch b
    bw: np.ndarray               # (N, N) bytes/s, inf on the diagonal
    latency: np.ndarray          # (N, N) seconds
    cut_bytes: np.ndarray        # (L,) bytes of one micro-batch crossing a cut after unit l
    input_bytes: int             # bytes of one micro-batch entering unit 0
    static_prefix: np.ndarray    # (L+1,) weights + buffers
    live: np.ndarray             # (L,) b * (input + output bytes per sample) of unit l
    batch: int
    fingerprint: str
    unit_names: tuple[str, ...]

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def units(self) -> int:
        return len(self.cut_bytes)

    def compute_s(self, d: int, start: int, end: int) -> float:
        return float(self.fwd[d, end] - self.fwd[d, start])

    def memory(self, start: int, end: int) -> int:
        """Inference bytes of units [start, end): weights + buffers + the largest live activation."""
        return int(self.static_prefix[end] - self.static_prefix[start] + self.live[start:end].max())

    def memory_from(self, start: int) -> np.ndarray:
        """memory(start, e) for e = 0..L (0 where e <= start)."""
        out = np.zeros(self.units + 1)
        out[start + 1:] = (self.static_prefix[start + 1:] - self.static_prefix[start]
                           + np.maximum.accumulate(self.live[start:]))
        return out

    def transfer_s(self, a: int, b: int, cut_after: int) -> float:
        """Seconds for one micro-batch of unit ``cut_after``'s output from device a to b."""
        return float(self.cut_bytes[cut_after] / self.bw[a, b] + self.latency[a, b])


def serve_costs(cluster: ClusterProfile, batch: int, exclude: Sequence[str] = ()) -> ServeCosts:
    """Build the arrays; ProfileError on a profile of another model, a short batch grid or a missing link."""
    gone = set(exclude)
    entries = [e for e in cluster.devices if e.device.node not in gone]
    if not entries:
        raise InfeasiblePlanError("no devices left to plan on: the cluster has none, or all are excluded; start "
                                  "some (edgeswarm up --local) or exclude fewer")
    model = cluster.model
    units = model.units
    for e in entries:
        if e.compute.model_fingerprint != model.fingerprint:
            raise ProfileError(f"device {e.device.node} was profiled for model {e.compute.model_fingerprint}, "
                               f"not {model.fingerprint}: re-profile it for this model")
    nodes = tuple(e.device.node for e in entries)
    fwd = np.stack([forward_prefix(e.compute, len(units), batch, e.device.node) for e in entries])
    index = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    bw = np.full((n, n), np.nan)
    lat = np.zeros((n, n))
    np.fill_diagonal(bw, np.inf)
    for lk in cluster.links:
        if lk.src in index and lk.dst in index and lk.src != lk.dst:
            i, j = index[lk.src], index[lk.dst]
            # Measured both ways: plan with the slower direction and the longer latency.
            bw[i, j] = bw[j, i] = np.fmin(bw[i, j], lk.bandwidth_bps)
            lat[i, j] = lat[j, i] = max(lat[i, j], lk.latency_s)
    missing = [(nodes[i], nodes[j]) for i in range(n) for j in range(i + 1, n) if np.isnan(bw[i, j])]
    if missing:
        pairs = ", ".join(f"{a}-{b}" for a, b in missing[:5])
        raise ProfileError(f"no link measurement for {len(missing)} device pair(s) ({pairs}): profile the links "
                           f"between every pair of devices")
    out_b = np.array([u.output_bytes_per_sample for u in units], dtype=np.float64)
    in_b = np.concatenate(([float(model.input_bytes_per_sample)], out_b[:-1]))
    return ServeCosts(
        nodes=nodes,
        budgets=np.array([e.device.memory_budget_bytes for e in entries], dtype=np.float64),
        fwd=fwd, bw=bw, latency=lat, cut_bytes=batch * out_b, input_bytes=batch * model.input_bytes_per_sample,
        static_prefix=np.concatenate(([0.0], np.cumsum([u.weight_bytes + u.buffer_bytes for u in units],
                                                      dtype=np.float64))),
        live=batch * (in_b + out_b), batch=batch, fingerprint=model.fingerprint,
        unit_names=tuple(u.name for u in units))

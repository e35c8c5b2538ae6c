"""A ClusterProfile as arrays for pipelined inference at one micro-batch size.

Per device: served-forward seconds (eval mode, no autograd) of any unit range at micro-batch b (prefix sums of
per-unit times, interpolated piecewise-linearly over the profiled batch grid with t(0) = 0, never extrapolated: the
Asteroid cost model's rule), priced by the range's extent (``vocabulary.extent_scale``), plus once per stage call
what the device pays beyond its units after idling (``ComputeProfile.cold_inference_s``); per unit range: inference
memory = weights + buffers + the largest live activation (a unit's input plus its output, b samples); per link:
bandwidth (bytes/s, the slower direction), latency (s) and the fixed seconds per message (``message_s``: every
micro-batch crosses a stage boundary as one tensor, one message per 1 MiB chunk, each costing that on top of its
bytes over the bandwidth; 0 in profiles measured before it existed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.planning.vocabulary import (
    INFERENCE,
    extent_factors,
    extent_scale,
    link_matrices,
    message_counts,
    message_matrix,
    static_bytes,
    unit_times,
)
from edgeswarm.values.profiles import ClusterProfile, ComputeProfile


def forward_prefix(compute: ComputeProfile, units: int, batch: int, node: str, fingerprint: str) -> np.ndarray:
    """Cumulative served-forward seconds (``ComputeProfile.inference_s``) of units [0, l) at ``batch`` samples,
    l = 0..units."""
    return np.concatenate(([0.0], np.cumsum(unit_times(compute, node, fingerprint, units, [batch],
                                                       inference=True)[0])))


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
    cold: np.ndarray             # (N,) seconds each stage's call pays beyond its units (cold_inference_s)
    extent: np.ndarray           # (N, 2) extent_scale's knots at micro-batch b
    message: np.ndarray | None = None  # (N, N) seconds per message; None: no per-message cost

    def message_s(self, a: int, b: int, nbytes: np.ndarray | float) -> np.ndarray | float:
        """Per-message seconds of a tensor of ``nbytes`` (one or an array) from device a to b: one message per
        1 MiB chunk, at least one (``vocabulary.messages``); 0 without a per-message cost."""
        if self.message is None:
            return 0.0
        return message_counts(np.asarray(nbytes)) * self.message[a, b]

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def units(self) -> int:
        return len(self.cut_bytes)

    def compute_s(self, d: int, start: int, end: int) -> float:
        """Seconds of one micro-batch's forward of units [start, end) on device d, the call's cold cost included."""
        return float(self.units_s(d, start, end)) + (self.cold_s(d) if end > start else 0.0)

    def units_s(self, d: int, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        """Seconds of one micro-batch's forward of units [start, end) on device d without the call's cold cost
        (arrays of ranges broadcast; 0 where end <= start)."""
        span = np.maximum(self.fwd[d, end] - self.fwd[d, start], 0.0)
        return span * extent_scale(span, self.fwd[d, -1], self.extent[d, 0], self.extent[d, 1])

    def cold_s(self, d: int) -> float:
        """What one call of a stage on device d pays beyond its units (``ComputeProfile.cold_inference_s``)."""
        return float(self.cold[d])

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
        return float(self.cut_bytes[cut_after] / self.bw[a, b] + self.latency[a, b]
                     + self.message_s(a, b, self.cut_bytes[cut_after]))


def serve_costs(cluster: ClusterProfile, batch: int, exclude: Sequence[str] = ()) -> ServeCosts:
    """Build the arrays; ProfileError on a profile of another model, a short batch grid or a missing link."""
    gone = set(exclude)
    entries = [e for e in cluster.devices if e.device.node not in gone]
    if not entries:
        raise InfeasiblePlanError("no devices left to plan on: the cluster has none, or all are excluded; start "
                                  "some (edgeswarm up --local) or exclude fewer")
    model = cluster.model
    units = model.units
    nodes = tuple(e.device.node for e in entries)
    fwd = np.stack([forward_prefix(e.compute, len(units), batch, e.device.node, model.fingerprint) for e in entries])
    bw, lat = link_matrices(cluster.links, nodes)
    message = message_matrix(cluster.links, nodes)
    out_b = np.array([u.output_bytes_per_sample for u in units], dtype=np.float64)
    in_b = np.concatenate(([float(model.input_bytes_per_sample)], out_b[:-1]))
    return ServeCosts(
        nodes=nodes,
        budgets=np.array([e.device.memory_budget_bytes for e in entries], dtype=np.float64),
        fwd=fwd, bw=bw, latency=lat, cut_bytes=batch * out_b, input_bytes=batch * model.input_bytes_per_sample,
        static_prefix=np.concatenate(([0.0], np.cumsum([static_bytes(u.weight_bytes, u.buffer_bytes, None)
                                                       for u in units], dtype=np.float64))),
        live=batch * (in_b + out_b), batch=batch, fingerprint=model.fingerprint,
        unit_names=tuple(u.name for u in units), message=message if message.any() else None,
        cold=np.array([e.compute.cold_inference_s for e in entries], dtype=np.float64),
        extent=np.stack([extent_factors(e.compute, [batch], INFERENCE)[0] for e in entries]))

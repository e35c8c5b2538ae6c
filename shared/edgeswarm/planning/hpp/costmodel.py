"""The Asteroid cost model as arrays: per-device times, memory (Eq. 3), AllReduce (Eq. 5b), round latency (Eqs. 4-6).

A ``CostModel`` is built once from a ClusterProfile and PlanOptions. It orders the devices as the planner
does (memory descending, then faster first: spec 4.7 and A13) and precomputes, for every device and every
integer batch size 0..B, prefix sums of forward and backward time over the units, so the time of any unit
range on any device at any share is two array lookups (spec 2.3), priced by its extent (the profile's units are
scaled to the whole model run as one stage; a shorter stage evicts less of the caches: ``vocabulary.extent_scale``).
Times between profiled batch sizes are interpolated piecewise-linearly with t(0) = 0 (A11); a profile that stops
short of B is an error, never an extrapolation.

Per-message costs (the links' ``message_s``: a fixed time per message through the brokers, beyond its bytes over
the bandwidth) are counted where a round sends messages: a communication step sends every micro-batch's rows as one
message per pair of devices that exchange rows (a device of a group of g talks to up to h devices of the next group
of h, so max(g, h) messages each way), plus one per further 1 MiB chunk; a ring AllReduce over g devices takes
2(g - 1) dependent steps of one chunk message each. The coordinator's requests of a round (a RoundStart to every
device and its answer, handled one after another on the coordinator's side) add a request round trip per device
(its median ``request_s`` over its links) to every round: ``round_overhead_s``. With every ``message_s`` and
``request_s`` at 0 the prices are those of bytes over bandwidth alone, exactly.

Times in seconds, sizes in bytes, bandwidth in bytes per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.errors import InfeasiblePlanError, PlanningError
from edgeswarm.planning.hpp.types import PlanOptions
from edgeswarm.planning.vocabulary import (
    BACKWARD,
    FORWARD,
    extent_factors,
    extent_scale,
    link_matrices,
    message_matrix,
    messages,
    request_seconds,
    static_bytes,
    unit_times,
)
from edgeswarm.values.profiles import ClusterProfile, ComputeProfile

# Entries of the per-device time tables (devices x (B + 1) x (L + 1)): 2**24 float64 is 128 MiB per table, far
# beyond a real cluster (32 devices x micro-batch 1024 x 200 units is 6.6 million).
MAX_TABLE_CELLS = 2**24


def warmup(stages: int, stage: int, micro_batches: int) -> int:
    """K_p^eff = min(2(P - p) - 1, M): forwards stage p runs before its first backward (spec 3.2, A4)."""
    return min(2 * (stages - stage) - 1, micro_batches)


def allreduce_s(weight_bytes: float, group_size: int, min_bandwidth_bps: float, message_s: float = 0.0) -> float:
    """Ring AllReduce time of ``weight_bytes`` of gradients over a group (Eq. 5b) plus ``message_s`` for every
    message of its 2(g - 1) steps (each step one slice of weight_bytes / g, chunked); 0 for one device."""
    if group_size <= 1 or weight_bytes <= 0:
        return 0.0
    return (2.0 * (group_size - 1) * weight_bytes / (group_size * min_bandwidth_bps)
            + 2.0 * (group_size - 1) * messages(weight_bytes / group_size) * message_s)


def comm_messages(nbytes: float, senders: int, receivers: int) -> int:
    """Messages one way of a communication step carries per micro-batch, as the slowest device sees them: one per
    peer it exchanges rows with (max(senders, receivers)) plus one per further chunk of the ``nbytes``."""
    return max(senders, receivers) + messages(nbytes) - 1


def round_latency(forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int,
                  allreduce: Sequence[float] | None = None) -> tuple[float, int]:
    """HPP-round latency (Eq. 4) and the dominant step for a chain of steps (exec, comm, exec, ...).

    Uses the closed form of Eqs. 5-6: with V_s = M*E_s + sum_{i<s} E_i and dm = argmax V_s, step s ends its
    execution at V_dm - sum_{i<s} Eb_i, so latency = max_s (V_dm - sum_{i<s} Eb_i + Ta_s).
    """
    ef = np.asarray(forward_s, dtype=float)
    eb = np.asarray(backward_s, dtype=float)
    ta = np.zeros_like(ef) if allreduce is None else np.asarray(allreduce, dtype=float)
    e = ef + eb
    v = micro_batches * e + np.concatenate(([0.0], np.cumsum(e)[:-1]))
    dm = int(np.argmax(v))
    cb = np.concatenate(([0.0], np.cumsum(eb)[:-1]))
    return float(v[dm] + np.max(ta - cb)), dm


@dataclass(frozen=True)
class DeviceSlot:
    """A device in planning order: its index in the ClusterProfile and its identity."""

    profile_index: int
    node: str
    device_class: str
    memory_budget_bytes: int


class CostModel:
    """Array form of a ClusterProfile for one PlanOptions. Devices are addressed by planning order 0..N-1."""

    def __init__(self, cluster: ClusterProfile, options: PlanOptions, *, memory_aware: bool = True) -> None:
        if not cluster.devices:
            raise InfeasiblePlanError("the cluster has no devices: start some (edgeswarm up --local) or list them")
        self.options = options
        self.model = cluster.model
        units = cluster.model.units
        self.L = len(units)
        b = options.micro_batch_size
        cells = len(cluster.devices) * (b + 1) * (self.L + 1)
        if cells > MAX_TABLE_CELLS:
            # The micro-batch, units and devices come from a plan request: refuse tables that would not fit rather
            # than allocate them (a profile up to batch size 2**30 asked for tens of GB per device).
            raise PlanningError(f"{len(cluster.devices)} devices x micro-batch {b} x {self.L} units is too large to "
                                f"plan: the cost tables would hold {cells} entries, at most {MAX_TABLE_CELLS}")
        # Dense per-device time tables for shares 0..B: [device, share, unit prefix].
        fwd = [self._dense(e.compute, e.device.node, b) for e in cluster.devices]
        bwd = [self._dense(e.compute, e.device.node, b, backward=True) for e in cluster.devices]
        whole = [f[b, -1] + g[b, -1] for f, g in zip(fwd, bwd, strict=True)]
        order = sorted(range(len(cluster.devices)),
                       key=lambda i: (-cluster.devices[i].device.memory_budget_bytes, whole[i], i))
        self.devices = [
            DeviceSlot(i, cluster.devices[i].device.node, cluster.devices[i].device.device_class,
                       cluster.devices[i].device.memory_budget_bytes)
            for i in order
        ]
        self.N = len(self.devices)
        self.fwd = np.stack([fwd[i] for i in order])  # [N, B+1, L+1]
        self.bwd = np.stack([bwd[i] for i in order])
        # extent_scale's knots for every device and share: [N, B+1, 2].
        self.fwd_extent = np.stack([extent_factors(cluster.devices[i].compute, range(b + 1), FORWARD) for i in order])
        self.bwd_extent = np.stack([extent_factors(cluster.devices[i].compute, range(b + 1), BACKWARD)
                                    for i in order])
        # What each call of a forward or backward pays beyond its units (ComputeProfile.cold_*_s): [N].
        self.cold_fwd = np.array([cluster.devices[i].compute.cold_forward_s for i in order], dtype=np.float64)
        self.cold_bwd = np.array([cluster.devices[i].compute.cold_backward_s for i in order], dtype=np.float64)
        self.no_cold = np.zeros_like(self.cold_fwd)
        self.budget = np.array([
            d.memory_budget_bytes if memory_aware else np.iinfo(np.int64).max // 4 for d in self.devices
        ], dtype=np.int64)
        self.bandwidth = self._bandwidth_matrix(cluster)
        nodes = [d.node for d in self.devices]
        self.message = message_matrix(cluster.links, nodes)
        # Seconds of one coordinator request to each device and its reply: the device's own request round trip
        # through the hub, as its profiler measured it.
        self.request_s = request_seconds(cluster.links, nodes)
        # Memory prefix sums (Eq. 3): static bytes = (2 + k_opt) * weights + buffers; activations = a0 + a1*y.
        self.static_prefix = _prefix([static_bytes(u.weight_bytes, u.buffer_bytes, options.optimizer) for u in units])
        self.weight_prefix = _prefix([u.weight_bytes for u in units])
        self.act_fixed_prefix = _prefix([u.activation_bytes_fixed for u in units])
        self.act_sample_prefix = _prefix([u.activation_bytes_per_sample for u in units])
        self.flops_prefix = _prefix([u.flops_per_sample for u in units], dtype=np.float64)
        self.cut_bytes = np.array([u.output_bytes_per_sample for u in units], dtype=np.float64)

    # --- construction ------------------------------------------------------------------------------

    def _dense(self, compute: ComputeProfile, node: str, b: int, *, backward: bool = False) -> np.ndarray:
        """Cumulative seconds of units [0, l) for every share 0..b of a micro-batch: [b + 1, L + 1]."""
        times = unit_times(compute, node, self.model.fingerprint, self.L, range(b + 1), backward=backward)
        return np.concatenate([np.zeros((b + 1, 1)), np.cumsum(times, axis=1)], axis=1)

    def _bandwidth_matrix(self, cluster: ClusterProfile) -> np.ndarray:
        return link_matrices(cluster.links, [d.node for d in self.devices])[0]

    # --- queries -----------------------------------------------------------------------------------

    def forward_s(self, devices: np.ndarray | int, shares: np.ndarray | int, start: np.ndarray | int,
                  end: np.ndarray | int) -> np.ndarray:
        """Seconds of one forward of units [start, end) on each device (planning-order index) at its share of a
        micro-batch (arguments broadcast as numpy arrays): the units' times plus the call's cold cost
        (``ComputeProfile.cold_forward_s``) wherever the device computes, units and samples both."""
        return self._call_s(self.fwd, self.fwd_extent, self.cold_fwd, devices, shares, start, end)

    def backward_s(self, devices: np.ndarray | int, shares: np.ndarray | int, start: np.ndarray | int,
                   end: np.ndarray | int) -> np.ndarray:
        """``forward_s`` for the backward (``ComputeProfile.cold_backward_s``)."""
        return self._call_s(self.bwd, self.bwd_extent, self.cold_bwd, devices, shares, start, end)

    def compute_s(self, devices: np.ndarray | int, shares: np.ndarray | int, start: np.ndarray | int,
                  end: np.ndarray | int, cold: bool = True) -> np.ndarray:
        """Forward plus backward seconds of one micro-batch (``forward_s`` + ``backward_s``); without the calls' cold
        costs when not ``cold``."""
        cold_fwd, cold_bwd = (self.cold_fwd, self.cold_bwd) if cold else (self.no_cold, self.no_cold)
        return (self._call_s(self.fwd, self.fwd_extent, cold_fwd, devices, shares, start, end)
                + self._call_s(self.bwd, self.bwd_extent, cold_bwd, devices, shares, start, end))

    @staticmethod
    def _call_s(table: np.ndarray, extent: np.ndarray, cold: np.ndarray, devices: np.ndarray | int,
                shares: np.ndarray | int, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        d, y, s, e = (np.asarray(a) for a in (devices, shares, start, end))
        span = table[d, y, e] - table[d, y, s]
        priced = span * extent_scale(span, table[d, y, -1], extent[d, y, 0], extent[d, y, 1])
        return priced + np.where((y > 0) & (e > s), cold[d], 0.0)

    def min_bandwidth(self, group_a: Sequence[int], group_b: Sequence[int]) -> float:
        """Slowest link between two device groups (planning-order indices), bytes per second."""
        return float(self.bandwidth[np.ix_(list(group_a), list(group_b))].min())

    def max_message(self, group_a: Sequence[int], group_b: Sequence[int]) -> float:
        """Largest per-message seconds on a link between two device groups (planning-order indices)."""
        return float(self.message[np.ix_(list(group_a), list(group_b))].max())

    def group_message(self, group: Sequence[int]) -> float:
        """Largest per-message seconds on a link inside a group; 0 for one device."""
        if len(group) <= 1:
            return 0.0
        return float(self.message[np.ix_(list(group), list(group))].max())

    def group_bandwidth(self, group: Sequence[int]) -> float:
        """Slowest link inside a group (self-pairs excluded: A17); inf for one device."""
        if len(group) <= 1:
            return math.inf
        sub = self.bandwidth[np.ix_(list(group), list(group))].copy()
        np.fill_diagonal(sub, np.inf)
        return float(sub.min())

    def static_bytes(self, start: int, end: int) -> int:
        """Weights, gradients and optimizer state of units [start, end) (Eq. 3 MOD + OPT), bytes."""
        return int(self.static_prefix[end] - self.static_prefix[start])

    def weight_bytes(self, start: int, end: int) -> int:
        """Trainable parameter bytes of units [start, end)."""
        return int(self.weight_prefix[end] - self.weight_prefix[start])

    def memory_bytes(self, start: int, end: int, share: int, warmup_count: int) -> int:
        """Eq. 3 for a device holding ``share`` samples of every micro-batch of stage [start, end)."""
        act = (max(0, self.act_fixed_prefix[end] - self.act_fixed_prefix[start])
               + share * (self.act_sample_prefix[end] - self.act_sample_prefix[start]))
        return int(self.static_bytes(start, end) + warmup_count * act)

    def round_overhead_s(self, devices: Sequence[int]) -> float:
        """The coordinator's requests of one round on ``devices`` (planning-order indices), seconds: a RoundStart
        to each and its answer. They go out and come back through one hub connection and are handled one after
        another (one dispatch thread on each side), so they cost the sum of the devices' request round trips."""
        return float(sum(self.request_s[d] for d in devices))

    def comm_s(self, cut_after: int, group_a: Sequence[int], group_b: Sequence[int]) -> float:
        """One way of a communication step: B samples of unit ``cut_after``'s output over the slowest link, plus the
        per-message seconds of its messages (``comm_messages``)."""
        nbytes = self.options.micro_batch_size * float(self.cut_bytes[cut_after])
        return (nbytes / self.min_bandwidth(group_a, group_b)
                + comm_messages(nbytes, len(group_a), len(group_b)) * self.max_message(group_a, group_b))


def _prefix(values: Sequence[float], dtype: type = np.int64) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(values, dtype=dtype))))

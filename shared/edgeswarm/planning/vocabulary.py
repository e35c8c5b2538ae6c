"""What every planner reads from a ClusterProfile the same way, written once: unit times at a batch size, the link
matrices, the fixed costs per message and per request, and the static memory of Eq. 3.

Times are seconds, bandwidths bytes per second, sizes bytes.

A tensor crosses a link as ``messages(nbytes)`` messages (the bus chunks tensors at MESSAGE_BYTES), each costing the
link's ``message_s`` on top of its bytes over the bandwidth; a coordinator's request to a device and the reply cost
the link's ``request_s``. With both at 0 (profiles measured before they existed) every price is bytes over bandwidth,
as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgeswarm.errors import ProfileError
from edgeswarm.values.profiles import OPTIMIZER_STATE_FACTOR, ComputeProfile, LinkProfile, Optimizer

# The bus sends a tensor in chunks of this many bytes (Settings.chunk_bytes, wire.chunking.DEFAULT_CHUNK_BYTES): each
# chunk is a message of its own through the brokers.
MESSAGE_BYTES = 1024 * 1024


def unit_times(compute: ComputeProfile, node: str, fingerprint: str, units: int, batches: Sequence[float], *,
               backward: bool = False, inference: bool = False) -> np.ndarray:
    """Seconds of every unit (columns) at each batch size of ``batches`` (rows): the profiled times interpolated
    piecewise-linearly over the batch grid with t(0) = 0, never extrapolated (the Asteroid cost model's rule).
    The training forward, or with ``backward`` the backward, or with ``inference`` the served forward (the
    training forward for a profile without one).

    Raises ProfileError when the profile is of another model (``fingerprint``), has another number of units, or
    stops short of the largest batch size asked."""
    if compute.model_fingerprint != fingerprint:
        raise ProfileError(f"device {node} was profiled for model {compute.model_fingerprint}, not {fingerprint}: "
                           "re-profile it for this model")
    rows = (compute.backward_s if backward else
            compute.inference_s if inference and compute.inference_s is not None else compute.forward_s)
    if len(rows) != units:
        raise ProfileError(f"device {node}'s profile has {len(rows)} units but the model has {units}")
    grid = compute.batch_sizes
    largest = max(batches, default=0)
    if grid[-1] < largest:
        raise ProfileError(f"device {node} is profiled up to batch size {grid[-1]} but the plan needs micro-batch "
                           f"{largest:g}: re-profile with --batch-sizes including {largest:g}, or plan a smaller one")
    xs = np.concatenate(([0.0], np.asarray(grid, dtype=np.float64)))
    ys = np.vstack([np.zeros((1, units)), np.asarray(rows, dtype=np.float64).T])  # [grid + 1, units]
    at = np.asarray(batches, dtype=np.float64)
    out = np.empty((len(at), units))
    for unit in range(units):
        out[:, unit] = np.interp(at, xs, ys[:, unit])
    return out


# Columns of ChainFactors' triples.
FORWARD, BACKWARD, INFERENCE = 0, 1, 2


def extent_factors(compute: ComputeProfile, batches: Sequence[float], kind: int) -> np.ndarray:
    """For each batch size of ``batches`` (rows): the two knots of ``extent_scale`` for the forward, backward or
    served forward (``kind``: FORWARD, BACKWARD or INFERENCE), from the profile's ``chain``: a stage's price over its
    units' sum at no extent (1 / whole: the units as timed alone) and at half the model (half / whole). Interpolated
    piecewise-linearly over the batch grid, held at its ends; (1, 1), one price for every extent, for a profile
    without ``chain``."""
    at = np.asarray(batches, dtype=np.float64)
    if compute.chain is None:
        return np.ones((len(at), 2))
    grid = np.asarray(compute.batch_sizes, dtype=np.float64)
    whole = np.array([c.whole[kind] for c in compute.chain])
    half = np.array([c.half[kind] for c in compute.chain])
    return np.stack([np.interp(at, grid, 1.0 / whole), np.interp(at, grid, half / whole)], axis=1)


# The fraction of a model's time from which a stage costs what the whole model run as one stage does
# (``extent_scale``): segments of MobileNetV2 of 0.66 and 0.85 of its time ran at 0.94x-0.98x and 1.00x-1.02x of the
# whole's factor, its halves at 0.82x-0.91x (batches 8 and 16, this project's VM): past three quarters of the model
# a stage evicts what the whole model evicts.
FULL_EXTENT = 0.75


def extent_scale(span: np.ndarray | float, whole: np.ndarray | float, low: np.ndarray | float,
                 half: np.ndarray | float) -> np.ndarray:
    """What a stage costs over its units' profiled times (``span`` seconds, the units of the whole model ``whole``
    seconds; arrays broadcast): piecewise-linear in the stage's fraction of the model through ``low`` at none,
    ``half`` at half and 1 from FULL_EXTENT on (``extent_factors``' knots). Priced by the fraction of the model's
    time, not of its units: a stage's caches hold what its units hold. Segments of MobileNetV2 of 0.05 to 0.35 of
    its time ran at 0.79x-0.93x of one factor for every extent, within 5% of this (this project's VM)."""
    x = np.divide(span, whole, out=np.ones(np.broadcast(span, whole).shape), where=np.asarray(whole) > 0)
    x = np.clip(x, 0.0, 1.0)
    rise = np.clip((x - 0.5) / (FULL_EXTENT - 0.5), 0.0, 1.0)
    return np.where(x <= 0.5, low + (half - low) * (2.0 * x), half + (1.0 - half) * rise)


def link_matrices(links: Sequence[LinkProfile], nodes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth (inf on the diagonal) and latency between ``nodes``, symmetric: a pair measured both ways uses
    the slower direction and the longer latency (transfers go both ways). Raises ProfileError naming the pairs
    without a measurement."""
    index = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    bw = np.full((n, n), np.nan)
    latency = np.zeros((n, n))
    np.fill_diagonal(bw, np.inf)
    for link in links:
        if link.src in index and link.dst in index and link.src != link.dst:
            i, j = index[link.src], index[link.dst]
            bw[i, j] = bw[j, i] = np.fmin(bw[i, j], link.bandwidth_bps)
            latency[i, j] = latency[j, i] = max(latency[i, j], link.latency_s)
    missing = [(nodes[i], nodes[j]) for i in range(n) for j in range(i + 1, n) if np.isnan(bw[i, j])]
    if missing:
        pairs = ", ".join(f"{a}-{b}" for a, b in missing[:5])
        raise ProfileError(f"no link measurement for {len(missing)} device pair(s) ({pairs}): profile the links "
                           "between every pair of devices")
    return bw, latency


def message_matrix(links: Sequence[LinkProfile], nodes: Sequence[str]) -> np.ndarray:
    """Per-message seconds (``per_message_s``: the link's and a broker hop's) between ``nodes``, symmetric: a pair
    measured both ways uses the larger; 0 on the diagonal (no message crosses a device's own link) and for pairs
    without a measurement (``link_matrices`` reports those)."""
    index = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    message = np.zeros((n, n))
    for link in links:
        if link.src in index and link.dst in index and link.src != link.dst:
            i, j = index[link.src], index[link.dst]
            message[i, j] = message[j, i] = max(message[i, j], link.per_message_s)
    return message


def request_seconds(links: Sequence[LinkProfile], nodes: Sequence[str]) -> np.ndarray:
    """Each node's request round trip through the hub (``request_s``): the median over the links it measured (their
    ``src``), so one request timed while the host was busy does not stand for the node; over the links to it when
    it measured none (a profile listing each pair once); 0 for a node without links."""
    out: dict[str, list[float]] = {n: [] for n in nodes}
    into: dict[str, list[float]] = {n: [] for n in nodes}
    for link in links:
        if link.src in out and link.dst in out and link.src != link.dst:
            out[link.src].append(link.request_s)
            into[link.dst].append(link.request_s)
    return np.array([float(np.median(out[n] or into[n])) if out[n] or into[n] else 0.0 for n in nodes])


def messages(nbytes: float) -> int:
    """How many messages a tensor of ``nbytes`` bytes is sent as: one per MESSAGE_BYTES chunk, at least one."""
    return max(1, math.ceil(nbytes / MESSAGE_BYTES))


def message_counts(nbytes: np.ndarray) -> np.ndarray:
    """``messages`` of every entry of ``nbytes``, as floats (for pricing arrays of cut points or unit ranges)."""
    return np.maximum(1.0, np.ceil(np.asarray(nbytes, dtype=np.float64) / MESSAGE_BYTES))


def static_bytes(weight_bytes: int, buffer_bytes: int, optimizer: Optimizer | None) -> int:
    """Eq. 3's static part: bytes held whatever the batch. Training (``optimizer`` given): the weights, their
    gradients, the optimizer's state (OPTIMIZER_STATE_FACTOR times the weights: 0 for SGD, 1 for momentum, 2 for
    Adam) and the buffers. Inference (None): the weights and the buffers."""
    if optimizer is None:
        return weight_bytes + buffer_bytes
    return (2 + OPTIMIZER_STATE_FACTOR[optimizer]) * weight_bytes + buffer_bytes

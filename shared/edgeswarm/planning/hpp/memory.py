"""The memory model of Eq. 3, itemised: what a device holding units [start, end) for ``batch`` samples per
micro-batch needs, in bytes. (The planner uses the same formula in array form, CostModel.memory_bytes.)"""

from __future__ import annotations

from pydantic import BaseModel

from edgeswarm.values.profiles import OPTIMIZER_STATE_FACTOR, ModelProfile, Optimizer


class MemoryBreakdown(BaseModel):
    """Bytes by kind: parameters, their gradient accumulators, buffers (BatchNorm statistics), optimizer state,
    and the activations kept for backward by ``warmup`` in-flight micro-batches."""

    weights_bytes: int
    gradients_bytes: int
    buffers_bytes: int
    optimizer_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.buffers_bytes + self.optimizer_bytes
                + self.activations_bytes)


def memory_breakdown(model: ModelProfile, start: int, end: int, batch: int, warmup: int = 1,
                     optimizer: Optimizer = "sgd") -> MemoryBreakdown:
    """Eq. 3 for units [start, end): MOD (weights + gradients) + OPT (k_opt x weights: 0 for SGD, 1 for
    momentum, 2 for Adam) + K x ACT(batch), plus buffers."""
    units = model.units[start:end]
    weights = sum(u.weight_bytes for u in units)
    act = (max(0, sum(u.activation_bytes_fixed for u in units))
           + batch * sum(u.activation_bytes_per_sample for u in units))
    return MemoryBreakdown(weights_bytes=weights, gradients_bytes=weights,
                           buffers_bytes=sum(u.buffer_bytes for u in units),
                           optimizer_bytes=OPTIMIZER_STATE_FACTOR[optimizer] * weights,
                           activations_bytes=warmup * act)

"""The static memory of a pipeline stage (Eq. 3 without its activations), measured without allocating it.

A stage-worker must refuse an assignment that does not fit its memory budget before it allocates the stage's
weights: building the stage for real first would let one oversized assignment claim gigabytes (or fail with an
allocator error rather than a budget refusal). The model and its layer sequence are therefore built on torch's
``meta`` device, where tensors have shapes and dtypes but no storage, and the stage's parameters and buffers are
summed there. The sizes are those of the real build: the same code builds both, only without storage.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model, without_weights
from edgeswarm.planning.vocabulary import static_bytes
from edgeswarm.values.profiles import ModelSpec, Optimizer


@dataclass(frozen=True)
class StageFootprint:
    """Bytes a stage holds whatever its batch: its parameters (``weights_bytes``) and buffers (``buffers_bytes``:
    BatchNorm statistics, position ids)."""

    weights_bytes: int
    buffers_bytes: int

    def static_bytes(self, optimizer: Optimizer) -> int:
        """Eq. 3's static part in bytes: weights, their gradients, the optimizer's state (OPTIMIZER_STATE_FACTOR
        times the weights: 0 for SGD, 1 for momentum, 2 for Adam) and the buffers."""
        return static_bytes(self.weights_bytes, self.buffers_bytes, optimizer)


def module_footprint(module: nn.Module) -> StageFootprint:
    """The parameter and buffer bytes of ``module`` (on any device, ``meta`` included)."""
    return StageFootprint(weights_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
                          buffers_bytes=sum(b.numel() * b.element_size() for b in module.buffers()))


def stage_footprint(model: ModelSpec, start: int, end: int) -> StageFootprint:
    """The footprint of units [start, end) of ``model``, computed without allocating a weight.

    Costs a trace of the model but no memory for its weights, and leaves every random number generator as it
    was, so the real build that may follow is initialised exactly as without this call. Raises what building the
    stage raises: ConfigError for a bad model spec, ModelTraceError, StageRangeError for a bad range.
    """
    with without_weights():
        module = layer_sequence(build_model(model)).build_stage(start, end)
    return module_footprint(module)

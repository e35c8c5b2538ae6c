"""A zoo model's per-unit costs for the SmartSplit planner (spec 4.1): the ``ModelCost`` it plans with.

Sizes come from the compute profiler's size pass (``profiling.compute.size_pass``): every unit runs in training mode
on the CPU at batches 2 and 4, its output and saved-for-backward bytes are fitted linearly in the batch and
evaluated at the profile's batch B, and its forward FLOPs are counted by torch's FLOP counter. No timing runs, so a
CIFAR VGG16 profiles in about a second.
"""

from __future__ import annotations

from edgeswarm.errors import ConfigError
from edgeswarm.models.sequence import layer_sequence
from edgeswarm.models.zoo import build_model, example_input, resolved_config
from edgeswarm.planning.splitfed.types import ModelCost, UnitCost
from edgeswarm.profiling.compute import size_pass
from edgeswarm.splitfed.recompute import is_expensive
from edgeswarm.values.profiles import ModelSpec

# Spec 4.1 [D]: backward FLOPs are about twice the forward's (input and weight gradients) unless measured.
BACKWARD_FLOPS_FACTOR = 2.0


def model_cost(spec: ModelSpec, batch_size: int, optimizer_states: int = 1) -> ModelCost:
    """Per-unit costs of zoo model ``spec`` at ``batch_size`` samples, ``optimizer_states`` s_opt (0 SGD, 1 momentum,
    2 Adam) recorded for the memory model M(u) = P(u)(2 + s_opt) + A(u).

    For each unit u of the layer sequence, in order: ``flops_fwd`` (FLOPs of one forward at B), ``flops_bwd``
    (BACKWARD_FLOPS_FACTOR times that), ``out_bytes`` O(u) (the tensor crossing a cut after u, at B),
    ``param_bytes`` P(u) (trainable parameters), ``act_bytes`` A(u) (distinct storages autograd saves for backward
    at B, parameters excluded), ``backward_bytes`` l^b (an upper bound of what is live during u's backward: A(u),
    its input and the input's gradient, its output and the output's gradient) and ``expensive`` (u contains a
    convolution, linear layer, matrix product, attention or recurrent cell).

    Raises ConfigError for a bad spec, a batch size below 1 or s_opt outside 0..2; UnitProfilingError when a unit
    fails to run."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an integer >= 1, not {batch_size!r}")
    if optimizer_states not in (0, 1, 2):
        raise ConfigError(f"optimizer_states must be 0, 1 or 2, not {optimizer_states!r}")
    seq = layer_sequence(build_model(spec).train())
    stages = [seq.build_stage(i, i + 1) for i in range(len(seq))]
    sizes = size_pass(spec, stages, [u.name for u in seq.units])
    x = example_input(spec, 1)
    in_bytes = x.numel() * x.element_size() * batch_size
    units = []
    for unit, size in zip(seq.units, sizes, strict=True):
        flops = float(size["flops_per_sample"]) * batch_size
        out_bytes = int(size["output_bytes_per_sample"]) * batch_size
        act = max(0, int(size["activation_bytes_fixed"]) + int(size["activation_bytes_per_sample"]) * batch_size)
        units.append(UnitCost(
            name=unit.name[:256], flops_fwd=flops, flops_bwd=BACKWARD_FLOPS_FACTOR * flops, out_bytes=out_bytes,
            param_bytes=int(size["weight_bytes"]), act_bytes=act, backward_bytes=act + 2 * in_bytes + 2 * out_bytes,
            expensive=is_expensive(unit.ops.split(","))))
        in_bytes = out_bytes
    classes = int(resolved_config(spec).get("num_classes", 10))
    return ModelCost(name=spec.name, batch_size=batch_size, units=units, optimizer_states=optimizer_states,
                     classes=max(2, classes))

"""A serving stage's compute, free of messaging: build units [start, end) of the zoo model for inference, load their
weights from a training job's checkpoint, and run one item forward on the worker's compute device as its device
class."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from edgeswarm.devices.compute import synchronized, use_device_threads
from edgeswarm.messages.serving import ServeAssign

if TYPE_CHECKING:
    import torch

    from edgeswarm.bus import Bus
    from edgeswarm.devices.emulation import DeviceProfile


@dataclass
class BuiltStage:
    """A stage's module in evaluation mode (on the CPU until moved), the layer sequence it was cut from, and the dtype
    and per-sample shape of the items it takes."""

    module: Any
    sequence: Any
    in_dtype: str
    in_shape: tuple[int, ...]


def build_stage(spec: ServeAssign, device: DeviceProfile) -> BuiltStage:
    """Units [spec.start, spec.end) of ``spec.model`` from the model's seed, in evaluation mode, on the CPU; torch
    computes on the threads ``device`` computes with from then on (``devices.compute.use_device_threads``)."""
    from edgeswarm.models.sequence import layer_sequence
    from edgeswarm.models.zoo import build_model, example_stage_input

    use_device_threads(device)
    sequence = layer_sequence(build_model(spec.model))
    x = example_stage_input(spec.model, sequence, spec.start, 1)
    module = sequence.build_stage(spec.start, spec.end).eval()
    return BuiltStage(module, sequence, str(x.dtype).removeprefix("torch."), tuple(x.shape[1:]))


def load_weights(bus: Bus, spec: ServeAssign, built: BuiltStage) -> None:
    """Load the stage's units' weights and buffers from the checkpoint stages of ``spec.weights`` that hold them."""
    from edgeswarm.state.layout import load_stage
    from edgeswarm.state.units import checkpoint_units, load_units, unit_names

    source = spec.weights
    assert source is not None
    names = unit_names(built.sequence)
    tensors: dict[str, Any] = {}
    for k, (start, end) in enumerate(source.stages):
        if start < spec.end and end > spec.start:
            tensors.update(load_stage(bus, source.store_node, source.job_id, k, source.version))
    load_units(built.module, None, checkpoint_units(tensors, built.module, names, spec.start, spec.end), names)


def forward(module: Any, x: torch.Tensor, device: DeviceProfile, compute: torch.device) -> torch.Tensor:
    """``module(x)`` under ``torch.inference_mode`` as ``device`` computes (its emulated slow-down), finished on
    ``compute`` before it returns."""
    import torch

    with torch.inference_mode():
        return device.run(partial(synchronized, partial(module, x), compute))  # type: ignore[no-any-return]

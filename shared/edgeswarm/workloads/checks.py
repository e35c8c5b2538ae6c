"""Checks every workload makes of a spec at submission: the model can be built, and it fits the cluster."""

from __future__ import annotations

from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.cluster import NodeView
from edgeswarm.planning.vocabulary import static_bytes
from edgeswarm.values.profiles import ModelSpec, Optimizer

MIB = 1 << 20


def model_problems(model: ModelSpec, members: list[NodeView], optimizer: Optimizer | None) -> list[str]:
    """Why ``model`` cannot run: an unknown zoo model or bad config, or (with the nodes whose stage-workers are
    online, ``members``) more memory than all their budgets together. The bytes kept whatever the batch are Eq. 3's
    static part: training (with ``optimizer``) weights, gradients, optimizer state and buffers; serving (None)
    weights and buffers. The model is measured on torch's meta device: nothing is allocated."""
    from edgeswarm.models.footprint import module_footprint
    from edgeswarm.models.zoo import build_model, without_weights

    try:
        with without_weights():
            footprint = module_footprint(build_model(model))
    except EdgeswarmError as exc:
        return [f"model: {exc}"]
    online = list(members)
    needed = static_bytes(footprint.weights_bytes, footprint.buffers_bytes, optimizer)
    total = sum(m.memory_budget_bytes for m in online)
    if online and needed > total:
        return [f"model: {model.name} needs {needed / MIB:.1f} MiB before any activation, but the {len(online)} "
                f"online devices have {total / MIB:.1f} MiB of memory budget together; it fits nowhere: add devices "
                "or pick a smaller model"]
    return []

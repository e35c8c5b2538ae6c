"""Averaging model states: the pure math that federated workloads share (FedAvg's weighted mean, Flower's
``aggregate``), free of any messaging. States are mappings from tensor name to tensor, as ``state_dict`` gives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    import torch


def weighted_mean(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """The mean of ``states`` weighted by ``weights`` (each client's sample count, say), tensor by tensor.

    Floating tensors are averaged in float64 and returned in their own dtype; integer tensors (BatchNorm's
    ``num_batches_tracked``) take the value of the heaviest state. Raises ConfigError for no states, weights that
    are negative, all zero or not one per state, or states whose names, shapes or dtypes differ.
    """
    import torch

    if not states:
        raise ConfigError("nothing to average: no states")
    if len(weights) != len(states):
        raise ConfigError(f"{len(weights)} weights for {len(states)} states: give one weight per state")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"weights must be non-negative and not all zero, not {list(weights)}")
    names = list(states[0])
    for k, state in enumerate(states[1:], start=1):
        if list(state) != names:
            raise ConfigError(f"state {k} holds {sorted(state)}, state 0 holds {sorted(names)}: they must match")
    total = float(sum(weights))
    heaviest = max(range(len(states)), key=lambda i: weights[i])
    out: dict[str, torch.Tensor] = {}
    for name in names:
        first = states[0][name]
        for k, state in enumerate(states):
            t = state[name]
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ConfigError(f"{name}: state {k} has {tuple(t.shape)} {t.dtype}, state 0 has "
                                  f"{tuple(first.shape)} {first.dtype}")
        if not first.is_floating_point():
            out[name] = states[heaviest][name].clone()
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
        for state, weight in zip(states, weights, strict=True):
            acc.add_(state[name].to(torch.float64), alpha=float(weight) / total)
        out[name] = acc.to(first.dtype)
    return out

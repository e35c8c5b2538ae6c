"""Aggregation math of federated learning, Flower-style and free of messaging: FedAvg's weighted mean of model
states, its hierarchical form (an edge server pre-aggregates its devices, the server finishes), and the checks that
refuse an update before it can poison the mean.

States are mappings from tensor name to tensor, as ``state_dict`` gives. FedAvg (spec §8):
``w <- sum_i (n_i / sum_k n_k) * w_i`` over the updates that were accepted.

- Floating tensors (weights, biases, and BatchNorm's running mean and variance, which are averaged like
  parameters) are summed as ``sum_i n_i * w_i`` in float64 (float32 on MPS, which has no float64) and divided by
  ``sum_i n_i`` at the end, then cast back to the reference's dtype. Flat and hierarchical aggregation run the same
  arithmetic, so they agree to float64 rounding (far below 1e-7).
- Integer tensors (BatchNorm's ``num_batches_tracked``) are not averaged: a count has no meaningful fraction. The
  result takes the value of the update with the largest single weight n_i (the earliest such update on ties), the
  device that ran the most local steps when batch sizes are equal. Partial sums carry that update's value and
  weight, so the hierarchical result picks the same one when partials are finished in device order.

An update is refused (``UpdateRejectedError``: its ``reason`` names why, for a per-cause counter) when its names,
shapes or dtypes differ from the global model's, when a floating tensor holds NaN or an infinity, or when its weight
is not a finite positive number. A refused update leaves the running sum untouched: the caller counts it and goes
on without it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgeswarm.devices.compute import to_compute
from edgeswarm.errors import ConfigError, EdgeswarmError

if TYPE_CHECKING:
    import torch

State = Mapping[str, "torch.Tensor"]


class UpdateRejectedError(EdgeswarmError):
    """A model update (or partial sum) cannot enter the aggregate; ``reason`` is "mismatch", "non_finite" or
    "bad_weight"."""

    reason: str = "rejected"


class UpdateMismatchError(UpdateRejectedError):
    """The update's tensor names, shapes or dtypes differ from the global model's."""

    reason = "mismatch"


class NonFiniteUpdateError(UpdateRejectedError):
    """A floating tensor of the update holds NaN or an infinity."""

    reason = "non_finite"


class BadWeightError(UpdateRejectedError):
    """The update's weight (its sample count) is not a finite number > 0."""

    reason = "bad_weight"


def check_update(update: State, reference: State, *, who: str = "update") -> None:
    """Raise UpdateMismatchError unless ``update`` has exactly ``reference``'s names with the same shapes and
    dtypes, and NonFiniteUpdateError if a floating tensor of it holds NaN or an infinity. ``who`` names the update
    in the message (a device id, say)."""
    import torch

    if set(update) != set(reference):
        missing, extra = sorted(set(reference) - set(update)), sorted(set(update) - set(reference))
        raise UpdateMismatchError(f"{who} does not match the global model: missing {missing[:5]}, unexpected "
                                  f"{extra[:5]}")
    for name, ref in reference.items():
        t = update[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise UpdateMismatchError(f"{who}: {name} is {got}, the global model's is {tuple(ref.shape)} "
                                      f"{ref.dtype}")
        if t.is_floating_point() and not _finite(t):
            raise NonFiniteUpdateError(f"{who}: {name} holds NaN or infinite values")


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite. A float64 sum is non-finite whenever a value is (NaN and infinities
    propagate) and, for 32-bit and narrower values, only then; a float64 tensor whose sum overflows is checked
    value by value (and so is anything on MPS, which has no float64). The sum is several times faster than
    ``isfinite(t).all()`` on the CPU."""
    import torch

    if t.device.type == "mps":  # no float64 there
        return bool(torch.isfinite(t).all())
    if bool(torch.isfinite(t.sum(dtype=torch.float64))):
        return True
    return bool(torch.isfinite(t).all()) if t.dtype == torch.float64 else False


def _check_weight(weight: float, who: str) -> float:
    # numbers.Real: numpy's counts (Partition.sizes() gives int64) are weights too.
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) or weight <= 0:
        raise BadWeightError(f"{who}: weight must be a finite number > 0 (its sample count), not {weight!r}")
    return float(weight)


@dataclass
class PartialSum:
    """What an edge server sends for its devices (spec §8, hierarchical option): ``sums[name]`` is
    ``sum_i n_i * w_i[name]`` for floating tensors (float64, or float32 on MPS) and, for integer tensors, the value
    of the update with the largest single weight; ``weight`` is ``sum_i n_i``; ``heaviest`` is that largest single
    n_i; ``count`` the number of updates summed. An empty partial has weight 0 and no sums."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    weight: float = 0.0
    heaviest: float = 0.0
    count: int = 0


class FedAvg:
    """A running FedAvg over updates of the model whose state is ``reference`` (the round-start global model).

    ``add`` one update at a time (memory: one float64 copy of the model, whatever the number of updates), or
    ``merge`` an edge server's PartialSum; ``partial`` is what an edge server sends on; ``result`` the mean.
    Sums live on ``compute`` (default: where ``reference``'s first tensor is); updates are moved there.
    """

    def __init__(self, reference: State, *, compute: torch.device | None = None) -> None:
        import torch

        if not reference:
            raise ConfigError("the global model's state is empty: nothing to aggregate")
        self._reference = dict(reference)
        first = next(iter(self._reference.values()))
        self._compute = compute if compute is not None else first.device
        self._acc_dtype = torch.float32 if self._compute.type == "mps" else torch.float64
        self._partial = PartialSum()

    @property
    def count(self) -> int:
        """How many updates the aggregate holds (merged partials count each of their updates)."""
        return self._partial.count

    @property
    def weight(self) -> float:
        """sum_i n_i over the updates held."""
        return self._partial.weight

    def add(self, update: State, weight: float, *, who: str = "update") -> None:
        """Add ``update`` with weight ``weight`` (n_i = |D^i|, or n_i * e_i / E under per-epoch re-selection).

        Raises UpdateRejectedError (the aggregate unchanged) for a mismatched or non-finite update or a weight
        that is not finite and > 0."""
        n = _check_weight(weight, who)
        check_update(update, self._reference, who=who)
        self._fold({name: update[name] for name in self._reference}, n, n, 1, scaled=False)

    def merge(self, partial: PartialSum, *, who: str = "partial sum") -> None:
        """Add an edge server's ``partial`` (see PartialSum). An empty partial (weight 0) is a no-op. Raises
        UpdateRejectedError (the aggregate unchanged) for sums that do not match the model (float sums must have
        the accumulation dtype), hold NaN or infinities, or weights that are not finite and > 0."""
        if partial.count == 0 and partial.weight == 0:
            return
        n = _check_weight(partial.weight, who)
        heaviest = _check_weight(partial.heaviest, who)
        if heaviest > n * (1 + 1e-9) or not isinstance(partial.count, int) or partial.count < 1:
            raise BadWeightError(f"{who}: heaviest weight {heaviest} or count {partial.count!r} is inconsistent "
                                 f"with total weight {n}")
        expected = {name: (ref if not ref.is_floating_point() else ref.to(self._acc_dtype))
                    for name, ref in self._reference.items()}
        check_update(partial.sums, expected, who=who)
        self._fold(partial.sums, n, heaviest, partial.count, scaled=True)

    def _fold(self, tensors: State, weight: float, heaviest: float, count: int, *, scaled: bool) -> None:

        mine = self._partial
        take_ints = heaviest > mine.heaviest  # strictly: the earlier update wins ties
        sums: dict[str, torch.Tensor] = {}
        for name, ref in self._reference.items():
            t = to_compute(tensors[name].detach(), self._compute)
            if not ref.is_floating_point():
                sums[name] = t.clone() if take_ints or name not in mine.sums else mine.sums[name]
                continue
            t = t.to(self._acc_dtype)
            term = t if scaled else t * weight
            sums[name] = term.clone() if name not in mine.sums else mine.sums[name] + term
        # Commit only once every tensor went through, so an exception above leaves the aggregate as it was.
        self._partial = PartialSum(sums=sums, weight=mine.weight + weight, heaviest=max(mine.heaviest, heaviest),
                                   count=mine.count + count)

    def partial(self) -> PartialSum:
        """The sums so far, to send on to the server (tensors shared with this aggregate: do not modify them)."""
        return self._partial

    def result(self) -> dict[str, torch.Tensor]:
        """The weighted mean: floating tensors ``sum_i n_i w_i / sum_i n_i`` in the reference's dtype, integer
        tensors the heaviest update's. Raises ConfigError when no update was accepted (the round failed)."""
        if self._partial.count == 0:
            raise ConfigError("no update was accepted this round: there is nothing to average")
        out: dict[str, torch.Tensor] = {}
        for name, ref in self._reference.items():
            s = self._partial.sums[name]
            out[name] = (s / self._partial.weight).to(ref.dtype) if ref.is_floating_point() else s.clone()
        return out

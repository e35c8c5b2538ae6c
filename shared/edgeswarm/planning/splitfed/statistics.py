"""A device's data statistics for selection (spec 2.3): the label skew Dis (Eq. 6) and the statistical utility
Stat (Eq. 7). Pure arithmetic over what the MEC caches hold."""

from __future__ import annotations

import math
from collections.abc import Sequence


def dis(distribution: Sequence[float]) -> float:
    """Eq. 6: the KL divergence (nats, natural log) of a label distribution from the uniform one over its
    ``len(distribution)`` classes; 0 for uniform, ln C for one-hot. ``distribution`` may be counts or
    probabilities (it is normalised); entries must be finite and non-negative, and 0 log 0 counts as 0. An
    all-zero (empty) distribution has no skew to report: 0."""
    classes = len(distribution)
    if classes < 2:
        raise ValueError("a label distribution needs at least two classes")
    if any(not math.isfinite(p) or p < 0.0 for p in distribution):
        raise ValueError("a label distribution needs finite, non-negative entries")
    total = math.fsum(distribution)
    if total <= 0.0:
        return 0.0
    kl = math.fsum(p / total * math.log(p / total * classes) for p in distribution if p > 0.0)
    return max(0.0, kl)  # rounding may leave -1e-17 for a uniform distribution


def stat(losses: Sequence[float]) -> float:
    """Eq. 7: ``|D| * sqrt(mean(L(s)^2))`` over a device's per-sample losses (loss units); 0 for no samples."""
    return stat_from_sums(len(losses), math.fsum(x * x for x in losses))


def stat_from_sums(samples: int, squared_loss_sum: float) -> float:
    """Eq. 7 from the scalars a device reports (spec 5.1): ``sqrt(|D| * sum L(s)^2)``; 0 for no samples."""
    if samples < 0 or not math.isfinite(squared_loss_sum) or squared_loss_sum < 0.0:
        raise ValueError("Stat needs a non-negative sample count and squared-loss sum")
    return math.sqrt(samples * squared_loss_sum) if samples else 0.0

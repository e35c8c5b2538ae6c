"""Latency percentiles, one definition for the coordinator's progress, the CLI and the benchmark."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of ascending ``values`` by nearest rank; None when there are none."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]

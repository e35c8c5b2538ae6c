"""Step D: bandwidth classes (spec 2.4). Bigger transfer => higher class, 1..C."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def class_edges(all_transfers: Sequence[float], classes: int) -> np.ndarray:
    """C+1 equally spaced edges from min to max over the transfer sizes of *all* candidate points."""
    return np.histogram_bin_edges(np.asarray(all_transfers, dtype=float), bins=classes)


def bandwidth_classes(chosen: Sequence[float], all_transfers: Sequence[float], classes: int,
                      clamp: bool = True) -> list[int]:
    """class(T) = digitize(T, edges): i with edges[i-1] <= T < edges[i]. A value equal to the maximum gets
    C+1 in the reference code (which then fails to place it); ``clamp`` (normative) maps it to C."""
    if classes < 1:
        raise ValueError("at least one bandwidth class")
    edges = class_edges(all_transfers, classes)
    out = [int(c) for c in np.digitize(np.asarray(chosen, dtype=float), edges)]
    return [min(max(c, 1), classes) for c in out] if clamp else out

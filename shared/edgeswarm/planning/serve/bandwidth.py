"""The spec 5.2 communication graph: n nodes uniform in [1, 150]^2, B(u, v) = log2(1 + a / d^2) Mbit/s."""

from __future__ import annotations

import numpy as np

PATH_LOSS_A = 283_230.0


def bandwidth_from_positions(pos: np.ndarray) -> np.ndarray:
    """Symmetric bandwidth matrix (Mbit/s) for node positions ``pos`` (n x 2); the diagonal is inf."""
    d2 = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(axis=-1)
    with np.errstate(divide="ignore"):
        bw = np.log2(1.0 + PATH_LOSS_A / d2)
    np.fill_diagonal(bw, np.inf)
    return bw


def random_bandwidths(n: int, rng: np.random.Generator) -> np.ndarray:
    """A fresh complete graph on ``n`` nodes (positions rand * 149 + 1), seeded through ``rng``."""
    return bandwidth_from_positions(rng.random((n, 2)) * 149.0 + 1.0)

"""The BO quality check (spec U6) as a function the tests and ``edgeswarm bench splitfed`` share: on seeded
random instances, how close Bayesian optimisation gets to the exhaustive optimum over chi."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.splitfed.cost import cost_table
from edgeswarm.planning.splitfed.objective import normalisers
from edgeswarm.planning.splitfed.solvers import bayesian, exhaustive, grid
from edgeswarm.planning.splitfed.synthetic import random_instance
from edgeswarm.planning.splitfed.types import SplitOptions

TOLERANCE = 0.02


class BoQuality(BaseModel):
    """The U6 figures: instances run, the fraction where BO is within ``tolerance`` (relative) of the exhaustive
    optimum, the worst and mean relative gaps, BO's evaluations against |chi|, and how often BO ended worse than
    its best initial point (must be 0)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instances: int = Field(ge=0)
    tolerance: float
    within: float = Field(ge=0.0, le=1.0)
    worst_gap: float
    mean_gap: float
    evaluations: int = Field(ge=0)
    space: int = Field(ge=0)
    worse_than_initial: int = Field(ge=0)


def bo_quality(instances: int = 50, seed: int = 0, devices: int = 100, units: int = 10,
               counts: tuple[int, int] = (15, 25), threshold_devices: float = 20.0,
               options: SplitOptions | None = None) -> BoQuality:
    """Run ``instances`` random instances (``devices`` devices, ``units`` units, count n over ``counts`` so chi is
    two-dimensional) with BO and exhaustive search under ``options`` (defaults otherwise), all seeded by
    ``seed``. D_threshold is ``threshold_devices`` times the mean |D^i|: without it F only grows with n (more Dis,
    a later straggler), so the optimum always sits at n_min and the count axis is idle."""
    rng = np.random.default_rng(seed)
    base = options if options is not None else SplitOptions()
    opts = base.model_copy(update={"n_min": counts[0], "n_max": counts[1]})
    gaps: list[float] = []
    worse = 0
    evaluations = space = 0
    for k in range(instances):
        model, devs, mecs = random_instance(rng, devices=devices, units=units)
        mean_samples = sum(d.samples for d in devs) / max(1, len(devs))
        opts = opts.model_copy(update={"d_threshold": int(threshold_devices * mean_samples)})
        table = cost_table(model, devs, mecs, opts)
        norm = normalisers(table, opts)
        eligible = int(table.eligible.sum())
        points = grid(table.feasible.shape[1], min(counts[0], eligible), min(counts[1], eligible))
        best = exhaustive(table, points, opts, norm)
        found = bayesian(table, points, opts, norm, np.random.default_rng(seed * 1_000_003 + k))
        gaps.append((found.decoded.objective - best.decoded.objective) / max(abs(best.decoded.objective), 1e-12))
        worse += int(found.decoded.objective > found.initial_best)
        evaluations, space = found.evaluations, len(points)
    arr = np.array(gaps) if gaps else np.zeros(1)
    return BoQuality(instances=instances, tolerance=TOLERANCE, within=float((arr <= TOLERANCE).mean()),
                     worst_gap=float(arr.max()), mean_gap=float(arr.mean()), evaluations=evaluations, space=space,
                     worse_than_initial=worse)

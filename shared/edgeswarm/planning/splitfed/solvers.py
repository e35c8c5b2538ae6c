"""Solvers over the search space chi = {(target cut, count)} (spec 4.4): exhaustive, a global oracle that ignores
MEC contention (for tests), and Bayesian optimisation with a Gaussian-process surrogate and Expected Improvement
scanned over the whole (small) grid. Every solver returns the best point it evaluated with its decoded selection."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm as gaussian
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, Matern
from threadpoolctl import threadpool_limits

from edgeswarm.planning.splitfed.cost import CostTable
from edgeswarm.planning.splitfed.objective import Decoded, Normalisers, decode, objective, sharing
from edgeswarm.planning.splitfed.types import SplitOptions

GP_NOISE = 1e-6  # the spec's Gaussian noise on the scaled targets: the objective is deterministic
GP_RESTARTS = 1  # marginal-likelihood restarts on the first fit; later fits start from the previous optimum


@dataclass(frozen=True)
class Solution:
    """The best point (target cut, count), its decoded selection and how many points were evaluated."""

    point: tuple[int, int]
    decoded: Decoded
    evaluations: int
    initial_best: float  # the best objective among BO's initial points (inf for the other solvers)


def grid(cuts: int, n_min: int, n_max: int) -> list[tuple[int, int]]:
    """chi: every (target cut 1..cuts, count n_min..n_max), cut-major."""
    return [(j, n) for j in range(1, cuts + 1) for n in range(n_min, n_max + 1)]


def exhaustive(table: CostTable, points: list[tuple[int, int]], options: SplitOptions,
               norm: Normalisers) -> Solution:
    """Evaluate every point; the first of equal optima wins (grid order)."""
    best: tuple[tuple[int, int], Decoded] | None = None
    for p in points:
        d = decode(table, p[0], p[1], options, norm)
        if best is None or d.objective < best[1].objective:
            best = (p, d)
    if best is None:
        raise ValueError("the search space is empty")
    return Solution(best[0], best[1], len(points), float("inf"))


def global_oracle(table: CostTable, n: int, options: SplitOptions, norm: Normalisers) -> Solution:
    """Spec 4.4's exact optimum under fixed n ignoring MEC contention: for each distinct fastest round time tau,
    the n devices of smallest Dis among those at most tau, each at its fastest cut; the objective is then
    re-evaluated with the selection's own sharing, as decode does. Points to no target cut (reported as the
    most common chosen cut)."""
    best_t = table.best_times()
    t_free = table.fixed_s + table.mec_work / table.mec_speed[table.mec_of][:, None]
    fastest = np.where(table.feasible, t_free, np.inf).argmin(axis=1) + 1
    rows = np.flatnonzero(np.isfinite(best_t))
    best: tuple[float, np.ndarray] | None = None
    for tau in np.unique(best_t[rows]):
        ok = rows[best_t[rows] <= tau]
        if len(ok) < min(n, len(rows)):
            continue
        pick = ok[np.lexsort((ok, -table.samples[ok], table.dis[ok]))[:n]]
        if int(table.samples[pick].sum()) < options.d_threshold:
            continue
        value = objective(float(table.dis[pick].sum()), float(best_t[pick].max()), options.lam, norm)
        if best is None or value < best[0]:
            best = (value, pick)
    if best is None:
        raise ValueError("no selection meets D_threshold")
    pick = best[1]
    # Reported with the selection's own MEC sharing, like every other solver's result.
    times = table.times(pick, fastest[pick], sharing(table, pick))
    t_system = float(times.max())
    value = objective(float(table.dis[pick].sum()), t_system, options.lam, norm)
    best_decoded = Decoded(pick, fastest[pick], times, t_system, value)
    target = int(np.bincount(best_decoded.cuts).argmax())
    return Solution((target, len(pick)), best_decoded, len(np.unique(best_t[rows])), float("inf"))


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float) -> np.ndarray:
    """EI of minimising y (i.e. of maximising -y) at predicted means ``mu`` and standard deviations ``sigma``."""
    sigma = np.maximum(sigma, 1e-12)
    gain = best - mu
    z = gain / sigma
    return gain * gaussian.cdf(z) + sigma * gaussian.pdf(z)


def bayesian(table: CostTable, points: list[tuple[int, int]], options: SplitOptions, norm: Normalisers,
             rng: np.random.Generator) -> Solution:
    """BO over ``points``: init = the previous round's best (if in chi) + ``bo_init`` seeded random points,
    then Expected Improvement maximised over every unevaluated point of a GP (Matern 5/2 on inputs scaled to
    [0, 1], noise 1e-6, kernel hyperparameters by marginal likelihood) until min(bo_budget, |chi|) evaluations;
    returns the best evaluated point. Falls back to exhaustive when the budget covers chi."""
    budget = min(options.bo_budget, len(points))
    if budget >= len(points):
        return exhaustive(table, points, options, norm)
    # The GP's matrices are at most budget x budget: BLAS threads only add contention (5x slower on a busy host).
    with threadpool_limits(limits=1):
        return _bayesian(table, points, options, norm, rng, budget)


def _bayesian(table: CostTable, points: list[tuple[int, int]], options: SplitOptions, norm: Normalisers,
              rng: np.random.Generator, budget: int) -> Solution:
    x = np.array(points, dtype=np.float64)
    lo, span = x.min(axis=0), np.maximum(x.max(axis=0) - x.min(axis=0), 1.0)
    scaled = (x - lo) / span
    index = {p: k for k, p in enumerate(points)}
    evaluated: dict[int, Decoded] = {}
    start: list[int] = []
    if options.previous_best is not None and tuple(options.previous_best) in index:
        start.append(index[tuple(options.previous_best)])
    others = [k for k in rng.permutation(len(points)).tolist() if k not in start]
    start += others[:min(options.bo_init, budget - len(start))]
    if not start:
        start = others[:1]
    for k in start:
        evaluated[k] = decode(table, *points[k], options, norm)
    initial_best = min(d.objective for d in evaluated.values())
    kernel = ConstantKernel(1.0, (1e-3, 1e3)) * Matern(length_scale=[0.3, 0.3], length_scale_bounds=(1e-2, 1e2),
                                                      nu=2.5)
    fits = 0
    while len(evaluated) < budget:
        keys = list(evaluated)
        y = np.array([evaluated[k].objective for k in keys])
        finite = np.isfinite(y)
        if not finite.any():
            nxt = next(k for k in others if k not in evaluated)
        else:
            # A point that cannot meet D_threshold is worse than any other: fit it just above the worst seen.
            worst = float(y[finite].max())
            y = np.where(finite, y, worst + abs(worst) + 1.0)
            gp = GaussianProcessRegressor(kernel=kernel, alpha=GP_NOISE, normalize_y=True,
                                          n_restarts_optimizer=GP_RESTARTS if fits == 0 else 0,
                                          random_state=int(rng.integers(1 << 31)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                gp.fit(scaled[keys], y)
            kernel = gp.kernel_  # one more point moves the likelihood optimum little: start the next fit here
            fits += 1
            rest = np.array([k for k in range(len(points)) if k not in evaluated])
            mu, sigma = gp.predict(scaled[rest], return_std=True)
            ei = expected_improvement(mu, sigma, float(y.min()))
            nxt = int(rest[int(np.argmax(ei))])  # first maximum: ties go to the earlier grid point
        evaluated[nxt] = decode(table, *points[nxt], options, norm)
    k_best = min(evaluated, key=lambda k: (evaluated[k].objective, k))
    return Solution(points[k_best], evaluated[k_best], len(evaluated), initial_best)

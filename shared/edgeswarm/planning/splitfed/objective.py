"""The central manager's objective (spec 4.3) and the decode of a search point (target cut, count) into a
selection (spec 4.4).

F(S, j) = sum_{i in S} Dis(i) / ln C + lam * T_system(S) / T_ref, with |S| = n, j_i in J_i and
sum |D^i| >= D_threshold. T_ref is the median over eligible devices of their fastest feasible round time without
MEC contention; with ``normalise`` off both divisors are 1 (the paper's Eq. 10 with lam scaled by n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeswarm.planning.splitfed.cost import CostTable, skew_scale
from edgeswarm.planning.splitfed.types import SplitOptions


@dataclass(frozen=True)
class Normalisers:
    """The objective's divisors: of Dis (ln C or 1) and of time (T_ref seconds or 1)."""

    skew: float
    time: float


@dataclass(frozen=True)
class Decoded:
    """A selection: device rows (positions in the table), their 1-based cuts and round times (seconds, with the
    selection's own MEC sharing), T_system and F. ``objective`` is +inf when D_threshold cannot be met."""

    rows: np.ndarray
    cuts: np.ndarray
    times: np.ndarray
    t_system: float
    objective: float


def normalisers(table: CostTable, options: SplitOptions) -> Normalisers:
    """ln C and T_ref (median fastest feasible round time of the eligible devices, n_m = 1), or 1 and 1."""
    if not options.normalise:
        return Normalisers(1.0, 1.0)
    best = table.best_times()
    best = best[np.isfinite(best)]
    t_ref = float(np.median(best)) if best.size else 1.0
    return Normalisers(skew_scale(table.classes, True), t_ref if t_ref > 0.0 else 1.0)


def objective(dis_sum: float, t_system: float, lam: float, norm: Normalisers) -> float:
    """F = sum Dis / ln C + lam * T_system / T_ref (spec 4.3)."""
    return dis_sum / norm.skew + lam * t_system / norm.time


def sharing(table: CostTable, rows: np.ndarray) -> np.ndarray:
    """n_m of each selected device: how many selected devices share its MEC."""
    counts = np.bincount(table.mec_of[rows], minlength=len(table.mec_names))
    return counts[table.mec_of[rows]]


def expected_sharing(table: CostTable, n: int) -> np.ndarray:
    """The n_m each device's score assumes before the selection is known: MEC m's share of n by its eligible
    devices (at least 1). Spec 4.4 says "the previous round's n_m"; the planner holds no state between rounds,
    and over rounds the previous n_m averages to this share."""
    eligible = table.eligible
    per_mec = np.bincount(table.mec_of[eligible], minlength=len(table.mec_names)).astype(np.float64)
    total = max(1.0, float(per_mec.sum()))
    return np.maximum(1, np.rint(n * per_mec / total)).astype(np.int64)[table.mec_of]


def closest_cuts(table: CostTable, target: int) -> np.ndarray:
    """Per device, the feasible cut closest to ``target`` (ties to the smaller cut: less device memory); 0 where
    J_i is empty."""
    n_cuts = table.feasible.shape[1]
    cuts = np.arange(1, n_cuts + 1)
    # Distance, then the cut itself as a tie-break, folded into one key: distance * (J+1) + cut.
    key = np.abs(cuts - target) * (n_cuts + 1) + cuts
    key = np.where(table.feasible, key[None, :], np.iinfo(np.int64).max)
    best = key.argmin(axis=1) + 1
    return np.where(table.eligible, best, 0)


def decode(table: CostTable, target: int, n: int, options: SplitOptions, norm: Normalisers) -> Decoded:
    """Spec 4.4: each eligible device takes its feasible cut closest to ``target``; the ``n`` devices with the
    lowest score Dis/ln C + lam T_i(j_i)/T_ref (T with the expected MEC sharing; ties to more samples, then the
    lower row) form S; members with the fewest samples are swapped for non-members with the most until
    D_threshold is met (+inf if it cannot be); T is then recomputed with S's own sharing. ``n`` larger than the
    eligible devices takes them all."""
    eligible = np.flatnonzero(table.eligible)
    cuts_all = closest_cuts(table, target)
    cuts = cuts_all[eligible]
    t_guess = table.times(eligible, cuts, expected_sharing(table, n)[eligible])
    score = table.dis[eligible] / norm.skew + options.lam * t_guess / norm.time
    order = np.lexsort((eligible, -table.samples[eligible], score))
    chosen = eligible[order[:n]]
    rest = eligible[order[n:]]
    possible = _meet_threshold(table, chosen, rest, options.d_threshold)
    if possible is None:
        return Decoded(chosen, cuts_all[chosen], np.zeros(len(chosen)), 0.0, float("inf"))
    chosen = possible
    chosen_cuts = cuts_all[chosen]
    times = table.times(chosen, chosen_cuts, sharing(table, chosen))
    t_system = float(times.max()) if times.size else 0.0
    value = objective(float(table.dis[chosen].sum()), t_system, options.lam, norm)
    return Decoded(chosen, chosen_cuts, times, t_system, value)


def _meet_threshold(table: CostTable, chosen: np.ndarray, rest: np.ndarray, threshold: int) -> np.ndarray | None:
    """Swap the member with the fewest samples for the non-member with the most until the members hold
    ``threshold`` samples; None when no swap can help any more."""
    chosen = chosen.copy()
    rest = rest.copy()
    for _ in range(len(chosen) + 1):
        if int(table.samples[chosen].sum()) >= threshold:
            return chosen
        if not rest.size or not chosen.size:
            return None
        a = int(np.argmin(table.samples[chosen]))
        b = int(np.argmax(table.samples[rest]))
        if table.samples[rest[b]] <= table.samples[chosen[a]]:
            return None
        chosen[a], rest[b] = rest[b], chosen[a]
    return chosen if int(table.samples[chosen].sum()) >= threshold else None

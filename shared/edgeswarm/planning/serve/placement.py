"""Step E and the baselines (spec 2.5, 3, 4): place q partitions on distinct nodes of a complete bandwidth
graph, and evaluate beta = max_t T_t / B(N_t, N_{t+1}) (seconds when T is in Mbit and B in Mbit/s).

Nodes are ints 0..n-1 (their order is the tie-break order); ``bw`` is a symmetric n x n matrix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.planning.serve.kpath import ExactKPath, KPathOracle, bottleneck_kpath
from edgeswarm.planning.serve.partition import FitsFn, Status, feasible_cut_vectors


@dataclass(frozen=True)
class Placement:
    """``nodes[r]`` holds partition r; ``beta`` in seconds (0.0 with status SINGLE_PARTITION, inf when the
    placement failed); ``status`` says which."""

    status: Status
    nodes: tuple[int, ...] = ()
    beta: float = math.inf


def bottleneck(transfers: Sequence[float], nodes: Sequence[int], bw: np.ndarray) -> float:
    """beta of a placement: the slowest inter-partition transfer (0 for one partition)."""
    return float(max((transfers[t] / bw[nodes[t], nodes[t + 1]] for t in range(len(transfers))), default=0.0))


def lower_bound(transfers: Sequence[float], bw: np.ndarray) -> float:
    """LB = max_t T_t / (best link of the graph): valid for any placement of this partition (spec 4)."""
    n = bw.shape[0]
    best = max(float(bw[i, j]) for i in range(n) for j in range(i + 1, n))
    return max(transfers, default=0.0) / best


def runs_of(classes: Sequence[int], x: int) -> list[tuple[int, int]]:
    """Maximal runs (first index, length) of consecutive transfers of class x, longest first, then left-most."""
    runs: list[tuple[int, int]] = []
    t = 0
    while t < len(classes):
        if classes[t] == x:
            a = t
            while t < len(classes) and classes[t] == x:
                t += 1
            runs.append((a, t - a))
        else:
            t += 1
    return sorted(runs, key=lambda r: (-r[1], r[0]))


def place_kpath(transfers: Sequence[float], classes: Sequence[int], n_classes: int, bw: np.ndarray,
                oracle: KPathOracle | None = None, nodes: Sequence[int] | None = None) -> Placement:
    """PLACE (spec 2.5): classes from C down to 1; each run of a class gets a bottleneck path between the
    endpoints fixed by higher classes (re-added to the free set). A class outside 1..C is never visited, so
    its partitions stay unplaced: status NO_MATCHING, as the reference code fails."""
    q = len(transfers) + 1
    if q == 1:
        return Placement(Status.SINGLE_PARTITION, (min(nodes) if nodes else 0,), 0.0)
    free = set(range(bw.shape[0]) if nodes is None else nodes)
    if q > len(free):
        return Placement(Status.NO_MATCHING)
    nmap: list[int | None] = [None] * q
    for x in range(n_classes, 0, -1):
        for a, length in runs_of(classes, x):
            s, e = nmap[a], nmap[a + length]
            allowed = set(free)
            allowed.update(v for v in (s, e) if v is not None)
            res = bottleneck_kpath(bw, sorted(allowed), length + 1, s, e, oracle, transfers[a:a + length])
            if not res.path:
                return Placement(Status.NO_MATCHING)
            for r, v in zip(range(a, a + length + 1), res.path, strict=True):
                nmap[r] = v
                free.discard(v)
    if any(v is None for v in nmap):
        return Placement(Status.NO_MATCHING)
    placed = tuple(int(v) for v in nmap if v is not None)
    return Placement(Status.OK, placed, bottleneck(transfers, placed, bw))


def _trivial(q: int, pool: list[int]) -> Placement | None:
    """The placement of ``q`` partitions that needs no search: a single partition, or more than the nodes."""
    if q == 1:
        return Placement(Status.SINGLE_PARTITION, (pool[0],), 0.0)
    if q > len(pool):
        return Placement(Status.NO_MATCHING)
    return None


def _smallest_beta(paths: Iterable[Sequence[int]], transfers: Sequence[float], bw: np.ndarray) -> Placement:
    """The path of ``paths`` with the smallest beta (ties: the earliest)."""
    best: Placement | None = None
    for path in paths:
        beta = bottleneck(transfers, path, bw)
        if best is None or beta < best.beta:
            best = Placement(Status.OK, tuple(path), beta)
    assert best is not None
    return best


def place_greedy(transfers: Sequence[float], bw: np.ndarray, nodes: Sequence[int] | None = None) -> Placement:
    """Greedy joint baseline (spec 3.2): from every start node chain to the free node with the best link
    (ties: lowest id); keep the chain with the smallest beta (ties: the earlier start)."""
    q = len(transfers) + 1
    pool = sorted(range(bw.shape[0]) if nodes is None else nodes)

    def chain(u0: int) -> list[int]:
        path = [u0]
        free = [v for v in pool if v != u0]
        for _ in range(q - 1):
            last = path[-1]
            nxt = max(free, key=lambda v: (bw[last, v], -v))
            path.append(nxt)
            free.remove(nxt)
        return path

    return _trivial(q, pool) or _smallest_beta((chain(u0) for u0 in pool), transfers, bw)


def place_optimal(transfers: Sequence[float], bw: np.ndarray, nodes: Sequence[int] | None = None) -> Placement:
    """The true optimum for a fixed partition: every injective placement (small n and q only); ties: the
    lexicographically smallest node sequence."""
    q = len(transfers) + 1
    pool = sorted(range(bw.shape[0]) if nodes is None else nodes)
    return _trivial(q, pool) or _smallest_beta(itertools.permutations(pool, q), transfers, bw)


def joint_optimum(transfers_all: Sequence[float], fits: FitsFn, m: int, bw: np.ndarray,
                  n_max: int) -> tuple[tuple[int, ...], Placement]:
    """The jointly optimal partition + placement for small instances: every feasible cut vector, each placed
    optimally. Returns (cuts, placement); placement status INFEASIBLE when no cut vector fits."""
    best: tuple[tuple[int, ...], Placement] | None = None
    for cuts in feasible_cut_vectors(m, fits, min(n_max, bw.shape[0])):
        p = place_optimal([transfers_all[c] for c in cuts], bw)
        if best is None or p.beta < best[1].beta:
            best = (cuts, p)
    return best if best is not None else ((), Placement(Status.INFEASIBLE))


def random_paper(transfers_all: Sequence[float], memories: Sequence[float], cap: float, bw: np.ndarray,
                 rng: np.random.Generator) -> Placement:
    """The reference code's random baseline ("random (paper)", spec 3.1): a random cut inside each greedy
    fill window, placed on a random sample of distinct nodes. Checks neither memory nor the node count
    (NO_MATCHING when it needs more nodes than there are)."""
    m = len(transfers_all) - 1
    part_mems = [*memories, 0.0]
    splits: list[int] = []
    i = 0
    while i < m + 1:
        j = i
        while sum(part_mems[i:max(j - 1, i)]) < cap:
            j += 1
            if j > m:
                break
        if j != m + 1:
            splits.append(j)
        i = j + 1
    # [D] Read with a leading 0, so every greedy-fill window gets one random cut: as written (windows between
    # consecutive splits only) a model needing two parts would never be cut, yet the reference CSV's random
    # column is finite for such configs (MobileNetV2 at 64 MB).
    bounds = [0, *splits]
    choices = [int(rng.integers(bounds[s - 1] + 1, bounds[s] + 1)) for s in range(1, len(bounds))]
    transfers = [transfers_all[c] for c in choices]
    q = len(transfers) + 1
    if q > bw.shape[0]:
        return Placement(Status.NO_MATCHING)
    nodes = tuple(int(v) for v in rng.choice(bw.shape[0], size=q, replace=False))
    if q == 1:
        return Placement(Status.SINGLE_PARTITION, nodes, 0.0)
    return Placement(Status.OK, nodes, bottleneck(transfers, nodes, bw))


def sample_cut_vector(m: int, fits: FitsFn, n_max: int, rng: np.random.Generator) -> tuple[int, ...] | None:
    """A feasible cut vector (at most n_max parts) drawn uniformly: count completions backwards, then sample
    forwards. None when there is none."""
    # ways[r][b]: feasible ways to cover segments b+1..m with exactly r more parts.
    ways = [[0] * (m + 1) for _ in range(n_max + 1)]
    ways[0][m] = 1
    for r in range(1, n_max + 1):
        for b in range(m - 1, -1, -1):
            ways[r][b] = sum(ways[r - 1][c] for c in range(b + 1, m + 1) if fits(b, c))
    total = sum(ways[r][0] for r in range(1, n_max + 1))
    if total == 0:
        return None
    pick = int(rng.integers(total))
    r = 1
    while pick >= ways[r][0]:
        pick -= ways[r][0]
        r += 1
    cuts: list[int] = []
    b = 0
    while r > 0:
        for c in range(b + 1, m + 1):
            w = ways[r - 1][c] if fits(b, c) else 0
            if pick < w:
                if c != m:
                    cuts.append(c)
                b, r = c, r - 1
                break
            pick -= w
    return tuple(cuts)


def random_clean(transfers_all: Sequence[float], fits: FitsFn, m: int, bw: np.ndarray,
                 rng: np.random.Generator) -> Placement:
    """The clean random baseline: a uniformly drawn feasible cut vector placed on random distinct nodes."""
    cuts = sample_cut_vector(m, fits, bw.shape[0], rng)
    if cuts is None:
        return Placement(Status.INFEASIBLE)
    transfers = [transfers_all[c] for c in cuts]
    nodes = tuple(int(v) for v in rng.choice(bw.shape[0], size=len(cuts) + 1, replace=False))
    if not cuts:
        return Placement(Status.SINGLE_PARTITION, nodes, 0.0)
    return Placement(Status.OK, nodes, bottleneck(transfers, nodes, bw))


__all__ = ["ExactKPath", "Placement", "bottleneck", "joint_optimum", "lower_bound", "place_greedy", "place_kpath",
           "place_optimal", "random_clean", "random_paper", "runs_of", "sample_cut_vector"]

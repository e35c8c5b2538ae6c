"""Step C: cut the linearised model into at most n_max parts that each fit a node, minimising the total
transferred data (spec 2.3).

Indices: points p_0..p_m, segments 1..m (``memories[k-1]`` is M_k). A partition (p_b, p_c] holds segments
b+1..c; a cut vector lists the point indices whose output is sent. ``normative`` is the exact DP over
(last cut, #parts); ``reference`` reproduces the reference code's partition DAG with its defects (memory
off-by-one, length constraint as a filter after an unconstrained min-cost path) for CSV comparisons.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

PartitionMode = Literal["normative", "reference"]
# fits(b, c): may one node hold partition (p_b, p_c]?
FitsFn = Callable[[int, int], bool]

REL_TOL = 1e-12


class Status(str, enum.Enum):
    """Outcome of a partition or placement: never a silent beta = 0."""

    OK = "ok"
    SINGLE_PARTITION = "single_partition"
    INFEASIBLE = "infeasible"
    NO_MATCHING = "no_matching"


@dataclass(frozen=True)
class Partition:
    """``cuts``: point indices c_1 < .. < c_{q-1} whose outputs cross the network; ``transfers``: T(p_c) of
    each cut; ``cost``: their sum. ``parts`` = q. ``status`` is OK, SINGLE_PARTITION (q = 1) or INFEASIBLE
    (no cut vector with at most n_max parts fits; cuts empty)."""

    status: Status
    cuts: tuple[int, ...] = ()
    transfers: tuple[float, ...] = ()
    cost: float = 0.0

    @property
    def parts(self) -> int:
        return len(self.cuts) + 1 if self.status in (Status.OK, Status.SINGLE_PARTITION) else 0

    def bounds(self, m: int) -> list[tuple[int, int]]:
        """(b, c) per part: part r holds points (p_b, p_c]."""
        edges = [0, *self.cuts, m]
        return list(zip(edges[:-1], edges[1:], strict=True))


def capacity_fits(memories: Sequence[float], cap: float, strict: bool = True) -> FitsFn:
    """fits(b, c) := sum M_{b+1..c} < cap (strict, as the reference code) or <= cap."""
    prefix = [0.0]
    for x in memories:
        prefix.append(prefix[-1] + x)

    def fits(b: int, c: int) -> bool:
        need = prefix[c] - prefix[b]
        return need < cap if strict else need <= cap

    return fits


def _better(a: tuple[float, tuple[int, ...]], b: tuple[float, tuple[int, ...]]) -> bool:
    """a before b: lower cost (ties within float noise), then the lexicographically smaller cut vector."""
    if not math.isclose(a[0], b[0], rel_tol=REL_TOL, abs_tol=1e-15):
        return a[0] < b[0]
    return a[1] < b[1]


def partition_normative(transfers: Sequence[float], fits: FitsFn, n_max: int,
                        objective: Literal["sum", "max"] = "sum") -> Partition:
    """The exact DP of spec 2.3 over (last cut c, parts r), O(n_max * m^2).

    Minimises the sum of the chosen transfers (``objective="max"``: their maximum, the min-max variant);
    ties: fewer parts, then the lexicographically smallest cut vector. ``transfers`` is T(p_0..p_m).
    """
    m = len(transfers) - 1
    inf = (math.inf, ())
    # best[c]: (cost, cuts) covering segments 1..c with r parts, for the current r.
    prev: list[tuple[float, tuple[int, ...]]] = [inf] * (m + 1)
    prev[0] = (0.0, ())
    answer: tuple[float, tuple[int, ...]] | None = None
    for _r in range(1, max(n_max, 0) + 1):
        cur: list[tuple[float, tuple[int, ...]]] = [inf] * (m + 1)
        for c in range(1, m + 1):
            best = inf
            for b in range(c):
                if prev[b][0] == math.inf or not fits(b, c):
                    continue
                if b == 0:
                    cand = prev[0]
                else:
                    step = transfers[b]
                    cost = prev[b][0] + step if objective == "sum" else max(prev[b][0], step)
                    cand = (cost, (*prev[b][1], b))
                if best[0] == math.inf or _better(cand, best):
                    best = cand
            cur[c] = best
        # Parts are tried in increasing r, so a tie in cost keeps the fewer parts.
        if cur[m][0] != math.inf and (answer is None or _better_cost(cur[m], answer)):
            answer = cur[m]
        cur[0] = inf
        prev = cur
    if answer is None:
        return Partition(Status.INFEASIBLE)
    cost, cuts = answer
    status = Status.OK if cuts else Status.SINGLE_PARTITION
    return Partition(status, cuts, tuple(transfers[c] for c in cuts), cost)


def _better_cost(a: tuple[float, tuple[int, ...]], b: tuple[float, tuple[int, ...]]) -> bool:
    return not math.isclose(a[0], b[0], rel_tol=REL_TOL, abs_tol=1e-15) and a[0] < b[0]


def partition_reference(transfers: Sequence[float], memories: Sequence[float], cap: float, n_max: int) -> Partition:
    """The reference code's partition DAG, defects included (spec 2.3, A3).

    Vertices (i, j), 0 <= i < j <= m+1, kept iff sum(part_mems[i:j-1]) < cap with part_mems = M_1..M_m, 0
    (the memory off-by-one); edges (i, j) -> (j, k) weigh T(p_{j-1}); every root (0, j) takes its
    unconstrained min-cost path to a leaf (i, m+1) (ties: the earliest next vertex); paths longer than n_max
    are dropped afterwards (the length filter); the cheapest surviving root wins (ties: the earliest root).
    A path (0,a) -> (a,b) -> .. cuts after p_{a-1}, p_{b-1}, ...
    """
    m = len(transfers) - 1
    part_mems = [*memories, 0.0]
    prefix = [0.0]
    for x in part_mems:
        prefix.append(prefix[-1] + x)

    def kept(i: int, j: int) -> bool:
        return prefix[max(j - 1, i)] - prefix[i] < cap

    @cache
    def path(i: int, j: int) -> tuple[float, tuple[int, ...]]:
        # Min cost from vertex (i, j) to a leaf, and the j of each vertex after it.
        if j == m + 1:
            return 0.0, ()
        best: tuple[float, tuple[int, ...]] = (math.inf, ())
        for k in range(j + 1, m + 2):
            if not kept(j, k):
                continue
            cost, rest = path(j, k)
            cost += transfers[j - 1]
            if cost < best[0]:
                best = (cost, (k, *rest))
        return best

    chosen: tuple[float, tuple[int, ...]] | None = None
    for j in range(1, m + 2):
        if not kept(0, j):
            continue
        cost, rest = path(0, j)
        if cost == math.inf:
            continue
        ends = (j, *rest)
        if len(ends) > n_max:
            continue
        if chosen is None or cost < chosen[0]:
            chosen = (cost, ends)
    path.cache_clear()
    if chosen is None:
        return Partition(Status.INFEASIBLE)
    cost, ends = chosen
    cuts = tuple(e - 1 for e in ends[:-1])
    status = Status.OK if cuts else Status.SINGLE_PARTITION
    return Partition(status, cuts, tuple(transfers[c] for c in cuts), cost)


def partition(transfers: Sequence[float], memories: Sequence[float], cap: float, n_max: int,
              mode: PartitionMode = "normative", strict: bool = True) -> Partition:
    """Step C in either mode; ``cap`` in the same unit as ``memories``."""
    if mode == "reference":
        return partition_reference(transfers, memories, cap, n_max)
    return partition_normative(transfers, capacity_fits(memories, cap, strict), n_max)


def feasible_cut_vectors(m: int, fits: FitsFn, n_max: int) -> list[tuple[int, ...]]:
    """Every cut vector whose parts all fit, with at most n_max parts (for brute force on small m)."""
    out: list[tuple[int, ...]] = []

    def walk(b: int, cuts: tuple[int, ...]) -> None:
        if len(cuts) + 1 > n_max:
            return
        if fits(b, m):
            out.append(cuts)
        for c in range(b + 1, m):
            if fits(b, c):
                walk(c, (*cuts, c))

    walk(0, ())
    return out


def part_memories(memories: Sequence[float], cuts: Sequence[int]) -> list[float]:
    """The true memory of every part of a cut vector (what the normative mode checks)."""
    edges = [0, *cuts, len(memories)]
    return [sum(memories[b:c]) for b, c in zip(edges[:-1], edges[1:], strict=True)]

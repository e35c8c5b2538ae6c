"""Bottleneck k-path (spec 2.5): a simple path of k distinct vertices, with optional fixed ends, maximising its
weakest edge; found by binary search over the sorted edge bandwidths with a K_PATH oracle.

Two oracles behind one interface: ``ExactKPath`` (depth-first search with pruning; exact, for tests and
small or sparse graphs) and ``ColourCodingKPath`` (seeded Alon-Yuster-Zwick colour-coding as the reference
code does it; may miss a path, which makes the binary search non-monotone).

Graphs are symmetric bandwidth matrices (numpy, NaN or <= 0 = no edge) restricted to a set of allowed
vertices. Vertex ids are ints; their order is the lexicographic tie-break order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Exact search gives up enumerating tie-break alternatives after this many node expansions and keeps the best
# path found so far (existence is still decided exactly).
MAX_TIE_EXPANSIONS = 200_000


class KPathOracle(Protocol):
    """Finds a simple path of exactly k vertices in the graph given by ``adj`` over ``vertices``."""

    def find(self, adj: np.ndarray, vertices: Sequence[int], k: int, start: int | None,
             end: int | None) -> list[int] | None: ...


def _neighbours(adj: np.ndarray, vertices: Sequence[int]) -> dict[int, list[int]]:
    vs = sorted(vertices)
    sub = adj[np.ix_(vs, vs)]
    return {v: [vs[j] for j in np.flatnonzero(sub[i]) if vs[j] != v] for i, v in enumerate(vs)}


class ExactKPath:
    """Depth-first search for a k-vertex simple path, neighbours in id order (so the first path found from
    the smallest start is the lexicographically smallest), pruned by the size of the start's component."""

    def find(self, adj: np.ndarray, vertices: Sequence[int], k: int, start: int | None,
             end: int | None) -> list[int] | None:
        for path in self.paths(adj, vertices, k, start, end, limit=1):
            return path
        return None

    def paths(self, adj: np.ndarray, vertices: Sequence[int], k: int, start: int | None, end: int | None,
              limit: int | None = None) -> list[list[int]]:
        """k-vertex simple paths in lexicographic order (at most ``limit``, and at most MAX_TIE_EXPANSIONS
        expansions when enumerating)."""
        nb = _neighbours(adj, vertices)
        if start is not None and start not in nb or end is not None and end not in nb:
            return []
        if k == 1:
            if start is not None and end is not None:
                return [[start]] if start == end else []
            v = start if start is not None else end
            return [[v]] if v is not None else [[min(nb)]] if nb else []
        found: list[list[int]] = []
        budget = [MAX_TIE_EXPANSIONS]
        comp = _components(nb)
        starts = [start] if start is not None else sorted(nb)
        path: list[int] = []
        on: set[int] = set()

        def dfs(v: int) -> bool:
            budget[0] -= 1
            path.append(v)
            on.add(v)
            try:
                if len(path) == k:
                    if end is None or v == end:
                        found.append(list(path))
                        return limit is not None and len(found) >= limit
                    return False
                if budget[0] < 0 and found:
                    return True
                for w in nb[v]:
                    if w in on:
                        continue
                    # The fixed end may only be entered at the last step.
                    if end is not None and w == end and len(path) != k - 1:
                        continue
                    if dfs(w):
                        return True
                return False
            finally:
                path.pop()
                on.discard(v)

        for s in starts:
            if end is not None and s == end:
                continue
            if comp[s][1] < k or end is not None and comp[end][0] != comp[s][0]:
                continue
            if dfs(s):
                break
        return found


def _components(nb: dict[int, list[int]]) -> dict[int, tuple[int, int]]:
    """vertex -> (component id, component size)."""
    comp: dict[int, tuple[int, int]] = {}
    cid = 0
    for v in nb:
        if v in comp:
            continue
        members = [v]
        seen = {v}
        i = 0
        while i < len(members):
            for w in nb[members[i]]:
                if w not in seen:
                    seen.add(w)
                    members.append(w)
            i += 1
        for w in members:
            comp[w] = (cid, len(members))
        cid += 1
    return comp


@dataclass
class ColourCodingKPath:
    """Randomised colour-coding as in the reference code: per trial, colour every vertex uniformly from
    1..floor(1.3 k) (vertices coloured above k are unusable), then a subset DP over colour sets; up to
    ``trials`` trials (default floor(10 e^k)). Seeded through ``rng``."""

    rng: np.random.Generator
    trials: int | None = None
    palette_factor: float = 1.3

    def find(self, adj: np.ndarray, vertices: Sequence[int], k: int, start: int | None,
             end: int | None) -> list[int] | None:
        vs = sorted(vertices)
        n = len(vs)
        if n < k or start is not None and start not in vs or end is not None and end not in vs:
            return None
        pos = {v: i for i, v in enumerate(vs)}
        a = adj[np.ix_(vs, vs)].astype(bool)
        np.fill_diagonal(a, False)
        trials = self.trials if self.trials is not None else math.floor(10 * math.e**k)
        palette = max(int(self.palette_factor * k), k)
        s_i = pos[start] if start is not None else None
        e_i = pos[end] if end is not None else None
        for _ in range(trials):
            colours = self.rng.integers(0, palette, size=n)
            path = _colourful_path(a, colours, k, s_i, e_i)
            if path is not None:
                return [vs[i] for i in path]
        return None


def _colourful_path(a: np.ndarray, colours: np.ndarray, k: int, s: int | None, e: int | None) -> list[int] | None:
    """A path whose k vertices carry the k distinct colours 0..k-1, via reach[mask] (bool per vertex) and
    parent pointers; None when there is none for this colouring."""
    n = len(colours)
    usable = colours < k
    full = (1 << k) - 1
    reach: dict[int, np.ndarray] = {}
    parent: dict[tuple[int, int], int] = {}
    for v in range(n):
        if not usable[v] or (s is not None and v != s) or (e is not None and v == e and k > 1):
            continue
        m = 1 << int(colours[v])
        reach.setdefault(m, np.zeros(n, dtype=bool))[v] = True
    if k == 1:
        for arr in reach.values():
            hits = np.flatnonzero(arr)
            if len(hits) and (e is None or e in hits):
                return [int(e if e is not None else hits[0])]
        return None
    for size in range(1, k):
        for mask in [mk for mk in reach if bin(mk).count("1") == size]:
            arr = reach[mask]
            if not arr.any():
                continue
            nxt = a[arr].any(axis=0) & usable
            if e is not None and size < k - 1:
                nxt[e] = False
            for c in range(k):
                if mask >> c & 1:
                    continue
                new = nxt & (colours == c)
                if e is not None and size == k - 1:
                    new &= np.arange(n) == e
                if not new.any():
                    continue
                nm = mask | 1 << c
                tgt = reach.setdefault(nm, np.zeros(n, dtype=bool))
                for w in np.flatnonzero(new & ~tgt):
                    # A predecessor in ``arr`` adjacent to w: kept for the walk back.
                    parent[(nm, int(w))] = int(np.flatnonzero(arr & a[:, w])[0])
                tgt |= new
    last = reach.get(full)
    if last is None or not last.any():
        return None
    v = int(e if e is not None else np.flatnonzero(last)[0])
    if not last[v]:
        return None
    path = [v]
    mask = full
    while bin(mask).count("1") > 1:
        u = parent[(mask, v)]
        mask &= ~(1 << int(colours[v]))
        path.append(u)
        v = u
    return path[::-1]


@dataclass(frozen=True)
class KPathResult:
    """``path`` (empty when none exists even on the whole graph) and its weakest bandwidth ``theta``."""

    path: tuple[int, ...]
    theta: float


def bottleneck_kpath(bw: np.ndarray, vertices: Sequence[int], k: int, start: int | None = None,
                     end: int | None = None, oracle: KPathOracle | None = None,
                     weights: Sequence[float] | None = None) -> KPathResult:
    """Maximise the minimum edge bandwidth of a k-vertex simple path over ``vertices`` (spec 2.5).

    ``bw`` is the full symmetric bandwidth matrix. Tie-breaks: (1) the largest minimum bandwidth, (2) the
    smallest realised bottleneck max_t weights[t] / B(path[t], path[t+1]) (orientation of a free run), (3) the
    lexicographically smallest vertex sequence. With the exact oracle every path at the optimal threshold is
    compared; with colour-coding the path found and its reverse (when both ends are free).
    """
    oracle = oracle or ExactKPath()
    vs = sorted(set(vertices))
    if k == 1:
        v = start if start is not None else end if end is not None else (vs[0] if vs else None)
        return KPathResult((v,) if v is not None else (), math.inf)
    sub = bw[np.ix_(vs, vs)]
    iu = np.triu_indices(len(vs), 1)
    vals = sub[iu]
    vals = np.sort(vals[np.isfinite(vals) & (vals > 0)])[::-1]
    lo, hi = 0, len(vals)
    best: list[int] | None = None
    best_theta = math.nan
    while lo < hi:
        mid = (lo + hi) // 2
        theta = float(vals[mid])
        adj = np.nan_to_num(bw, nan=0.0) >= theta
        p = oracle.find(adj, vs, k, start, end)
        if p is not None:
            hi, best, best_theta = mid, p, theta
        else:
            lo = mid + 1
    if best is None:
        return KPathResult((), 0.0)
    adj = np.nan_to_num(bw, nan=0.0) >= best_theta
    if isinstance(oracle, ExactKPath):
        options = oracle.paths(adj, vs, k, start, end)
    else:
        options = [best]
        if start is None and end is None:
            options.append(best[::-1])
    w = list(weights) if weights is not None else [1.0] * (k - 1)

    def key(p: list[int]) -> tuple[float, list[int]]:
        return max(w[t] / bw[p[t], p[t + 1]] for t in range(k - 1)), p

    chosen = min(options, key=key) if options else best
    theta = min(float(bw[chosen[t], chosen[t + 1]]) for t in range(k - 1))
    return KPathResult(tuple(chosen), theta)

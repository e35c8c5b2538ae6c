"""The MEC's importance scheduling, Algorithm 2 (spec 5.3): the central manager hands over n_c = ceil(gamma K)
candidates; each MEC gets a quota K_m of the K trainers by largest remainder, and picks them by Stat, or at random
with probability epsilon. The random generator is passed in, so the caller seeds it and tests replay it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.planning.splitfed.types import DeviceCut, SplitDevice


def quotas(candidates: Sequence[int], k: int) -> list[int]:
    """K_m = K |S_m| / |S| rounded by largest remainder (ties to the lower MEC index) so that they sum to
    min(K, |S|); ``candidates`` are the |S_m|."""
    total = sum(candidates)
    if total == 0:
        return [0 for _ in candidates]
    k = min(k, total)
    exact = [k * c / total for c in candidates]
    base = [int(e) for e in exact]
    order = sorted(range(len(candidates)), key=lambda m: (-(exact[m] - base[m]), m))
    for m in order[:k - sum(base)]:
        base[m] += 1
    return base


@dataclass(frozen=True)
class MecPick:
    """The positions (into the MEC's candidate list, ascending) of the devices it trains, and whether this call
    explored (drew at random) rather than took the top by Stat."""

    chosen: tuple[int, ...]
    explored: bool


def pick(stats: Sequence[float], k: int, epsilon: float, rng: np.random.Generator) -> MecPick:
    """Algorithm 2 on one MEC: with probability ``epsilon`` ``k`` of the candidates uniformly at random, else the
    ``k`` with the highest Stat (ties to the lower position)."""
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError("epsilon must lie in [0, 1]")
    k = min(k, len(stats))
    explored = bool(rng.random() < epsilon)
    if explored:
        chosen = rng.choice(len(stats), size=k, replace=False)
    else:
        chosen = np.array(sorted(range(len(stats)), key=lambda i: (-stats[i], i))[:k], dtype=np.int64)
    return MecPick(tuple(sorted(int(i) for i in chosen)), explored)


def fine_select(candidates: Sequence[DeviceCut], devices: Sequence[SplitDevice], k: int, epsilon: float,
                rng: np.random.Generator) -> list[DeviceCut]:
    """Spec 5.3 across MECs: split the K trainers into per-MEC quotas over the central manager's candidates and
    run Algorithm 2 on each MEC (MECs in order of first appearance), reading Stat from ``devices`` (0 for a
    device not listed). Returns the trainers in candidate order; k >= |candidates| keeps them all."""
    stat = {d.node: d.stat for d in devices}
    mecs: list[str] = []
    for c in candidates:
        if c.mec not in mecs:
            mecs.append(c.mec)
    members = [[c for c in candidates if c.mec == m] for m in mecs]
    keep: set[str] = set()
    for group, quota in zip(members, quotas([len(g) for g in members], k), strict=True):
        chosen = pick([stat.get(c.node, 0.0) for c in group], quota, epsilon, rng)
        keep.update(group[i].node for i in chosen.chosen)
    return [c for c in candidates if c.node in keep]

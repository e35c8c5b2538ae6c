"""Algorithm 1: split a micro-batch of B samples over a device group (spec 4.5, resolutions A9-A10).

Vectorised over R independent problems at once (one per candidate unit range), because the planner asks
for tens of thousands of them. Each problem has the same g devices in the same order. The caller gives:

- ``latency(y)``: y is an int array [R, g] of shares; returns forward+backward seconds [R, g], with
  latency 0 at share 0 (spec: t(0) = 0);
- ``caps``: int array [R, g], the largest share each device can hold in memory (Eq. 3);
- ``total``: B.

Phase 1 (MemoryAwareBalancing) hands out shares proportional to speed v_d = 1 / latency(B), capped by
memory, recursing on what is left over; phase 2 (StragglerWorkloadOffloading) moves blocks of samples from
the slowest device to the fastest one with room until that stops helping, undoing the move that did not
help. A problem is infeasible when a device cannot hold one sample or the group cannot hold B.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Latency = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (rows, shares[rows, g]) -> seconds[rows, g]


def block_size(total: int) -> int:
    """Samples moved per offloading step: max(1, round(B / 32)) (A10)."""
    return max(1, round(total / 32))


def allocate(latency: Latency, caps: np.ndarray, total: int, *, offload: bool = True,
             block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Shares [R, g] and a feasibility mask [R] for R allocation problems of ``total`` samples.

    ``offload=False`` stops after phase 1; ``block`` overrides the offloading block (default block_size).

    ``latency(rows, y)`` returns seconds for the problems ``rows`` (int index array) at shares ``y``
    (int array [len(rows), g]). Infeasible rows have all-zero shares.
    """
    caps = np.minimum(np.asarray(caps, dtype=np.int64), total)
    r, g = caps.shape
    rows = np.arange(r)
    feasible = (caps >= 1).all(axis=1)
    y = np.zeros((r, g), dtype=np.int64)
    speed = 1.0 / np.maximum(latency(rows, np.full((r, g), total, dtype=np.int64)), 1e-12)

    # Phase 1, iterative form of the recursion: each pass either finishes a row or caps a device.
    active = feasible[:, None] & (caps > 0)
    todo = np.flatnonzero(feasible)
    for _ in range(g + 2):
        if todo.size == 0:
            break
        left = total - y[todo].sum(axis=1)
        act = active[todo]
        v = np.where(act, speed[todo], 0.0)
        vsum = v.sum(axis=1)
        share = np.floor(v / np.where(vsum > 0, vsum, 1.0)[:, None] * left[:, None]).astype(np.int64)
        room = caps[todo] - y[todo]
        alloc = np.minimum(share, room)
        y[todo] += alloc
        uncapped = (alloc == share).all(axis=1)
        # Nobody was capped: only rounding is left; hand it out one sample at a time, fastest first.
        rem = np.where(uncapped, total - y[todo].sum(axis=1), 0)
        order = np.argsort(-v, axis=1, kind="stable")
        for q in range(g):
            dev = order[:, q]
            idx = (todo, dev)
            give = (rem > 0) & act[np.arange(todo.size), dev] & (y[idx] < caps[idx])
            y[todo[give], dev[give]] += 1
            rem -= give
        active[todo] &= y[todo] < caps[todo]
        left = total - y[todo].sum(axis=1)
        stuck = (left > 0) & ~active[todo].any(axis=1)
        feasible[todo[stuck]] = False
        todo = todo[(left > 0) & ~stuck]
    feasible[todo] = False  # unreachable: every pass finishes a row or caps a device
    y[~feasible] = 0

    # Phase 2: offload blocks from the straggler to the fastest device with room.
    blk = block or block_size(total)
    todo = np.flatnonzero(feasible & (g > 1) & offload)
    for _ in range(4 * (total // blk + g) + 8):
        if todo.size == 0:
            break
        yt = y[todo]
        lat = latency(todo, yt)
        k = np.arange(todo.size)
        slow = np.argmax(lat, axis=1)
        old = lat[k, slow]
        cand = yt + blk <= caps[todo]
        cand[k, slow] = False
        movable = cand.any(axis=1) & (yt[k, slow] >= blk)
        fast = np.argmin(np.where(cand, lat, np.inf), axis=1)
        trial = yt.copy()
        trial[k, slow] -= np.where(movable, blk, 0)  # rows that cannot move stay put (and stop below)
        trial[k, fast] += np.where(movable, blk, 0)
        # A relative tolerance keeps float noise from counting as an improvement (a tie is not faster).
        better = movable & (latency(todo, trial).max(axis=1) < old * (1 - 1e-9))
        y[todo[better]] = trial[better]
        todo = todo[better]
    return y, feasible


def memory_caps(static_bytes: np.ndarray, act_fixed: np.ndarray, act_per_sample: np.ndarray, warmup_count: int,
                budget: np.ndarray, total: int) -> np.ndarray:
    """Largest share per device such that static + K * (a0 + a1 * y) <= budget (Eq. 3), clipped to [0, total].

    Arrays broadcast: ranges [R, 1] against devices [1, g] gives caps [R, g]; -1 marks a device that cannot
    hold the stage's weights and optimizer state at all.
    """
    spare = budget - static_bytes - warmup_count * np.maximum(act_fixed, 0)
    per = warmup_count * act_per_sample
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(per > 0, np.floor(spare / np.where(per > 0, per, 1)), np.where(spare >= 0, total, -1))
    cap = np.where(spare < 0, -1, cap)
    return np.clip(cap, -1, total).astype(np.int64)

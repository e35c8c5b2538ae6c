"""Algorithm 2: Asteroid's dynamic programme over stages, unit ranges and contiguous device groups (spec 4.6).

State Q[p][i, a]: the best round latency of the units [i, L) cut into p stages on the devices a..N-1 (planning
order). A p-stage state is a new head stage (units [i, j) data-parallel on devices [a, a'), priced by Alg. 1
with the exact warm-up K = min(2p - 1, M)), a communication step, and the stored (p-1)-stage state at
(j, a'). The faithful DP keeps one plan per state (A15).

Each state is summarised by two numbers so that a new head is priced in O(1) (spec 4.3, derived form of
Eq. 11): V = max_s V_s (the dominant step's bound) and R = max_s (Ta_s - sum_{i<s} Eb_i); the latency is
V + R. Prepending a head h and a link c gives
    V' = max(M*E_h, M*E_c + E_h, V + E_h + E_c)    and    R' = max(Ta_h, R - Eb_h - Eb_c).
All candidates of one (p, a, a') are evaluated at once as an [i, j] matrix; an optional deadline is checked
before each of these group steps (edgeswarm.planning.hpp.budget counts their work in advance).
"""

from __future__ import annotations

import numpy as np

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.planning.deadline import Deadline, check
from edgeswarm.planning.hpp.assemble import Layout, assemble_plan, stage_costs
from edgeswarm.planning.hpp.costmodel import CostModel
from edgeswarm.planning.hpp.types import Plan, PlanOptions
from edgeswarm.planning.vocabulary import message_counts
from edgeswarm.values.profiles import ClusterProfile


class _Level:
    """All states with the same number of stages: arrays indexed [i, a] (start unit, first device)."""

    def __init__(self, units: int, devices: int) -> None:
        shape = (units + 1, devices + 1)
        self.lat = np.full(shape, np.inf)
        self.v = np.full(shape, np.inf)
        self.r = np.full(shape, np.inf)
        self.head_stop = np.zeros(shape, dtype=np.int64)  # the head group is devices [a, head_stop)
        self.next_unit = np.zeros(shape, dtype=np.int64)  # the head stage is units [i, next_unit)


def plan_asteroid(cluster: ClusterProfile, options: PlanOptions, *, memory_aware: bool = True,
                  max_stages: int | None = None, deadline: Deadline | None = None) -> Plan:
    """The HPP plan of least predicted round latency that uses every device (Alg. 2).

    ``memory_aware=False`` ignores the budgets, as memory-blind planners do (the plan still reports its
    memory against the real budgets). Raises InfeasiblePlanError when nothing fits, PlanningDeadlineError
    once ``deadline`` has passed.
    """
    cm = CostModel(cluster, options, memory_aware=memory_aware)
    layout = search(cm, max_stages=max_stages, deadline=deadline)
    return assemble_plan(cm, layout, "hpp")


def search(cm: CostModel, *, max_stages: int | None = None, deadline: Deadline | None = None) -> Layout:
    """The DP proper: the best layout over the cost model's devices, as (start, end, first, stop) per stage.

    ``deadline`` is checked before every device group's step (PlanningDeadlineError once it has passed)."""
    n_units, n_dev, m = cm.L, cm.N, cm.options.micro_batches
    p_max = min(n_units, n_dev, max_stages or n_dev)
    b = cm.options.micro_batch_size
    i_idx = np.arange(n_units + 1)[:, None]
    j_idx = np.arange(n_units + 1)[None, :]
    levels: list[_Level] = []
    # link_bw[a, a2][stop]: slowest link between devices [a, a2) and [a2, stop); inf where stop <= a2.
    link_bw = {(a, a2): np.array([cm.min_bandwidth(range(a, a2), range(a2, s)) if s > a2 else np.inf
                                  for s in range(n_dev + 1)])
               for a in range(n_dev) for a2 in range(a + 1, n_dev + 1)}
    has_messages = bool(cm.message.any())
    # For the per-message seconds of a step (comm_messages' count times max_message's link): link_msg[a, a2][stop]
    # is that link's seconds per message and link_peers[a, a2][stop] the peers a device exchanges rows with (0 where
    # stop <= a2); chunks[j] the further 1 MiB chunks of a micro-batch cut after unit j-1.
    cut_bytes = b * np.concatenate(([0.0], cm.cut_bytes))
    chunks = message_counts(cut_bytes) - 1.0
    pairs = [(a, a2) for a in range(n_dev) for a2 in range(a + 1, n_dev + 1)] if has_messages else []
    link_msg = {(a, a2): np.array([cm.max_message(range(a, a2), range(a2, s)) if s > a2 else 0.0
                                   for s in range(n_dev + 1)]) for a, a2 in pairs}
    link_peers = {(a, a2): np.array([max(a2 - a, s - a2) for s in range(n_dev + 1)], dtype=np.float64)
                  for a, a2 in pairs}

    # p = 1: one stage, the tail: units [i, L) on devices [a, N), K = 1.
    one = _Level(n_units, n_dev)
    starts = np.arange(n_units)
    for a in range(n_dev):
        check(deadline, f"the HPP search (1 stage, devices {a}..{n_dev - 1})")
        c = stage_costs(cm, range(a, n_dev), 1, starts, np.full(n_units, n_units))
        e = c.forward_s + c.backward_s
        one.v[:n_units, a] = m * e
        one.r[:n_units, a] = c.allreduce_s
        one.lat[:n_units, a] = m * e + c.allreduce_s
        one.head_stop[:n_units, a] = n_dev
        one.next_unit[:n_units, a] = n_units
    levels.append(one)

    for p in range(2, p_max + 1):
        k = min(2 * p - 1, m)
        sub, cur = levels[-1], _Level(n_units, n_dev)
        # Head ranges [i, j): i <= L - p, the sub-pipeline needs p - 1 units from j on.
        pairs_i, pairs_j = np.nonzero((i_idx < j_idx) & (j_idx <= n_units - p + 1))
        for a in range(n_dev - p + 1):
            for a2 in range(a + 1, n_dev - p + 2):
                check(deadline, f"the HPP search ({p} stages of {p_max}, head group {a}..{a2 - 1})")
                c = stage_costs(cm, range(a, a2), k, pairs_i, pairs_j)
                ef, eb, ta = (_matrix(n_units, pairs_i, pairs_j, x) for x in (c.forward_s, c.backward_s,
                                                                               c.allreduce_s))
                eh = ef + eb
                # The link to the sub-pipeline's head group, per j.
                stops = sub.head_stop[:, a2]
                bw = link_bw[a, a2][stops]
                ec = cut_bytes / bw  # one way, per j (cut after unit j-1)
                if has_messages:
                    ec = ec + (link_peers[a, a2][stops] + chunks) * link_msg[a, a2][stops]
                v = np.maximum(np.maximum(m * eh, m * 2 * ec[None, :] + eh), sub.v[None, :, a2] + eh + 2 * ec[None, :])
                with np.errstate(invalid="ignore"):  # inf - inf where a head or sub is infeasible: masked below
                    r = np.maximum(ta, sub.r[None, :, a2] - eb - ec[None, :])
                lat = v + r
                lat[~np.isfinite(sub.lat[None, :, a2]) | ~np.isfinite(eh)] = np.inf
                best_j = np.argmin(lat, axis=1)
                best = lat[np.arange(n_units + 1), best_j]
                take = best < cur.lat[:, a]
                rows = np.flatnonzero(take)
                cur.lat[rows, a] = best[rows]
                cur.v[rows, a] = v[rows, best_j[rows]]
                cur.r[rows, a] = r[rows, best_j[rows]]
                cur.head_stop[rows, a] = a2
                cur.next_unit[rows, a] = best_j[rows]
        levels.append(cur)

    finals = [lv.lat[0, 0] for lv in levels]
    p_best = int(np.argmin(finals))
    if not np.isfinite(finals[p_best]):
        raise InfeasiblePlanError(
            f"no plan fits the devices' memory: the model needs {cm.static_bytes(0, cm.L) / 2**20:.0f} MiB of "
            f"weights and optimizer state before activations, and every split over the {n_dev} devices overflows "
            f"some budget at micro-batch {b}; add devices, use a smaller micro-batch or a lighter optimizer")
    return _unwind(levels, p_best + 1, n_units, n_dev)


def _matrix(n_units: int, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.full((n_units + 1, n_units + 1), np.inf)
    out[rows, cols] = values
    return out


def _unwind(levels: list[_Level], stages: int, n_units: int, n_dev: int) -> Layout:
    layout: Layout = []
    i = a = 0
    for p in range(stages, 0, -1):
        lv = levels[p - 1]
        j, stop = int(lv.next_unit[i, a]), int(lv.head_stop[i, a])
        layout.append((i, j, tuple(range(a, stop))))
        i, a = j, stop
    assert i == n_units and a == n_dev, "the DP's back-pointers must cover every unit and device"
    return layout

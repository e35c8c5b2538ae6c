"""From cut points and device groups to stage costs (Alg. 1 + Eq. 8 + Eq. 5b) and to a typed Plan.

Every planner (Asteroid's DP, the baselines, the exhaustive oracle, the re-planner) prices stages here,
so they all share one cost model. A layout is a list of (start, end, devices): units [start, end) on the
devices with those planning-order indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.planning.hpp.allocation import allocate, memory_caps
from edgeswarm.planning.hpp.costmodel import CostModel, allreduce_s, comm_messages, round_latency, warmup
from edgeswarm.planning.hpp.schedule import simulate
from edgeswarm.planning.hpp.types import CommStepPlan, Plan, StagePlan, Strategy, chain_steps
from edgeswarm.planning.vocabulary import message_counts

Layout = list[tuple[int, int, tuple[int, ...]]]


@dataclass(frozen=True)
class StageCosts:
    """Alg. 1 results for R unit ranges on one group: seconds per micro-batch, shares, feasibility."""

    forward_s: np.ndarray  # [R]
    backward_s: np.ndarray  # [R]
    allreduce_s: np.ndarray  # [R]
    shares: np.ndarray  # [R, g]
    feasible: np.ndarray  # [R] bool


def stage_costs(cm: CostModel, group: Sequence[int], warmup_count: int, starts: np.ndarray,
                ends: np.ndarray) -> StageCosts:
    """Price the unit ranges [starts[r], ends[r]) as one stage on ``group`` with K = ``warmup_count``.

    Infeasible ranges (memory) get infinite times.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    devs = np.asarray(list(group), dtype=np.int64)[None, :]
    b = cm.options.micro_batch_size
    caps = memory_caps(
        (cm.static_prefix[ends] - cm.static_prefix[starts])[:, None],
        (cm.act_fixed_prefix[ends] - cm.act_fixed_prefix[starts])[:, None],
        (cm.act_sample_prefix[ends] - cm.act_sample_prefix[starts])[:, None],
        warmup_count, cm.budget[devs], b)

    def latency(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
        e = ends[rows][:, None]
        s = starts[rows][:, None]
        return cm.compute_s(devs, y, s, e)

    y, ok = allocate(latency, caps, b)
    e, s = ends[:, None], starts[:, None]
    fwd = cm.forward_s(devs, y, s, e).max(axis=1)
    bwd = cm.backward_s(devs, y, s, e).max(axis=1)
    weights = (cm.weight_prefix[ends] - cm.weight_prefix[starts]).astype(np.float64)
    g = len(group)
    ta = 0.0 if g == 1 else 2.0 * (g - 1) * weights / (g * cm.group_bandwidth(group))
    message = cm.group_message(group)
    if g > 1 and message > 0:
        # One chunk message per ring step (allreduce_s's count); nothing is reduced for a stage without weights.
        ta = ta + np.where(weights > 0, 2.0 * (g - 1) * message_counts(weights / g) * message, 0.0)
    ta = np.broadcast_to(np.asarray(ta, dtype=np.float64), fwd.shape)
    inf = np.where(ok, 0.0, np.inf)
    return StageCosts(fwd + inf, bwd + inf, ta + inf, y, ok)


def assemble_plan(cm: CostModel, layout: Layout, strategy: Strategy, *, model_fingerprint: str = "") -> Plan:
    """The typed Plan for a layout, priced by the cost model. Raises InfeasiblePlanError naming the stage
    and device that does not fit in memory."""
    p_total = len(layout)
    m = cm.options.micro_batches
    stages: list[StagePlan] = []
    for p, (start, end, group) in enumerate(layout):
        k = warmup(p_total, p, m)
        c = stage_costs(cm, group, k, np.array([start]), np.array([end]))
        if not c.feasible[0]:
            raise InfeasiblePlanError(_memory_report(cm, start, end, group, k))
        shares = [int(v) for v in c.shares[0]]
        stages.append(StagePlan(
            index=p, start=start, end=end,
            devices=[cm.devices[d].node for d in group],
            shares=shares,
            warmup=k,
            forward_s=float(c.forward_s[0]),
            backward_s=float(c.backward_s[0]),
            allreduce_s=stage_allreduce_s(cm, start, end, group),
            memory_bytes=[cm.memory_bytes(start, end, y, k) for y in shares],
            memory_budget_bytes=[cm.devices[d].memory_budget_bytes for d in group],
        ))
    comms = [comm_step(cm, p, layout[p][1], layout[p][2], layout[p + 1][2]) for p in range(p_total - 1)]
    overhead = cm.round_overhead_s([d for _, _, group in layout for d in group])
    latency, dm = scheduled_round(stages, comms, m, overhead)
    if not math.isfinite(latency) or latency <= 0:
        raise InfeasiblePlanError(f"the {strategy} layout has no finite positive round latency ({latency})")
    return Plan(strategy=strategy, model_fingerprint=model_fingerprint or cm.model.fingerprint, units=cm.L,
                options=cm.options, stages=stages, comm_steps=comms, dominant_step=dm,
                round_latency_s=latency, round_overhead_s=overhead,
                throughput_sps=cm.options.global_batch / latency)


def scheduled_round(stages: Sequence[StagePlan], comms: Sequence[CommStepPlan], micro_batches: int,
                    overhead_s: float) -> tuple[float, int]:
    """A plan's round in seconds and its dominant step: the event simulation of its 1F1B schedule with each stage's
    warm-up (Appendix A) plus ``overhead_s``, the round's fixed cost. Asteroid's search ranks layouts by Eqs. 4-6,
    which are quick over arrays, but a plan states the simulated round: on four stages the formula gave 23% less
    than the simulation, and the measured round came within 1% of the simulation (docs/benchmarks.md). (The light
    re-plan's hill-climb compares assembled plans, so it ranks by this; budget.SIMULATION_CELLS counts its cost.)
    The dominant step is the formula's (Eq. 6)."""
    ef, eb, ta = chain_steps(stages, comms)
    _, dominant = round_latency(ef, eb, micro_batches, ta)
    timeline = simulate(ef, eb, micro_batches, [s.warmup for s in stages], ta)
    return timeline.makespan_s + overhead_s, dominant


def stage_allreduce_s(cm: CostModel, start: int, end: int, group: Sequence[int]) -> float:
    """Seconds of the AllReduce of units [start, end)'s gradients over ``group`` (planning-order indices)."""
    return allreduce_s(cm.weight_bytes(start, end), len(group), cm.group_bandwidth(group), cm.group_message(group))


def comm_step(cm: CostModel, after: int, end: int, group: Sequence[int], then: Sequence[int]) -> CommStepPlan:
    """The link step after stage ``after`` (ending at unit ``end``, on ``group``) to the next one (on ``then``): one
    micro-batch's cut tensor over the slowest link between the groups, in the messages it is sent as."""
    bw = cm.min_bandwidth(group, then)
    nbytes = int(cm.options.micro_batch_size * cm.cut_bytes[end - 1])
    count = comm_messages(nbytes, len(group), len(then))
    one_way = nbytes / bw + count * cm.max_message(group, then)
    return CommStepPlan(after=after, bytes_per_microbatch=nbytes, bandwidth_bps=bw, messages=count,
                        forward_s=one_way, backward_s=one_way)


def _memory_report(cm: CostModel, start: int, end: int, group: Sequence[int], k: int) -> str:
    """Why a stage does not fit: its static bytes and one sample's activations against each budget."""
    need = cm.memory_bytes(start, end, 1, k)
    total = cm.memory_bytes(start, end, cm.options.micro_batch_size, k)
    budgets = ", ".join(f"{cm.devices[d].node} {cm.devices[d].memory_budget_bytes / 2**20:.0f} MiB" for d in group)
    return (f"units [{start}, {end}) with K={k} need {need / 2**20:.0f} MiB for one sample and "
            f"{total / 2**20:.0f} MiB for the whole micro-batch of {cm.options.micro_batch_size}, "
            f"but the group's budgets are {budgets}: use more devices, a smaller micro-batch or a lighter optimizer")

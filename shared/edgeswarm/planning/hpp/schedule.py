"""1F1B with K_p warm-up (spec 3.2), the analytic round latency (Eqs. 4-6) and an event simulator (Appendix A).

A pipeline of P stages is a chain of S = 2P - 1 steps: exec 0, comm 0->1, exec 1, ..., exec P-1. Step s has a
per-micro-batch forward time ``forward_s[s]`` and backward time ``backward_s[s]`` (compute for an exec step, transfer
for a comm step) and an AllReduce time ``allreduce_s[s]`` (exec steps only). All times are in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from edgeswarm.errors import ScheduleError
from edgeswarm.planning.hpp.costmodel import warmup
from edgeswarm.planning.hpp.types import Plan

Pass = Literal["F", "B"]
OpKind = Literal["F", "B", "AR"]

# Appendix A breaks exact ties on (step, B before F, micro-batch). Sums such as 0.3 + 0.3 + 0.3 drift by a few ulps,
# and letting that noise decide a "tie" would make the schedule depend on summation order, so start times this close
# (relative) count as equal.
_TIE_RTOL = 1e-9


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation on one step's server: a forward or backward of ``micro_batch``, or the step's AllReduce
    (``kind == "AR"``, ``micro_batch`` None). Times in seconds from the start of the round."""

    step: int
    kind: OpKind
    micro_batch: int | None
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """One simulated round.

    ``operations`` is in the order the simulator committed them (chronological per step). ``warmups[p]`` is stage p's
    effective K (capped at M) and ``peak_live[p]`` the most micro-batches whose activations stage p (exec step 2p)
    held at once: forwards done minus backwards done, maximised over time. ``makespan_s`` is the round's end: the
    latest of every backward finish and every AllReduce finish.
    """

    operations: tuple[Operation, ...]
    makespan_s: float
    warmups: tuple[int, ...]
    peak_live: tuple[int, ...]
    micro_batches: int
    steps: int

    @property
    def stages(self) -> int:
        return (self.steps + 1) // 2


def warmup_counts(stages: int, micro_batches: int) -> list[int]:
    """K_p^eff = min(2(P - p) - 1, M) for p = 0..P-1 (spec 3.2, ambiguity A4).

    Raises ScheduleError when ``stages`` or ``micro_batches`` is below 1.
    """
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"need at least one stage and one micro-batch, got P={stages}, M={micro_batches}")
    return [warmup(stages, p, micro_batches) for p in range(stages)]


def stage_order(warmup: int, micro_batches: int) -> list[tuple[Pass, int]]:
    """The strict per-stage order of spec 3.2 with K = min(warmup, M).

    K forwards F0..F(K-1), then the pairs (B_i, F_(K+i)) for i = 0..M-K-1, then the drain B_(M-K)..B_(M-1).
    Raises ScheduleError when ``warmup`` or ``micro_batches`` is below 1.
    """
    if warmup < 1 or micro_batches < 1:
        raise ScheduleError(f"warm-up and micro-batch count must be at least 1, got K={warmup}, M={micro_batches}")
    k = min(warmup, micro_batches)
    order: list[tuple[Pass, int]] = [("F", i) for i in range(k)]
    for i in range(micro_batches - k):
        order.append(("B", i))
        order.append(("F", k + i))
    order.extend(("B", i) for i in range(micro_batches - k, micro_batches))
    return order


def step_lower_bounds(forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int) -> list[float]:
    """V_s = M*(Ef_s + Eb_s) + sum(E_0..E_(s-1)) in seconds for every step (spec 4.3, derived properties).

    Each V_s is a lower bound on the makespan; the dominant step is argmax_s V_s. Raises ScheduleError on malformed
    step vectors.
    """
    ef, eb, _ = _check_steps(forward_s, backward_s, micro_batches, None)
    e = [f + b for f, b in zip(ef, eb, strict=True)]
    prefix_e = _prefix(e)
    return [micro_batches * e[s] + prefix_e[s] for s in range(len(e))]


def analytic_latency(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    allreduce_s: Sequence[float] | None = None,
) -> tuple[float, int]:
    """Eqs. 4-6: the HPP-Round latency in seconds and the dominant step dm = argmax_s V_s (first on ties).

    V_s = M*E_s + sum(E_0..E_(s-1)) with E_s = Ef_s + Eb_s; latency = max_s (Tw_s + Te_s + Ta_s) where Tw and Te
    follow Eqs. 5a and 6 anchored on dm. Raises ScheduleError on malformed step vectors.
    """
    ef, eb, ta = _check_steps(forward_s, backward_s, micro_batches, allreduce_s)
    m = micro_batches
    e = [f + b for f, b in zip(ef, eb, strict=True)]
    prefix_e = _prefix(e)
    prefix_f = _prefix(ef)
    v = step_lower_bounds(ef, eb, m)
    dm = max(range(len(v)), key=lambda s: (v[s], -s))
    anchor = m * e[dm]
    latency = -math.inf
    for s in range(len(e)):
        if s < dm:
            te = anchor + (prefix_e[dm] - prefix_e[s])
        else:
            te = anchor - (prefix_e[s] - prefix_e[dm])
        latency = max(latency, prefix_f[s] + te + ta[s])
    return latency, dm


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    warmups: Sequence[int] | None = None,
    allreduce_s: Sequence[float] | None = None,
) -> Timeline:
    """Event-simulate one round exactly as spec Appendix A describes.

    Exec step 2p runs stage p's strict ``stage_order(warmups[p], M)`` (default ``warmup_counts``); each comm step
    is one FIFO server carrying both directions. F_i at step s is ready when step s-1 finished F_i (step 0: t=0);
    B_i at step s is ready when step s+1 finished B_i (the last step: when its own F_i finished). The simulator
    repeatedly starts the operation with the earliest possible start max(ready, server free), breaking ties on
    (step, B before F, micro-batch). An exec step with Ta > 0 runs its AllReduce right after its last backward.

    Raises ScheduleError on malformed inputs and when the warm-ups deadlock (an upstream stage with a smaller K
    than a downstream one can wait forever for a gradient the downstream stage will not send yet).
    """
    ef, eb, ta = _check_steps(forward_s, backward_s, micro_batches, allreduce_s)
    steps = len(ef)
    stages = (steps + 1) // 2
    m = micro_batches
    if warmups is None:
        ks = warmup_counts(stages, m)
    else:
        if len(warmups) != stages:
            raise ScheduleError(f"need one warm-up per stage ({stages}), got {len(warmups)}")
        if any(k < 1 for k in warmups):
            raise ScheduleError(f"every warm-up must be at least 1, got {list(warmups)}")
        ks = [min(int(k), m) for k in warmups]
    orders = [stage_order(k, m) for k in ks]

    fwd_end: list[list[float | None]] = [[None] * m for _ in range(steps)]
    bwd_end: list[list[float | None]] = [[None] * m for _ in range(steps)]
    free = [0.0] * steps
    position = [0] * stages
    # Comm steps: operations whose input has arrived, waiting for the link. F_i at step 0 is ready at t=0 but step
    # 0 is an exec step, so only comm queues need seeding as operations complete.
    queued: list[list[tuple[Pass, int]]] = [[] for _ in range(steps)]

    def ready_at(step: int, kind: Pass, i: int) -> float | None:
        if kind == "F":
            return 0.0 if step == 0 else fwd_end[step - 1][i]
        return fwd_end[step][i] if step == steps - 1 else bwd_end[step + 1][i]

    operations: list[Operation] = []
    total = 2 * m * steps
    while len(operations) < total:
        candidates: list[tuple[float, int, int, int]] = []
        for s in range(steps):
            if s % 2 == 0:
                p = s // 2
                if position[p] == len(orders[p]):
                    continue
                pending = [orders[p][position[p]]]
            else:
                pending = queued[s]
            for kind, i in pending:
                ready = ready_at(s, kind, i)
                if ready is not None:
                    candidates.append((max(ready, free[s]), s, 0 if kind == "B" else 1, i))
        if not candidates:
            raise ScheduleError(f"the warm-ups {ks} deadlock: no operation can start ({len(operations)}/{total} done)")
        earliest = min(c[0] for c in candidates)
        cutoff = earliest + _TIE_RTOL * max(1.0, abs(earliest))
        start, s, rank, i = min((c for c in candidates if c[0] <= cutoff), key=lambda c: (c[1], c[2], c[3]))
        kind: Pass = "B" if rank == 0 else "F"
        end = start + (eb[s] if kind == "B" else ef[s])
        operations.append(Operation(s, kind, i, start, end))
        free[s] = end
        if s % 2 == 0:
            position[s // 2] += 1
        else:
            queued[s].remove((kind, i))
        if kind == "F":
            fwd_end[s][i] = end
            if s + 1 < steps and (s + 1) % 2 == 1:
                queued[s + 1].append(("F", i))
        else:
            bwd_end[s][i] = end
            if s > 0 and (s - 1) % 2 == 1:
                queued[s - 1].append(("B", i))

    makespan = max(op.end_s for op in operations)
    for s in range(0, steps, 2):
        if ta[s] > 0:
            last_backward = max(end for end in bwd_end[s] if end is not None)
            operations.append(Operation(s, "AR", None, last_backward, last_backward + ta[s]))
            makespan = max(makespan, last_backward + ta[s])

    peak = [_peak_live(operations, 2 * p) for p in range(stages)]
    return Timeline(tuple(operations), makespan, tuple(ks), tuple(peak), m, steps)


def plan_timeline(plan: Plan) -> Timeline:
    """Simulate one round of ``plan``: its step times, its stages' warm-ups and its M (times in seconds)."""
    ef, eb, ta = plan.step_times()
    return simulate(ef, eb, plan.options.micro_batches, [stage.warmup for stage in plan.stages], ta)


def _peak_live(operations: Sequence[Operation], step: int) -> int:
    # Operations of one step never overlap and were committed chronologically, so a running count suffices.
    live = peak = 0
    for op in operations:
        if op.step != step:
            continue
        if op.kind == "F":
            live += 1
            peak = max(peak, live)
        elif op.kind == "B":
            live -= 1
    return peak


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _check_steps(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    allreduce_s: Sequence[float] | None,
) -> tuple[list[float], list[float], list[float]]:
    ef = [float(x) for x in forward_s]
    eb = [float(x) for x in backward_s]
    steps = len(ef)
    ta = [0.0] * steps if allreduce_s is None else [float(x) for x in allreduce_s]
    if steps == 0 or steps % 2 == 0:
        raise ScheduleError(f"a pipeline has an odd number of steps (2P - 1), got {steps}")
    if len(eb) != steps or len(ta) != steps:
        raise ScheduleError(f"forward, backward and AllReduce need {steps} steps each, got {len(eb)} and {len(ta)}")
    if micro_batches < 1:
        raise ScheduleError(f"need at least one micro-batch, got {micro_batches}")
    for name, values in (("forward", ef), ("backward", eb), ("AllReduce", ta)):
        if any(not math.isfinite(x) or x < 0 for x in values):
            raise ScheduleError(f"{name} times must be finite and non-negative seconds, got {values}")
    if any(ta[s] != 0 for s in range(1, steps, 2)):
        raise ScheduleError(f"communication steps have no AllReduce, got {ta}")
    return ef, eb, ta

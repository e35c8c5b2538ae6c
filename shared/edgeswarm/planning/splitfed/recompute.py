"""The device's Memory Reducer decisions, Algorithm 3 (spec 6.3): which recomputation strategy each segment of
cheap units gets, under the adaptive or always policy, and what it costs in extra forward passes.

A checkpoint is the output of an expensive unit (conv, linear, attention), always kept; a segment s_1..s_k is a
maximal run of cheap units after one, whose outputs may be freed after the forward pass. Speed-centric recomputes
the segment once (k-1 unit forwards) and holds sum l^f + l^b_{s_k} bytes; memory-centric recomputes s_1..s_{t-1}
for each backward step t (k(k-1)/2 forwards) and holds at most l_peak. Units: bytes, FLOPs, seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.planning.splitfed.types import ModelCost, UnitCost

Strategy = Literal["speed", "memory"]
ThetaMode = Literal["peak", "budget"]
RecomputePolicy = Literal["adaptive", "always"]
Outcome = Literal["none", "recompute", "infeasible"]


class Segment(BaseModel):
    """One recomputation segment: its units' positions in the model (0-based), forward bytes l^f backward
    needs, backward peaks l^b, and forward FLOPs (what recomputing one unit costs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    units: list[int] = Field(min_length=1)
    fwd_bytes: list[int]
    bwd_bytes: list[int]
    fwd_flops: list[float]

    def speed_cost(self) -> int:
        """Eq. 12: sum_t l^f_{s_t} + l^b_{s_k} bytes held by speed-centric recomputation."""
        return sum(self.fwd_bytes) + self.bwd_bytes[-1]


class RecomputePlan(BaseModel):
    """The reducer's decision: ``none`` (everything fits without recomputing), ``recompute`` with a strategy per
    segment, or ``infeasible`` (the allowance is below l_peak: the ODM asks the MEC to re-split, spec 5.5).
    ``extra_forwards`` counts unit forwards per iteration, ``extra_flops`` their FLOPs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outcome: Outcome
    strategies: list[Strategy] = Field(default_factory=list)
    theta_bytes: float = 0.0
    l_peak_bytes: int = 0
    extra_forwards: int = 0
    extra_flops: float = 0.0


def extra_forwards(k: int, strategy: Strategy) -> int:
    """Unit forwards one iteration adds for a segment of ``k`` units: k-1 speed-centric, k(k-1)/2 memory-centric."""
    return k - 1 if strategy == "speed" else k * (k - 1) // 2


def extra_flops(segment: Segment, strategy: Strategy) -> float:
    """The FLOPs of those forwards: speed-centric s_1..s_{k-1} once; memory-centric s_1..s_{t-1} for each t."""
    f = segment.fwd_flops
    k = len(f)
    if strategy == "speed":
        return float(sum(f[:k - 1]))
    return float(sum(f[u] * (k - 1 - u) for u in range(k - 1)))


def segments(units: Sequence[UnitCost], positions: Sequence[int] | None = None) -> list[Segment]:
    """The maximal runs of cheap units after a checkpoint (an expensive unit's output), in execution order.
    ``positions`` (default 0..len-1) label the units; a run never spans a gap in them (the front and tail of a
    cut are not adjacent). The batch a run at the model's start reads and the activation the tail receives from
    the MEC are kept anyway (the data, the receive buffer), so they serve as checkpoints too."""
    pos = list(range(len(units))) if positions is None else list(positions)
    out: list[Segment] = []
    run: list[int] = []

    def close() -> None:
        if run:
            out.append(Segment(units=[pos[i] for i in run], fwd_bytes=[units[i].act_bytes for i in run],
                               bwd_bytes=[units[i].backward_bytes for i in run],
                               fwd_flops=[units[i].flops_fwd for i in run]))
            run.clear()

    for i, unit in enumerate(units):
        if unit.expensive or (i and pos[i] != pos[i - 1] + 1):
            close()
        if not unit.expensive:
            run.append(i)
    close()
    return out


def device_segments(model: ModelCost, cut: int, tail: int) -> list[Segment]:
    """The segments of the device side of cut ``cut``: front units 1..cut, then the tail."""
    v = len(model.units)
    positions = list(range(cut)) + list(range(v - tail, v))
    return segments([model.units[p] for p in positions], positions)


def decide(segs: Sequence[Segment], theta: float) -> list[Strategy]:
    """Algorithm 3: speed-centric where its Eq. 12 footprint is within ``theta`` bytes, else memory-centric."""
    return ["speed" if s.speed_cost() <= theta else "memory" for s in segs]


def plan_recompute(segs: Sequence[Segment], allowance_bytes: float, theta_mode: ThetaMode = "peak",
                   policy: RecomputePolicy = "adaptive", l_peak_bytes: int | None = None) -> RecomputePlan:
    """Spec 6.3's policy for a transient allowance A = B_rt - M_persist bytes. ``adaptive``: no recomputation
    if every segment's activations plus l_peak fit A; else (and always under ``always``) Algorithm 3 with
    theta = l_peak (``peak``) or A (``budget``) if A >= l_peak; else infeasible. ``l_peak_bytes`` defaults to the
    largest l^b of the segments."""
    l_peak = l_peak_bytes if l_peak_bytes is not None else max((max(s.bwd_bytes) for s in segs), default=0)
    keep_all = sum(sum(s.fwd_bytes) for s in segs) + l_peak
    if policy == "adaptive" and keep_all <= allowance_bytes:
        return RecomputePlan(outcome="none", l_peak_bytes=l_peak)
    if allowance_bytes < l_peak:
        return RecomputePlan(outcome="infeasible", l_peak_bytes=l_peak)
    theta = float(l_peak) if theta_mode == "peak" else float(allowance_bytes)
    chosen = decide(segs, theta)
    return RecomputePlan(
        outcome="recompute", strategies=chosen, theta_bytes=theta, l_peak_bytes=l_peak,
        extra_forwards=sum(extra_forwards(len(s.units), r) for s, r in zip(segs, chosen, strict=True)),
        extra_flops=sum(extra_flops(s, r) for s, r in zip(segs, chosen, strict=True)),
    )

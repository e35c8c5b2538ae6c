"""HPP's closed loop: refit each device's compute speed from measured rounds, and re-plan when it pays.

A profile is measured once, alone; the devices then compute beside the bus's threads, other jobs, thermal limits
or a neighbour's load, so a device may run at a different speed than profiled. Each round the coordinator knows
what every device of the plan took for one micro-batch's forward and backward (its RoundDone) and what the
profile predicted for that device's share of its stage: their ratio is the device's ``scale``. ``ComputeFit``
keeps each device's ratios of the last rounds and fits its scale as their median (one outlier round cannot swing
it), clipped to [1/64, 64]. ``scaled`` is the cluster profile with every device's times multiplied by its scale:
the refitted profile. ``Rebalancer`` decides when to re-plan on it: only when the best plan on the refitted
profile is predicted faster than the running plan re-priced on it (``reprice``) by more than ``margin``, on
``confirm`` checks in a row, at least ``min_rounds`` rounds into a plan and at most ``max_per_hour`` times an
hour. A cluster that is uniformly slower than profiled (every scale alike) re-plans to the same layout: nothing
to gain, so nothing happens.

Pure functions and small state over typed data; the fitted scales come from measurement only (nothing here reads
the emulation's settings).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from edgeswarm.planning.hpp.costmodel import CostModel, round_latency
from edgeswarm.planning.hpp.types import Plan, chain_steps
from edgeswarm.values.profiles import MAX_SCALE, MIN_SCALE, ClusterProfile

SLIVER = 0.25  # a device's share of the compute below which its measured time says nothing of its speed


def predicted_compute_s(plan: Plan, cluster: ClusterProfile) -> dict[str, float]:
    """Each device of ``plan``: the forward plus backward seconds of its share of one micro-batch on its stage, as
    ``cluster`` prices it."""
    cm = CostModel(cluster, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    out: dict[str, float] = {}
    for stage in plan.stages:
        for node, share in zip(stage.devices, stage.shares, strict=True):
            i = index[node]
            out[node] = float(cm.both[i, share, stage.end] - cm.both[i, share, stage.start])
    return out


def scaled(cluster: ClusterProfile, scales: dict[str, float]) -> ClusterProfile:
    """``cluster`` with each device's forward and backward times multiplied by its scale (1 where none)."""
    entries = []
    for entry in cluster.devices:
        f = scales.get(entry.device.node, 1.0)
        if f == 1.0:
            entries.append(entry)
            continue
        c = entry.compute
        entries.append(entry.model_copy(update={"compute": c.model_copy(update={
            "forward_s": [[t * f for t in row] for row in c.forward_s],
            "backward_s": [[t * f for t in row] for row in c.backward_s]})}))
    return cluster.model_copy(update={"devices": entries})


def reprice(plan: Plan, cluster: ClusterProfile) -> Plan:
    """``plan`` as it stands (each stage's units, devices and shares of a micro-batch, its transfers and AllReduces)
    with its compute priced on ``cluster``: what the running plan takes if its devices compute as ``cluster`` says."""
    cm = CostModel(cluster, plan.options)
    index = {d.node: i for i, d in enumerate(cm.devices)}
    stages = []
    for s in plan.stages:
        held = [(index[node], share) for node, share in zip(s.devices, s.shares, strict=True)]
        stages.append(s.model_copy(update={
            "forward_s": max(float(cm.fwd[i, y, s.end] - cm.fwd[i, y, s.start]) for i, y in held),
            "backward_s": max(float(cm.bwd[i, y, s.end] - cm.bwd[i, y, s.start]) for i, y in held)}))
    ef, eb, ta = chain_steps(stages, plan.comm_steps)
    latency, dominant = round_latency(ef, eb, plan.options.micro_batches, ta)
    latency += plan.round_overhead_s
    return plan.model_copy(update={"stages": stages, "round_latency_s": latency, "dominant_step": dominant,
                                   "throughput_sps": plan.options.global_batch / latency})


@dataclass
class ComputeFit:
    """Each device's measured over predicted compute, its last ``window`` rounds: ``add`` one round, ``scales``
    the fit (the median, clipped to [MIN_SCALE, MAX_SCALE])."""

    window: int = 5
    ratios: dict[str, deque[float]] = field(default_factory=dict)

    def add(self, predicted: dict[str, float], measured: dict[str, float]) -> None:
        """One round: ``measured`` seconds of one micro-batch's forward and backward per device, beside the
        ``predicted`` ones. A device with no prediction or no positive figure is skipped, and so is one predicted
        less than SLIVER of the busiest device's compute: what it measures is mostly the runtime's per-call costs
        around its few units (a unit profiled at 0 s still takes milliseconds), not its speed; its scale stays
        what earlier rounds fitted."""
        floor = SLIVER * max(predicted.values(), default=0.0)
        for node, seconds in measured.items():
            expected = predicted.get(node, 0.0)
            if expected > 0 and expected >= floor and seconds > 0 and math.isfinite(seconds):
                self.ratios.setdefault(node, deque(maxlen=self.window)).append(seconds / expected)

    def scales(self) -> dict[str, float]:
        """Each device's fitted scale: measured compute over profiled."""
        return {node: min(MAX_SCALE, max(MIN_SCALE, median(r))) for node, r in self.ratios.items() if r}

    def rounds(self) -> dict[str, int]:
        """How many measured rounds each device's scale is fitted from (at most ``window``)."""
        return {node: len(r) for node, r in self.ratios.items()}

    def moved(self, tolerance: float = 0.15) -> dict[str, float]:
        """The scales that moved from 1 by more than ``tolerance`` (a fraction either way)."""
        return {n: s for n, s in self.scales().items() if abs(math.log(s)) > math.log1p(tolerance)}


@dataclass
class Rebalancer:
    """When to re-plan on a refitted profile (see the module's docstring): ``check`` once a round, with the running
    plan's and the best plan's predicted round on it (seconds) and the time now (seconds, monotonic)."""

    margin: float = 0.15
    confirm: int = 3
    min_rounds: int = 3
    max_per_hour: int = 4
    _rounds: int = field(default=0, init=False)  # rounds run on the running plan
    _streak: int = field(default=0, init=False)  # checks in a row that saw the gain
    _done: deque[float] = field(default_factory=lambda: deque(maxlen=64), init=False)  # when it re-planned

    def round_done(self) -> None:
        """One more round ran on the running plan."""
        self._rounds += 1

    def new_plan(self) -> None:
        """The job runs on another plan from now on (re-planned, recovered, grown): its rounds count afresh."""
        self._rounds = self._streak = 0

    def check(self, current_s: float, best_s: float, now: float) -> bool:
        """Whether to re-plan now (counted against the hourly cap when True)."""
        gain = 1.0 - best_s / current_s if current_s > 0 else 0.0
        self._streak = self._streak + 1 if gain > self.margin else 0
        recent = sum(1 for t in self._done if now - t < 3600.0)
        if self._rounds < self.min_rounds or self._streak < self.confirm or recent >= self.max_per_hour:
            return False
        self._done.append(now)
        return True

"""The baselines Asteroid is compared with, priced by the same cost model (spec 7.2):

- ``single``: the whole model on the one device that trains fastest (gradient accumulation over M
  micro-batches);
- ``dp``: data parallelism over every device, with Alg. 1's heterogeneity-aware split and ring AllReduce;
- ``pp``: a straight pipeline, one device per stage in planning order, cut GPipe-style to balance compute
  (ignoring the size of the tensors at the cuts), run with Asteroid's 1F1B schedule. Where the balanced cut
  overflows a device's memory, the best-balanced cut that fits is taken.
"""

from __future__ import annotations

import numpy as np

from edgeswarm.errors import InfeasiblePlanError
from edgeswarm.planning.deadline import Deadline, check
from edgeswarm.planning.hpp.assemble import assemble_plan
from edgeswarm.planning.hpp.costmodel import CostModel, warmup
from edgeswarm.planning.hpp.types import Plan, PlanOptions
from edgeswarm.values.profiles import ClusterProfile


def plan_single(cluster: ClusterProfile, options: PlanOptions, *, deadline: Deadline | None = None) -> Plan:
    """The fastest single device for the same global batch, at its fastest micro-batch: B' divides B (and
    M' = M * B / B'), since one device may accumulate smaller micro-batches; memory must hold B'. Raises
    InfeasiblePlanError if no device holds even one sample."""
    cm = CostModel(cluster, options)
    b, m = options.micro_batch_size, options.micro_batches
    best: tuple[float, int, int] | None = None  # (round seconds, device, micro-batch)
    for d in range(cm.N):
        check(deadline, "the single-device baseline")
        for size in (s for s in range(1, b + 1) if b % s == 0 and cm.memory_bytes(0, cm.L, s, 1) <= cm.budget[d]):
            t = float(cm.compute_s(d, size, 0, cm.L)) * m * (b // size)
            if best is None or t < best[0]:
                best = (t, d, size)
    if best is None:
        raise InfeasiblePlanError(
            f"no single device holds the model: one sample needs {cm.memory_bytes(0, cm.L, 1, 1) / 2**20:.0f} MiB, "
            f"the largest budget is {cm.budget.max() / 2**20:.0f} MiB")
    _, device, size = best
    if size != b:
        node = cm.devices[device].node
        options = options.model_copy(update={"micro_batch_size": size, "micro_batches": m * (b // size)})
        cm = CostModel(cluster, options)  # re-sorted for the new B: find the device again by name
        device = next(i for i, slot in enumerate(cm.devices) if slot.node == node)
    return assemble_plan(cm, [(0, cm.L, (device,))], "single")


def plan_dp(cluster: ClusterProfile, options: PlanOptions, *, deadline: Deadline | None = None) -> Plan:
    """Pure data parallelism over every device: one stage, Alg. 1 shares, ring AllReduce."""
    check(deadline, "the data-parallel baseline")
    cm = CostModel(cluster, options)
    return assemble_plan(cm, [(0, cm.L, tuple(range(cm.N)))], "dp")


def plan_pp(cluster: ClusterProfile, options: PlanOptions, *, deadline: Deadline | None = None) -> Plan:
    """A straight pipeline over min(L, N) devices, compute-balanced GPipe-style, memory permitting."""
    cm = CostModel(cluster, options)
    stages = min(cm.L, cm.N)
    b, m = options.micro_batch_size, options.micro_batches
    n = cm.L
    # cost[p][i, j]: compute seconds of units [i, j) on device p at B, inf when it does not fit.
    i_idx = np.arange(n + 1)[:, None]
    j_idx = np.arange(n + 1)[None, :]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back: list[np.ndarray] = []
    for p in range(stages):
        check(deadline, f"the pipeline baseline (stage {p} of {stages})")
        k = warmup(stages, p, m)
        t = cm.compute_s(p, b, i_idx, j_idx)
        act = np.maximum(cm.act_fixed_prefix[j_idx] - cm.act_fixed_prefix[i_idx], 0) + b * (
            cm.act_sample_prefix[j_idx] - cm.act_sample_prefix[i_idx])
        mem = cm.static_prefix[j_idx] - cm.static_prefix[i_idx] + k * act
        cost = np.where((i_idx < j_idx) & (mem <= cm.budget[p]), t, np.inf)
        cand = np.maximum(best[:, None], cost)  # [i, j]
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n + 1)]
        back.append(arg)
    if not np.isfinite(best[n]):
        raise InfeasiblePlanError(f"no straight {stages}-stage pipeline fits the devices' memory at micro-batch {b}")
    cuts = [n]
    for p in range(stages - 1, -1, -1):
        cuts.append(int(back[p][cuts[-1]]))
    cuts.reverse()
    return assemble_plan(cm, [(cuts[p], cuts[p + 1], (p,)) for p in range(stages)], "pp")

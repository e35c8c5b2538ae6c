"""``plan_serving``: the serve-pipeline planner for a real, profiled cluster (spec 2.7 and beyond).

The objective restores the paper's Eq. (1): beta = max over stages of the stage's forward time on its device
at the micro-batch size, and over links of bytes / bandwidth + latency + the link's seconds per message for each
message the micro-batch is sent as (edgeswarm.planning.serve.costs). Every device has its own memory
budget (a stage must fit the device holding it), devices may be left out, and fewer stages are allowed.
Candidate cut points are the boundaries between the profile's units (units already are linearised segments).

Searches (``ServeOptions.method``):
- ``kpath``: the paper's method: min-total-transfer partition DP under the smallest budget of the devices
  used (the paper's rule; the smallest-budget devices are dropped while no partition fits), bandwidth
  classes, class-ordered bottleneck k-path placement; then priced with compute.
- ``greedy``: the same partition, nearest-neighbour chain placement (the paper's greedy joint baseline).
- ``optimal``: an exact DP over (devices used, last device, last cut) minimising the compute-aware beta
  over every contiguous partition x injective placement, on all devices when the work allows, otherwise on
  the fastest devices that fit the work budget (then named ``optimal-subset``).
- ``auto``: all three; the smallest predicted beta wins (ties: fewer stages, then lower latency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeswarm.errors import InfeasiblePlanError, PlanningError
from edgeswarm.planning.serve.classes import bandwidth_classes
from edgeswarm.planning.serve.costs import ServeCosts, serve_costs
from edgeswarm.planning.serve.kpath import ColourCodingKPath, ExactKPath, KPathOracle
from edgeswarm.planning.serve.partition import Status, partition_normative
from edgeswarm.planning.serve.placement import place_greedy, place_kpath
from edgeswarm.planning.serve.types import ServeOptions, ServePlan, ServeStagePlan
from edgeswarm.values.limits import MAX_DEVICES
from edgeswarm.values.profiles import ClusterProfile

# Cells the exact DP may touch (2^K * K/2 device-subset steps of (L+1)^2 each): about 0.1-0.3 s of numpy.
EXACT_WORK_CELLS = 4e7
BANDWIDTH_CLASSES = 20
# Graphs up to this many devices use the exact k-path oracle; larger ones colour-coding.
EXACT_KPATH_DEVICES = 16


@dataclass(frozen=True)
class Candidate:
    """A layout: unit ranges [start, end) in order, and the device index (in ServeCosts) of each."""

    bounds: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]
    method: str


@dataclass(frozen=True)
class Priced:
    """A candidate with its prediction; ``fits`` is False when a stage exceeds its device's budget."""

    candidate: Candidate
    beta: float
    latency: float
    fits: bool


def price(costs: ServeCosts, cand: Candidate) -> Priced:
    """beta, latency and budget check of a layout (the planner's single pricing function)."""
    beta = 0.0
    latency = 0.0
    fits = True
    for r, ((s, e), d) in enumerate(zip(cand.bounds, cand.devices, strict=True)):
        c = costs.compute_s(d, s, e)
        x = costs.transfer_s(cand.devices[r - 1], d, s - 1) if r else 0.0
        beta = max(beta, c, x)
        latency += c + x
        fits = fits and costs.memory(s, e) <= costs.budgets[d]
    return Priced(cand, beta, latency, fits)


def to_plan(costs: ServeCosts, p: Priced) -> ServePlan:
    """The ServePlan of a priced layout."""
    stages = []
    where = ""
    worst = -1.0
    cand = p.candidate
    for r, ((s, e), d) in enumerate(zip(cand.bounds, cand.devices, strict=True)):
        c = costs.compute_s(d, s, e)
        x = costs.transfer_s(cand.devices[r - 1], d, s - 1) if r else 0.0
        if c > worst:
            worst, where = c, f"compute:{costs.nodes[d]}"
        if x > worst:
            worst, where = x, f"link:{costs.nodes[cand.devices[r - 1]]}->{costs.nodes[d]}"
        stages.append(ServeStagePlan(
            index=r, start=s, end=e, device=costs.nodes[d], compute_s=c, transfer_in_s=x,
            input_bytes=int(costs.cut_bytes[s - 1]) if s else int(costs.input_bytes),
            memory_bytes=costs.memory(s, e), memory_budget_bytes=int(costs.budgets[d])))
    # A model whose forward takes no measurable time still gets a positive, finite bottleneck.
    beta = max(p.beta, 1e-12)
    return ServePlan(model_fingerprint=costs.fingerprint, micro_batch_size=costs.batch, stages=stages,
                     bottleneck_s=beta, throughput_per_s=costs.batch / beta, latency_s=p.latency,
                     method=cand.method, bottleneck=where, units=costs.units)


# --- the paper's method, priced with compute ---------------------------------------------------------------


def _paper_partition(costs: ServeCosts, max_stages: int) -> tuple[list[int], tuple[int, ...]] | None:
    """The min-total-transfer partition under the smallest budget of the devices used, dropping the
    smallest-budget devices while none fits. Returns (device indices used, cuts) or None."""
    order = sorted(range(costs.n), key=lambda d: (-costs.budgets[d], d))
    L = costs.units
    transfers = [float(costs.input_bytes), *costs.cut_bytes[:-1].tolist(), 0.0]
    mem = np.array([costs.memory_from(s) for s in range(L + 1)])  # (L+1, L+1)
    for k in range(len(order), 0, -1):
        used = order[:k]
        cap = float(costs.budgets[used[-1]])
        part = partition_normative(transfers, lambda b, c, cap=cap: bool(mem[b, c] <= cap), min(k, max_stages))
        if part.status in (Status.OK, Status.SINGLE_PARTITION):
            return used, part.cuts
    return None


def _place_paper(costs: ServeCosts, max_stages: int, method: str, seed: int) -> Candidate | None:
    found = _paper_partition(costs, max_stages)
    if found is None:
        return None
    used, cuts = found
    L = costs.units
    edges = [0, *cuts, L]
    bounds = tuple(zip(edges[:-1], edges[1:], strict=True))
    transfers = [float(costs.cut_bytes[c - 1]) for c in cuts]
    if method == "greedy":
        placed = place_greedy(transfers, costs.bw, used)
    else:
        all_t = [float(costs.input_bytes), *costs.cut_bytes[:-1].tolist(), 0.0]
        classes = bandwidth_classes(transfers, all_t, BANDWIDTH_CLASSES) if transfers else []
        oracle: KPathOracle = (ExactKPath() if len(used) <= EXACT_KPATH_DEVICES
                               else ColourCodingKPath(np.random.default_rng(seed)))
        placed = place_kpath(transfers, classes, BANDWIDTH_CLASSES, costs.bw, oracle, used)
    if placed.status not in (Status.OK, Status.SINGLE_PARTITION):
        return None
    if not transfers:
        # One partition: the paper puts it anywhere; put it on the fastest device that holds it.
        fits = [d for d in used if costs.memory(0, L) <= costs.budgets[d]]
        return Candidate(bounds, (min(fits or used, key=lambda d: (costs.compute_s(d, 0, L), d)),), method)
    return Candidate(bounds, placed.nodes, method)


# --- exact compute-aware search ------------------------------------------------------------------------------


def _exact_devices(costs: ServeCosts, max_stages: int) -> list[int]:
    """The devices the exact DP searches over: all when the work allows, else the fastest that fit it."""
    cells = (costs.units + 1) ** 2
    k = costs.n
    while k > 1 and 2**k * max(1, min(k, max_stages)) / 2 * cells > EXACT_WORK_CELLS:
        k -= 1
    order = sorted(range(costs.n), key=lambda d: (costs.compute_s(d, 0, costs.units), -costs.budgets[d], d))
    return sorted(order[:k])


def exact_search(costs: ServeCosts, devices: Sequence[int], max_stages: int) -> Candidate | None:
    """Minimise beta over contiguous partitions of the units x injective placements on ``devices`` with at
    most ``max_stages`` stages, every stage within its device's budget. DP over (device subset S, last device
    d): g[S, d][e] = best beta covering units [0, e) with the devices of S, the last stage on d ending at e.
    Ties: fewer stages, then the smaller subset mask."""
    L = costs.units
    devs = list(devices)
    k = len(devs)
    inf = math.inf
    mem = np.array([costs.memory_from(s) for s in range(L + 1)])  # (L+1, L+1), row = start
    upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), 1)
    # comp[i][s, e]: seconds of units [s, e) on device i; inf where it does not fit or e <= s.
    comp = []
    for d in devs:
        cut = np.arange(L + 1)
        c = costs.units_s(d, cut[:, None], cut[None, :]) + costs.cold_s(d)
        ok = upper & (mem <= costs.budgets[d])
        comp.append(np.where(ok, c, inf))
    xfer = {(i, j): np.concatenate(([inf], costs.cut_bytes / costs.bw[devs[i], devs[j]]
                                    + costs.latency[devs[i], devs[j]]
                                    + costs.message_s(devs[i], devs[j], costs.cut_bytes)))
            for i in range(k) for j in range(k) if i != j}  # xfer[(i, j)][e]: cut after unit e-1
    g: dict[tuple[int, int], np.ndarray] = {}
    back: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for i in range(k):
        g[(1 << i, i)] = comp[i][0].copy()
    for mask in range(1, 1 << k):
        members = [i for i in range(k) if mask >> i & 1]
        if len(members) >= max_stages:
            continue
        live = [i for i in members if (mask, i) in g]
        if not live:
            continue
        for j in range(k):
            if mask >> j & 1:
                continue
            # a[e]: best beta arriving at cut e on device j, over the last device i of S.
            stack = np.stack([np.maximum(g[(mask, i)], xfer[(i, j)]) for i in live])
            arg_i = stack.argmin(axis=0)
            a = stack[arg_i, np.arange(L + 1)]
            if not np.isfinite(a).any():
                continue
            cand = np.maximum(a[:, None], comp[j])  # [start, end]
            arg_s = cand.argmin(axis=0)
            h = cand[arg_s, np.arange(L + 1)]
            key = (mask | 1 << j, j)
            if key not in g:
                g[key] = h
                back[key] = (np.array(live)[arg_i][arg_s], arg_s)
            else:
                better = h < g[key]
                if better.any():
                    old_i, old_s = back[key]
                    g[key] = np.where(better, h, g[key])
                    back[key] = (np.where(better, np.array(live)[arg_i][arg_s], old_i), np.where(better, arg_s, old_s))
    best: tuple[float, int, int, int] | None = None
    for (mask, i), vec in g.items():
        v = float(vec[L])
        if not math.isfinite(v):
            continue
        rank = (v, bin(mask).count("1"), mask, i)
        if best is None or (v < best[0] * (1 - 1e-12) or (math.isclose(v, best[0], rel_tol=1e-12)
                                                          and rank[1:] < best[1:])):
            best = rank
    if best is None:
        return None
    _, _, mask, i = best
    bounds: list[tuple[int, int]] = []
    placed: list[int] = []
    e = L
    while True:
        placed.append(devs[i])
        if bin(mask).count("1") == 1:
            bounds.append((0, e))
            break
        prev_i, start = back[(mask, i)]
        s = int(start[e])
        bounds.append((s, e))
        pi = int(prev_i[e])
        mask &= ~(1 << i)
        i, e = pi, s
    return Candidate(tuple(bounds[::-1]), tuple(placed[::-1]), "optimal" if k == costs.n else "optimal-subset")


# --- entry point -------------------------------------------------------------------------------------------------


def plan_serving(cluster: ClusterProfile, options: ServeOptions | None = None) -> ServePlan:
    """The best serve-pipeline plan for ``cluster`` by predicted bottleneck (see the module doc).

    Raises InfeasiblePlanError (with which budget is short by how much) when no layout fits, and
    ProfileError when the profiles cannot price the micro-batch size or a link is unmeasured.
    """
    options = options or ServeOptions()
    costs = serve_costs(cluster, options.micro_batch_size, options.exclude)
    max_stages = min(options.max_stages or MAX_DEVICES, costs.n)
    methods = ("kpath", "greedy", "optimal") if options.method == "auto" else (options.method,)
    priced: list[Priced] = []
    for m in methods:
        cand = (exact_search(costs, _exact_devices(costs, max_stages), max_stages) if m == "optimal"
                else _place_paper(costs, max_stages, m, options.seed))
        if cand is not None:
            p = price(costs, cand)
            if p.fits and math.isfinite(p.beta):
                priced.append(p)
    if not priced:
        raise InfeasiblePlanError(_why_infeasible(costs, max_stages, options.method))
    best = min(priced, key=lambda p: (p.beta, len(p.candidate.bounds), p.latency))
    return to_plan(costs, best)


def _why_infeasible(costs: ServeCosts, max_stages: int, method: str) -> str:
    L = costs.units
    top = float(costs.budgets.max())
    unit_need = [costs.memory(u, u + 1) for u in range(L)]
    worst = int(np.argmax(unit_need))
    if unit_need[worst] > top:
        return (f"unit {worst} ({costs.unit_names[worst]}) alone needs {unit_need[worst]} bytes at micro-batch "
                f"{costs.batch} but the largest device budget is {int(top)} bytes (short by "
                f"{unit_need[worst] - int(top)}): use a device with more memory or a smaller micro-batch")
    weights = int(costs.static_prefix[-1])
    budgets = sorted(costs.budgets.tolist(), reverse=True)[:max_stages]
    total = int(sum(budgets))
    if weights > total:
        return (f"the model's weights and buffers need {weights} bytes but the {len(budgets)} largest usable "
                f"budgets total {total} bytes (short by {weights - total}): add devices or memory, or raise "
                f"--max-stages")
    hint = "" if method in ("auto", "optimal") else "; method 'optimal' or 'auto' may still find one"
    return (f"no split of the model's {L} units over at most {max_stages} of the {costs.n} devices fits every "
            f"stage's budget (weights {weights} bytes, largest budgets {budgets}){hint}")


__all__ = ["Candidate", "PlanningError", "Priced", "exact_search", "plan_serving", "price", "to_plan"]

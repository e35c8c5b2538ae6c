"""The central manager's round plan (spec 4): which devices train this round and where each one's model is cut.
The one entry the planner service calls is ``plan_round``; the FedAvg and SplitFed baselines use it too, through
``local_only`` and ``fixed_cut``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgeswarm.errors import PlanTooLargeError
from edgeswarm.planning.splitfed.cost import CostTable, cost_table
from edgeswarm.planning.splitfed.objective import Decoded, Normalisers, normalisers, objective, sharing
from edgeswarm.planning.splitfed.solvers import Solution, bayesian, exhaustive, global_oracle, grid
from edgeswarm.planning.splitfed.types import (
    DeviceCut,
    ModelCost,
    SplitDevice,
    SplitMec,
    SplitOptions,
    SplitPlanError,
    SplitSelection,
)

# Work caps, so that options a message carries cannot make the planner run for minutes: device-points an
# exhaustive search decodes (about a second at 1e7), BO evaluations (each fits a GP on all before it) and the
# grid points scored per evaluation, and (count, threshold) pairs the global oracle tries.
MAX_EXHAUSTIVE_WORK = 10_000_000
MAX_BO_EVALUATIONS = 200
MAX_BO_WORK = 20_000_000
MAX_ORACLE_WORK = 1_000_000


def plan_round(model: ModelCost, devices: list[SplitDevice], mecs: list[SplitMec],
               options: SplitOptions) -> SplitSelection:
    """Select the round's candidates and their cuts (spec 4.3-4.4) with ``options.solver``.

    The count n ranges over ``options.count_range()`` (n_c = ceil(gamma K) by default), capped at the devices that
    can train. Baselines: ``local_only`` (FedAvg) plans the whole model on the device (cut V-h, nothing
    offloaded) and ``fixed_cut`` (SplitFed) one cut for all; both select n_max of the devices it fits uniformly at
    random (seeded by ``options.seed``) instead of optimising. Devices that are available but fit no cut are
    listed in ``infeasible``. A device's id for tie-breaks is its position in ``devices``.

    Raises SplitPlanError (an InfeasiblePlanError) when no device can train, saying how much memory the
    shallowest allowed cut needs against the largest budget, and what to change; PlanTooLargeError when the
    search would exceed the work caps above.
    """
    if not devices:
        raise SplitPlanError("no devices to plan a round for: every MEC reported none; start devices or wait "
                             "for their profiles")
    if not mecs:
        raise SplitPlanError("no MECs to plan a round for: start at least one MEC")
    table = cost_table(model, devices, mecs, options)
    eligible = np.flatnonzero(table.eligible)
    if not eligible.size:
        raise SplitPlanError(_why_nobody(table, devices, model, options))
    left_out = [devices[i].node for i in np.flatnonzero(~table.eligible) if devices[i].available]
    norm = normalisers(table, options)
    lo, hi = options.count_range()
    hi = min(hi, int(eligible.size))
    lo = min(lo, hi)
    n_cuts = table.feasible.shape[1]
    _check_size(options, n_cuts * (hi - lo + 1), len(devices), hi - lo + 1)
    if options.local_only or options.fixed_cut is not None:
        solution = _random_selection(table, eligible, hi, options, norm)
    elif options.solver == "global":
        solution = min((global_oracle(table, n, options, norm) for n in range(lo, hi + 1)),
                       key=lambda s: s.decoded.objective)
    else:
        points = grid(n_cuts, lo, hi)
        if options.solver == "exhaustive":
            solution = exhaustive(table, points, options, norm)
        else:
            solution = bayesian(table, points, options, norm, np.random.default_rng(options.seed))
    decoded = solution.decoded
    if not np.isfinite(decoded.objective):
        raise SplitPlanError(f"no selection of {lo}..{hi} devices holds D_threshold = {options.d_threshold} "
                             f"samples (the eligible devices hold {int(table.samples[eligible].sum())}): lower "
                             "d_threshold or raise the count")
    return _selection(table, decoded, solution, options, left_out)


def _check_size(options: SplitOptions, points: int, devices: int, counts: int) -> None:
    """Raise PlanTooLargeError when the chosen solver's work over ``points`` grid points exceeds its cap."""
    if options.local_only or options.fixed_cut is not None:
        return
    fix = "narrow n_min..n_max, plan fewer devices or a model with fewer units"
    if options.solver == "exhaustive" and points * devices > MAX_EXHAUSTIVE_WORK:
        raise PlanTooLargeError(f"exhaustive search over {points} points x {devices} devices exceeds "
                                f"{MAX_EXHAUSTIVE_WORK}: use solver bo, or {fix}")
    if options.solver == "global" and counts * devices > MAX_ORACLE_WORK:
        raise PlanTooLargeError(f"the global oracle over {counts} counts x {devices} devices exceeds "
                                f"{MAX_ORACLE_WORK}: {fix}")
    if options.solver == "bo":
        evaluations = min(options.bo_budget, points)
        if evaluations > MAX_BO_EVALUATIONS or (evaluations < points and evaluations * points > MAX_BO_WORK):
            raise PlanTooLargeError(f"BO with {evaluations} evaluations over {points} points exceeds "
                                    f"{MAX_BO_EVALUATIONS} evaluations or {MAX_BO_WORK} scored points: lower "
                                    f"bo_budget (default 20), or {fix}")


def _random_selection(table: CostTable, eligible: np.ndarray, n: int, options: SplitOptions,
                      norm: Normalisers) -> Solution:
    """The baselines' selection: n eligible devices uniformly at random, each at its one allowed cut."""
    rng = np.random.default_rng(options.seed)
    rows = np.sort(rng.choice(eligible, size=n, replace=False))
    cuts = table.feasible[rows].argmax(axis=1) + 1
    times = table.times(rows, cuts, sharing(table, rows))
    t_system = float(times.max())
    value = objective(float(table.dis[rows].sum()), t_system, options.lam, norm)
    return Solution((int(cuts[0]), n), Decoded(rows, cuts, times, t_system, value), 0, float("inf"))


def _selection(table: CostTable, decoded: Decoded, solution: Solution, options: SplitOptions,
               left_out: list[str]) -> SplitSelection:
    selected = [
        DeviceCut(node=table.nodes[r], mec=table.mec_names[table.mec_of[r]], cut=int(c), round_s=float(t),
                  memory_bytes=int(table.memory[r, c - 1]), compute_s=float(table.compute_s[r, c - 1]),
                  transfer_s=float(table.transfer_s[r, c - 1]), mec_s=max(0.0, float(t - table.fixed_s[r, c - 1])))
        for r, c, t in sorted(zip(decoded.rows.tolist(), decoded.cuts.tolist(), decoded.times.tolist(), strict=True))
    ]
    return SplitSelection(selected=selected, objective=float(decoded.objective), t_system_s=decoded.t_system,
                          target_cut=int(solution.point[0]), count=len(selected),
                          evaluations=solution.evaluations, solver=options.solver, infeasible=left_out)


def _why_nobody(table: CostTable, devices: Sequence[SplitDevice], model: ModelCost, options: SplitOptions) -> str:
    available = [i for i, d in enumerate(devices) if d.available]
    if not available:
        return f"none of the {len(devices)} devices is available this round: wait for devices to report ready"
    need = int(table.memory[0, _allowed_cuts(table, options)].min())
    most = max(devices[i].budget_bytes for i in available)
    mode = ("the whole model (local_only)" if options.local_only else
            f"cut {options.fixed_cut}" if options.fixed_cut is not None else "the shallowest cut")
    return (f"no device can train {model.name}: {mode} needs {need / 2**20:.1f} MiB on the device but the "
            f"largest budget is {most / 2**20:.1f} MiB; use a smaller batch (now {model.batch_size}) or model, a "
            "shorter tail, a split instead of local training, or devices with more free memory")


def _allowed_cuts(table: CostTable, options: SplitOptions) -> np.ndarray:
    n_cuts = table.memory.shape[1]
    allowed = np.zeros(n_cuts, dtype=bool)
    if options.local_only:
        allowed[n_cuts - 1] = True
    elif options.fixed_cut is not None:
        allowed[options.fixed_cut - 1] = True
    else:
        allowed[:] = True
    return allowed

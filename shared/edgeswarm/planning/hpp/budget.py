"""How much work a training plan or re-plan request is, counted before any of it is done (edgeswarm.planning.budget).

Work is counted in *cells*, the unit of the planners' vectorised inner loop: one device of one candidate stage
priced by Alg. 1 (edgeswarm.planning.hpp.allocation), or one entry of a cost-model table. The counts follow the
loops of the planners exactly, so they depend only on the request's shape (L units, N devices, micro-batch
size B, which micro-batch counts M and which strategies are planned), never on the profile's values:

- a cost model (edgeswarm.planning.hpp.costmodel) fills N x (B + 1) x (L + 1) table entries and interpolates
  2 x N x L profile rows (``TABLE_ROW_CELLS`` cells each);
- the HPP search (edgeswarm.planning.hpp.asteroid.search) prices, at level 1, the L tail ranges on each of the N
  suffix groups (L x T(N) cells, T(n) = n(n + 1) / 2 the triangular number), and at each level
  p = 2..min(L, N) the T(L - p + 1) head ranges [i, j) on every contiguous group of g devices, of which there
  are N - p + 2 - g: T(L - p + 1) x Tet(N - p + 1) cells (Tet(n) = n(n + 1)(n + 2) / 6);
- the baselines (edgeswarm.planning.hpp.baselines): ``dp`` one table and N cells; ``single`` two tables and its
  N x B scan of micro-batch sizes; ``pp`` one table and min(L, N) x (L + 1)^2 cells;
- a light re-plan (edgeswarm.planning.hpp.replan) one table and, at worst, L x P memory-fitting rounds of P + 2
  single-range pricings plus L hill-climbing moves of 2(P - 1) layouts of P stages each, where one pricing
  costs ``PRICING_CELLS`` (it is Python overhead, not array work), and each layout's round is event-simulated
  (``assemble.scheduled_round``: ``SIMULATION_CELLS`` for each of its M micro-batches on each of its P stages).

``plan_best`` plans every micro-batch count M of ``micro_batch_choices`` (up to 7) unless M is given, and
``compare`` does that for HPP and each baseline, so a request without M costs up to 7 times as much.
"""

from edgeswarm.planning.budget import WorkEstimate
from edgeswarm.planning.hpp.compare import micro_batch_choices
from edgeswarm.planning.hpp.types import Plan, Strategy
from edgeswarm.values.profiles import ClusterProfile

# Interpolating one profile row into a cost-model table: about 2.3 us per (device, unit) measured with B = 1
# (np.interp's call overhead), i.e. about 8 cells.
TABLE_ROW_CELLS = 8

# One single-range Alg. 1 pricing (stage_costs for one unit range, or one stage of assemble_plan): 76 to 193 us
# measured (1 to 12 devices), dominated by Python and numpy call overhead; 700 cells is about 210 us.
PRICING_CELLS = 700

# One micro-batch through one stage of a plan's event-simulated round (schedule.simulate, as assemble_plan runs it):
# 9 to 17 us measured (2 to 6 stages, 4 to 16 micro-batches), Python overhead; 50 cells is 15 us.
SIMULATION_CELLS = 50


def triangular(n: int) -> int:
    """T(n) = 1 + 2 + ... + n (0 for n <= 0)."""
    return n * (n + 1) // 2 if n > 0 else 0


def tetrahedral(n: int) -> int:
    """Tet(n) = T(1) + T(2) + ... + T(n) (0 for n <= 0)."""
    return n * (n + 1) * (n + 2) // 6 if n > 0 else 0


def table_cells(units: int, devices: int, micro_batch_size: int) -> int:
    """Cells of building one cost model: its N x (B + 1) x (L + 1) table entries and 2 x N x L interpolated rows."""
    return devices * (micro_batch_size + 1) * (units + 1) + 2 * devices * units * TABLE_ROW_CELLS


def search_cells(units: int, devices: int, *, max_stages: int | None = None) -> int:
    """Cells the HPP search prices for L ``units`` on N ``devices`` (every level up to min(L, N, max_stages))."""
    if units <= 0 or devices <= 0:
        return 0
    levels = min(units, devices, max_stages or devices)
    cells = units * triangular(devices)
    for p in range(2, levels + 1):
        cells += triangular(units - p + 1) * tetrahedral(devices - p + 1)
    return cells


def strategy_cells(strategy: Strategy, units: int, devices: int, micro_batch_size: int) -> int:
    """Cells of planning ``strategy`` once (one M), cost model included."""
    table = table_cells(units, devices, micro_batch_size)
    if strategy == "hpp":
        return table + search_cells(units, devices)
    if strategy == "single":
        # A second cost model when a smaller micro-batch is faster on the chosen device (at most as large).
        return 2 * table + devices * micro_batch_size
    if strategy == "dp":
        return table + devices
    return table + min(units, devices) * (units + 1) ** 2


def light_replan_cells(units: int, devices: int, stages: int, micro_batch_size: int, micro_batches: int) -> int:
    """Cells of a light re-plan at worst: the survivors' cost model, L x P memory-fitting rounds of P + 2
    pricings and L hill-climbing moves of 2(P - 1) layouts of P stages, each layout's round simulated over its M
    ``micro_batches``, for P ``stages`` left."""
    layouts = 1 + units * 2 * max(stages - 1, 0)
    pricings = units * stages * (stages + 2) + layouts * stages
    return (table_cells(units, devices, micro_batch_size) + pricings * PRICING_CELLS
            + layouts * stages * micro_batches * SIMULATION_CELLS)


def estimate_plan(cluster: ClusterProfile, global_batch: int, *, micro_batches: int | None = None,
                  strategy: Strategy = "hpp", compare: bool = False) -> WorkEstimate:
    """The work of ``plan_best(strategy, ...)``, or of ``compare(...)`` (HPP and every baseline) when ``compare``.

    Raises ProfileError, like the planners, when no micro-batch count is possible without ``micro_batches``.
    """
    units, devices = len(cluster.model.units), len(cluster.devices)
    choices = [micro_batches] if micro_batches else micro_batch_choices(cluster, global_batch)
    strategies: tuple[Strategy, ...] = ("hpp", "single", "dp", "pp") if compare else (strategy,)
    cells = sum(strategy_cells(s, units, devices, max(1, global_batch // m)) for s in strategies for m in choices)
    advice = []
    if len(choices) > 1:
        advice.append(f"fix micro_batches (M) to plan once instead of {len(choices)} times "
                      f"(M = {', '.join(map(str, choices))} are tried)")
    if "hpp" in strategies and devices > 1:
        advice.append(f"plan fewer units or devices: the search grows about as L^2 x N^4 ({units} units on {devices} "
                      "devices here)")
    what = (f"{'HPP and every baseline' if compare else strategy} for {units} units on {devices} devices at "
            f"{len(choices)} micro-batch count(s)")
    return WorkEstimate(cells, what, tuple(advice))


def estimate_replan(plan: Plan, cluster: ClusterProfile, failed: str, *, heavy: bool) -> WorkEstimate:
    """The work of ``heavy_replan`` (the HPP search on the survivors at the plan's M) or, at worst, of
    ``light_replan``, for ``plan`` without device ``failed``."""
    units = len(cluster.model.units)
    survivors = sum(1 for e in cluster.devices if e.device.node != failed)
    b = plan.options.micro_batch_size
    if heavy:
        cells = strategy_cells("hpp", units, survivors, b)
        return WorkEstimate(cells, f"a heavy re-plan of {units} units on {survivors} devices",
                            ("use the light re-plan (heavy false)",
                             f"plan fewer units or devices: the search grows about as L^2 x N^4 ({units} units on "
                             f"{survivors} devices here)"))
    stages = sum(1 for s in plan.stages if any(d != failed for d in s.devices))
    cells = light_replan_cells(units, survivors, stages, b, plan.options.micro_batches)
    return WorkEstimate(cells, f"a light re-plan of {units} units in {stages} stages on {survivors} devices",
                        ("plan with fewer stages or units",))

"""Bounded planning: size caps on the profiles and requests the planner reads, the work estimate against hand
counts and against the search's own loop, the budget check, and the deadline that stops a search (issue 13.3).

Nothing here reads a wall clock: deadlines run on an injected counter."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from edgeswarm.errors import PlanningDeadlineError, PlanTooLargeError
from edgeswarm.messages.planning import PlanRequest, ReplanRequest
from edgeswarm.planning.budget import SECONDS_PER_CELL, check_budget, work_cap
from edgeswarm.planning.deadline import Deadline
from edgeswarm.planning.hpp import asteroid
from edgeswarm.planning.hpp.baselines import plan_pp, plan_single
from edgeswarm.planning.hpp.budget import (
    PRICING_CELLS,
    SIMULATION_CELLS,
    TABLE_ROW_CELLS,
    estimate_plan,
    estimate_replan,
    light_replan_cells,
    search_cells,
    strategy_cells,
    table_cells,
)
from edgeswarm.planning.hpp.compare import compare, micro_batch_choices, plan_best
from edgeswarm.planning.hpp.costmodel import CostModel
from edgeswarm.planning.hpp.replan import heavy_replan, light_replan
from edgeswarm.planning.hpp.types import Plan, PlanOptions
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.profiling.device import check_batch_sizes
from edgeswarm.profiling.gather import symmetric_links
from edgeswarm.values import limits
from edgeswarm.values.profiles import ClusterProfile

GIB = 1024**3


def _cluster(units: int, devices: int, **kwargs: Any) -> ClusterProfile:
    devs = [SyntheticDevice(f"d{i}", 1.0 + i % 4, 4 * GIB) for i in range(devices)]
    return synthetic_cluster(units, devs, **kwargs)


def _ticks(start: int = 0) -> Callable[[], float]:
    """A clock that advances by one on every reading: a deadline at ``at`` lets exactly ``at - start + 1`` checks
    pass, whatever the machine's speed."""
    counter = itertools.count(start)
    return lambda: float(next(counter))


# --- caps ----------------------------------------------------------------------------------------------


def _refused(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        ClusterProfile.model_validate(data)
    return str(info.value)


def test_schema_caps_refuse_oversized_profiles() -> None:
    base = _cluster(4, 2).model_dump()
    unit, device, link = base["model"]["units"][0], base["devices"][0], base["links"][0]

    too_many_units = [{**unit, "index": i} for i in range(limits.MAX_UNITS + 1)]
    assert "units" in _refused({**base, "model": {**base["model"], "units": too_many_units}})
    many_devices = [{**device, "device": {**device["device"], "node": f"n{i}"}} for i in range(limits.MAX_DEVICES + 1)]
    assert "devices" in _refused({**base, "devices": many_devices})
    assert "links" in _refused({**base, "links": [link] * (limits.MAX_LINKS + 1)})

    compute = device["compute"]
    grid = list(range(1, limits.MAX_BATCH_GRID + 2))
    wide = {**compute, "batch_sizes": grid, "forward_s": [[0.1] * len(grid)] * 4,
            "backward_s": [[0.1] * len(grid)] * 4}
    assert "batch_sizes" in _refused({**base, "devices": [{**device, "compute": wide}]})
    huge_batch = {**compute, "batch_sizes": [*compute["batch_sizes"][:-1], limits.MAX_BATCH_SIZE + 1]}
    assert "batch_sizes" in _refused({**base, "devices": [{**device, "compute": huge_batch}]})
    long_rows = {**compute, "forward_s": [row * 10 for row in compute["forward_s"]]}
    assert "forward_s" in _refused({**base, "devices": [{**device, "compute": long_rows}]})
    for bad_time in (math.nan, math.inf, -1.0):
        rows = [[bad_time] + row[1:] for row in compute["backward_s"]]
        assert "backward_s" in _refused({**base, "devices": [{**device, "compute": {**compute, "backward_s": rows}}]})

    long_name = {**unit, "name": "x" * (limits.MAX_UNIT_NAME_CHARS + 1)}
    assert "name" in _refused({**base, "model": {**base["model"], "units": [long_name, *base["model"]["units"][1:]]}})
    heavy_unit = {**unit, "weight_bytes": limits.MAX_UNIT_BYTES + 1}
    assert "weight_bytes" in _refused({**base, "model": {**base["model"],
                                                         "units": [heavy_unit, *base["model"]["units"][1:]]}})
    config = {f"k{i}": i for i in range(limits.MAX_CONFIG_KEYS + 1)}
    assert "config" in _refused({**base, "model": {**base["model"], "model": {"name": "m", "config": config}}})
    assert "node" in _refused({**base, "devices": [{**device, "device": {**device["device"], "node": "a/b"}}]})
    assert "bandwidth_bps" in _refused({**base, "links": [{**link, "bandwidth_bps": math.nan}]})


def test_request_caps_refuse_oversized_numbers() -> None:
    cluster = _cluster(4, 2)
    PlanRequest(cluster=cluster, global_batch=limits.MAX_GLOBAL_BATCH, micro_batches=limits.MAX_GLOBAL_BATCH,
                epoch=limits.MAX_EPOCH)
    for bad in ({"global_batch": limits.MAX_GLOBAL_BATCH + 1}, {"micro_batches": limits.MAX_GLOBAL_BATCH + 1},
                {"epoch": limits.MAX_EPOCH + 1}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            PlanRequest(cluster=cluster, **{"global_batch": 64, **bad})
    plan = plan_best("hpp", cluster, 64, micro_batches=4)
    with pytest.raises(ValidationError, match="stages"):
        Plan.model_validate({**plan.model_dump(), "stages": [plan.stages[0].model_dump()] * (limits.MAX_DEVICES + 1)})
    with pytest.raises(ValidationError, match="global batch"):
        PlanOptions(micro_batch_size=limits.MAX_BATCH_SIZE, micro_batches=limits.MAX_GLOBAL_BATCH)


def test_caps_accept_everything_planned_today() -> None:
    """The bench's 213-unit profile, a 12-device cluster, every batch size the profiler accepts, a profile at
    every cap, and a plan of the single-device baseline accumulating one-sample micro-batches all validate."""
    for cluster in (_cluster(213, 6), _cluster(200, 12), _cluster(limits.MAX_UNITS, 2)):
        assert ClusterProfile.model_validate_json(cluster.model_dump_json()) == cluster
    grid = check_batch_sizes(list(range(limits.MAX_BATCH_SIZE - limits.MAX_BATCH_GRID + 1, limits.MAX_BATCH_SIZE + 1)))
    widest = _cluster(3, 2, batch_sizes=grid)
    assert ClusterProfile.model_validate_json(widest.model_dump_json()) == widest
    many = synthetic_cluster(2, [SyntheticDevice(f"d{i}", 1.0, GIB) for i in range(limits.MAX_DEVICES)])
    many = ClusterProfile(model=many.model, devices=many.devices, links=symmetric_links(many.links))
    assert len(many.links) == limits.MAX_LINKS
    ReplanRequest(plan=plan_best("hpp", _cluster(8, 3), 256, micro_batches=8), cluster=many, failed="d0")
    single = plan_single(_cluster(6, 1, batch_sizes=(1, 2)), PlanOptions(micro_batch_size=2, micro_batches=4))
    assert Plan.model_validate(single.model_dump()) == single


# --- the work estimate ---------------------------------------------------------------------------------


def test_search_estimate_matches_hand_counts() -> None:
    # L=2, N=2. Level 1: tails [0,2) and [1,2) on {d0,d1} (2 x 2) and on {d1} (2 x 1) = 6 cells. Level 2: head
    # ranges [i, j) with j <= L - 1 = 1 (only [0,1)) on the one group {d0} that leaves a device = 1 cell.
    assert search_cells(2, 2) == 7
    # L=3, N=3. Level 1: 3 tails x (3 + 2 + 1) devices = 18. Level 2: heads with j <= 2 ([0,1), [0,2), [1,2)) on
    # {d0}, {d1} (one device each, leaving one) and {d0,d1} (two devices): 3 x (1 + 1 + 2) = 12. Level 3: [0,1)
    # on {d0} = 1.
    assert search_cells(3, 3) == 31
    assert search_cells(5, 1) == 5  # one device: only the tails on it
    assert search_cells(7, 3, max_stages=1) == 7 * 6
    # One table: (B + 1) x (L + 1) entries per device plus two interpolated rows per device and unit.
    assert table_cells(2, 1, 1) == 2 * 3 + 2 * 2 * TABLE_ROW_CELLS
    assert strategy_cells("hpp", 3, 3, 4) == table_cells(3, 3, 4) + 31
    assert strategy_cells("pp", 3, 3, 4) == table_cells(3, 3, 4) + 3 * 4**2
    # Light re-plan, 2 stages of 10 units: 10 x 2 fitting rounds of 4 pricings, (1 + 10 x 2) layouts of 2 stages,
    # each layout's round simulated over its 4 micro-batches on its 2 stages.
    assert light_replan_cells(10, 3, 2, 8, 4) == (table_cells(10, 3, 8) + (80 + 42) * PRICING_CELLS
                                                  + 21 * 2 * 4 * SIMULATION_CELLS)


def test_search_estimate_equals_what_the_search_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate follows the DP's loops exactly: every (unit range, device) pair the search hands to Alg. 1."""
    priced: list[int] = []
    real = asteroid.stage_costs

    def counting(cm: CostModel, group: Any, k: int, starts: np.ndarray, ends: np.ndarray) -> Any:
        priced.append(len(starts) * len(group))
        return real(cm, group, k, starts, ends)

    monkeypatch.setattr(asteroid, "stage_costs", counting)
    for units, devices, max_stages in ((2, 2, None), (5, 3, None), (17, 7, None), (3, 9, None), (12, 6, 2)):
        priced.clear()
        cm = CostModel(_cluster(units, devices), PlanOptions(micro_batch_size=8, micro_batches=4))
        asteroid.search(cm, max_stages=max_stages)
        assert sum(priced) == search_cells(units, devices, max_stages=max_stages), (units, devices)


def test_estimate_grows_as_the_search_does() -> None:
    # Twice the units: four times the head ranges. Twice the devices (L >> N): about 2^4 as many.
    assert 3.9 < search_cells(400, 6) / search_cells(200, 6) < 4.1
    assert 13 < search_cells(1000, 12) / search_cells(1000, 6) < 16
    cluster = _cluster(30, 4)
    choices = micro_batch_choices(cluster, 256)
    assert len(choices) == 7
    each = [estimate_plan(cluster, 256, micro_batches=m).cells for m in choices]
    assert estimate_plan(cluster, 256).cells == sum(each)
    both = estimate_plan(cluster, 256, compare=True).cells
    assert both == sum(strategy_cells(s, 30, 4, 256 // m) for s in ("hpp", "single", "dp", "pp") for m in choices)
    assert both > estimate_plan(cluster, 256).cells
    plan = plan_best("hpp", cluster, 256, micro_batches=8)
    heavy = estimate_replan(plan, cluster, "d0", heavy=True)
    assert heavy.cells == strategy_cells("hpp", 30, 3, 32)
    light = estimate_replan(plan, cluster, "d0", heavy=False)
    stages = sum(1 for s in plan.stages if s.devices != ["d0"])
    assert light.cells == light_replan_cells(30, 3, stages, 32, 8)


def test_budget_refuses_the_issue_request_and_says_what_to_change() -> None:
    """Issue 13.3's request (200 units, 12 devices, no micro-batch count, with the baselines) is over the default
    budget; the same request with M fixed is not."""
    cluster = _cluster(200, 12)
    estimate = estimate_plan(cluster, 256, compare=True)
    assert estimate.cells > work_cap(30.0) == math.floor(30.0 / SECONDS_PER_CELL)
    with pytest.raises(PlanTooLargeError) as info:
        check_budget(estimate, 30.0)
    text = str(info.value)
    assert f"{estimate.cells:,} cells" in text and "budget of 30 s" in text
    assert "fix micro_batches" in text and "fewer units or devices" in text and "EDGESWARM_PLAN_TIME_BUDGET_S" in text
    check_budget(estimate_plan(cluster, 256, micro_batches=8), 30.0)
    check_budget(estimate_plan(_cluster(213, 6), 2048, compare=True), 30.0)  # the bench's Table 7 size


# --- the deadline --------------------------------------------------------------------------------------


def test_deadline_stops_the_search_between_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []
    real = asteroid.stage_costs

    def counting(*args: Any) -> Any:
        steps.append(1)
        return real(*args)

    monkeypatch.setattr(asteroid, "stage_costs", counting)
    cm = CostModel(_cluster(20, 6), PlanOptions(micro_batch_size=8, micro_batches=4))
    # The clock reads 0, 1, 2, ...: checks reading 0..5 pass, so exactly six group steps run.
    with pytest.raises(PlanningDeadlineError, match="HPP search"):
        asteroid.search(cm, deadline=Deadline(5.0, clock=_ticks()))
    assert len(steps) == 6
    # A deadline the search meets changes nothing: 6 level-1 groups and T(N - p + 1) groups per level p >= 2.
    steps.clear()
    layout = asteroid.search(cm, deadline=Deadline(math.inf, clock=_ticks()))
    assert len(steps) == 6 + sum(math.comb(6 - p + 2, 2) for p in range(2, 7))
    assert layout == asteroid.search(cm)


def test_deadline_stops_every_planner() -> None:
    cluster = _cluster(20, 4)
    options = PlanOptions(micro_batch_size=8, micro_batches=4)
    with pytest.raises(PlanningDeadlineError, match="its time budget of 0.5 s"):
        Deadline.after(0.5, clock=_ticks()).check("a test")  # set at reading 0, checked at reading 1
    for run in (lambda d: compare(cluster, 32, deadline=d), lambda d: plan_pp(cluster, options, deadline=d),
                lambda d: plan_single(cluster, options, deadline=d),
                lambda d: plan_best("dp", cluster, 32, micro_batches=4, deadline=d)):
        with pytest.raises(PlanningDeadlineError, match="EDGESWARM_PLAN_TIME_BUDGET_S"):
            run(Deadline(-1.0, clock=_ticks()))
    plan = plan_best("hpp", cluster, 32, micro_batches=4)
    for heavy in (False, True):
        replan = heavy_replan if heavy else light_replan
        with pytest.raises(PlanningDeadlineError):
            replan(plan, cluster, plan.devices[-1], deadline=Deadline(-1.0, clock=_ticks()))
        assert replan(plan, cluster, plan.devices[-1], deadline=Deadline(math.inf)).epoch == plan.epoch + 1
    assert compare(cluster, 32, deadline=Deadline(math.inf)).hpp == compare(cluster, 32).hpp

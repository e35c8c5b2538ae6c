"""A stage is priced by its extent (ComputeProfile.chain, vocabulary.extent_scale): its units' profiled times (scaled
to the whole model run as one stage) times a factor that runs from the units as timed alone, at no extent, through
the model's halves run as stages, to the whole model's from FULL_EXTENT of its time on. Pure, no broker."""

from __future__ import annotations

import numpy as np
import pytest

from edgeswarm.planning.hpp.asteroid import plan_asteroid
from edgeswarm.planning.hpp.baselines import plan_dp
from edgeswarm.planning.hpp.costmodel import CostModel
from edgeswarm.planning.hpp.types import PlanOptions
from edgeswarm.planning.serve.costs import serve_costs
from edgeswarm.planning.serve.plan import plan_serving
from edgeswarm.planning.serve.types import ServeOptions
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.planning.vocabulary import BACKWARD, FORWARD, FULL_EXTENT, INFERENCE, extent_factors, extent_scale
from edgeswarm.values.profiles import ChainFactors, ClusterProfile, ComputeProfile

GIB = 2**30
OPTIONS = PlanOptions(micro_batch_size=8, micro_batches=4)


def cluster(units: int = 12) -> ClusterProfile:
    return synthetic_cluster(units, [SyntheticDevice(f"d{i}", 1.0 + i, 4 * GIB) for i in range(3)], step_s=1e-3)


def chained(profile: ClusterProfile, whole: float = 1.25, half: float = 1.0) -> ClusterProfile:
    """Every device's profile with the same chain factors at every batch size (forward, backward and served)."""
    def add(compute: ComputeProfile) -> ComputeProfile:
        factors = ChainFactors(whole=(whole, whole, whole), half=(half, half, half))
        return compute.model_copy(update={"chain": [factors] * len(compute.batch_sizes)})

    return profile.model_copy(update={"devices": [e.model_copy(update={"compute": add(e.compute)})
                                                  for e in profile.devices]})


def test_the_scale_runs_through_its_knots() -> None:
    low, half = 0.8, 0.9
    whole = 10.0
    spans = np.array([0.0, 1.0, 2.5, 5.0, 6.25, FULL_EXTENT * whole, 9.0, 10.0])
    expected = [low, low + 0.1 * 0.2, low + 0.1 * 0.5, half, half + 0.1 * 0.5, 1.0, 1.0, 1.0]
    assert extent_scale(spans, whole, low, half) == pytest.approx(expected)
    assert extent_scale(3.0, 0.0, low, half) == pytest.approx(1.0)  # nothing to compare with: the whole's price
    # One price for every extent where the knots are both 1 (a profile without chain factors).
    assert extent_scale(spans, whole, 1.0, 1.0) == pytest.approx([1.0] * len(spans))


def test_the_knots_follow_the_batch_grid() -> None:
    compute = cluster().devices[0].compute
    assert np.array_equal(extent_factors(compute, [1, 3, 8], FORWARD), np.ones((3, 2)))
    grid = compute.batch_sizes
    chain = [ChainFactors(whole=(1.0 + b / 1000, 2.0, 1.0), half=(1.0, 1.0, 0.5)) for b in grid]
    compute = compute.model_copy(update={"chain": chain})
    knots = extent_factors(compute, [1, 3, 1000], FORWARD)
    # At batch 3, halfway between the grid's 2 and 4; past the grid's end, its last batch size's.
    assert knots[:, 0] == pytest.approx([1 / 1.001, (1 / 1.002 + 1 / 1.004) / 2, 1 / (1 + grid[-1] / 1000)])
    assert knots[:, 1] == pytest.approx(knots[:, 0])
    assert extent_factors(compute, [4], BACKWARD)[0] == pytest.approx([0.5, 0.5])
    assert extent_factors(compute, [4], INFERENCE)[0] == pytest.approx([1.0, 0.5])


def test_the_training_cost_model_prices_a_stage_by_its_extent() -> None:
    plain_cluster = cluster()
    plain, model = CostModel(plain_cluster, OPTIONS), CostModel(chained(plain_cluster), OPTIONS)
    L, b = plain.L, OPTIONS.micro_batch_size
    for d in range(plain.N):
        # The whole model costs what its profile says (its units are scaled to it); a short stage its units as
        # timed alone, 1/1.25 of that; half the model the halves' price, 1.0/1.25.
        assert model.compute_s(d, b, 0, L) == pytest.approx(plain.compute_s(d, b, 0, L))
        assert model.forward_s(d, b, 3, 4) == pytest.approx(plain.forward_s(d, b, 3, 4) / 1.25, rel=0.1)
        start, end = 0, next(e for e in range(L + 1) if plain.fwd[d, b, e] >= plain.fwd[d, b, -1] / 2)
        x = plain.fwd[d, b, end] / plain.fwd[d, b, -1]
        assert model.forward_s(d, b, start, end) == pytest.approx(
            plain.forward_s(d, b, start, end) * float(extent_scale(x, 1.0, 0.8, 0.8)))
        assert model.backward_s(d, b, 5, 9) < plain.backward_s(d, b, 5, 9)
        assert model.compute_s(d, b, 2, 7, cold=False) == pytest.approx(
            model.forward_s(d, b, 2, 7) + model.backward_s(d, b, 2, 7))
        assert model.compute_s(d, 0, 2, 7) == 0.0 and model.compute_s(d, b, 4, 4) == 0.0
    # Arrays broadcast as before.
    devices, shares = np.array([[0, 1, 2]]), np.array([[0, 4, 8]])
    both = model.compute_s(devices, shares, 2, 9)
    assert both.shape == (1, 3) and both[0, 0] == 0.0
    assert both[0, 2] == pytest.approx(float(model.compute_s(2, 8, 2, 9)))


def test_a_profile_without_chain_factors_plans_as_before() -> None:
    plain = cluster()
    flat = chained(plain, 1.0, 1.0)
    assert plan_asteroid(flat, OPTIONS) == plan_asteroid(plain, OPTIONS)
    assert plan_dp(flat, OPTIONS) == plan_dp(plain, OPTIONS)
    assert plan_serving(flat, ServeOptions(micro_batch_size=8)) == plan_serving(plain, ServeOptions(micro_batch_size=8))


def test_cheaper_short_stages_make_the_pipelines_predictions_shorter_and_dp_the_same() -> None:
    plain = cluster()
    model = chained(plain)
    assert plan_dp(model, OPTIONS).round_latency_s == pytest.approx(plan_dp(plain, OPTIONS).round_latency_s)
    pipelined, flat = plan_asteroid(model, OPTIONS), plan_asteroid(plain, OPTIONS)
    assert pipelined.round_latency_s < flat.round_latency_s


def test_the_serving_costs_price_a_stage_by_its_extent() -> None:
    plain_cluster = cluster()
    plain, model = serve_costs(plain_cluster, 8), serve_costs(chained(plain_cluster), 8)
    L = plain.units
    for d in range(plain.n):
        assert model.compute_s(d, 0, L) == pytest.approx(plain.compute_s(d, 0, L))
        assert model.compute_s(d, 6, 7) == pytest.approx(plain.compute_s(d, 6, 7) / 1.25, rel=0.1)
        ends = np.arange(L + 1)
        assert model.units_s(d, 0, ends) == pytest.approx([model.compute_s(d, 0, e) if e else 0.0 for e in ends])
    # The exact search prices its stages as compute_s does: the plan's stage times are theirs.
    plan = plan_serving(chained(plain_cluster), ServeOptions(method="optimal", micro_batch_size=8))
    node = {n: i for i, n in enumerate(model.nodes)}
    for stage in plan.stages:
        assert stage.compute_s == pytest.approx(model.compute_s(node[stage.device], stage.start, stage.end))

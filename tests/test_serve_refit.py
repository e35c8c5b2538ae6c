"""Pipelined serving's closed loop in miniature (``planning.refit.ClosedLoop`` over ``planning.serve.refit``), as the
coordinator runs it: each served micro-batch reports every stage's forward and how its input arrived from the stage
before; a link slower than its profile is fitted from those arrivals and the stream moves off it, while noise alone
never moves it."""

from __future__ import annotations

import numpy as np
import pytest

from edgeswarm.planning.refit import ClosedLoop, RefitPricing, link_fit_inputs, link_key, moved_text, scaled
from edgeswarm.planning.serve.costs import serve_costs
from edgeswarm.planning.serve.plan import plan_serving
from edgeswarm.planning.serve.refit import predicted_compute_s, reprice
from edgeswarm.planning.serve.types import ServeOptions, ServePlan
from edgeswarm.planning.synthetic import SyntheticDevice, synthetic_cluster
from edgeswarm.values.profiles import ClusterProfile, LinkSample

GIB = 1 << 30
OPTIONS = ServeOptions(micro_batch_size=8)
CHUNK = 64 << 10  # the bus's chunk: an arrival counts the bytes after a tensor's first chunk
# a<->b and a<->c carry a fifth of what their profile says: every pipeline over all three devices crosses one
SLOW = {link_key("a", "b"): 5.0, link_key("a", "c"): 5.0}


def profiled() -> ClusterProfile:
    """Three alike devices on 40 MB/s links, a unit's forward about 10 ms: the profile's best plan is a pipeline over
    all three, each micro-batch's cut tensor taking about 13 ms to cross."""
    return synthetic_cluster(6, [SyntheticDevice(n, 1.0, 6 * GIB) for n in "abc"], bandwidth_bps=40e6,
                             shape="transformer", step_s=0.02)


def arrivals(plan: ServePlan, truth: ClusterProfile, noise: float, rng: np.random.Generator
             ) -> dict[str, list[LinkSample]]:
    """What each stage device of ``plan`` receives of one micro-batch from the stage before, as ``truth``'s links
    carry it (times seeded noise of +-``noise``)."""
    costs = serve_costs(truth, plan.micro_batch_size)
    index = {node: i for i, node in enumerate(costs.nodes)}
    out: dict[str, list[LinkSample]] = {}
    for before, stage in zip(plan.stages, plan.stages[1:], strict=False):
        nbytes = int(costs.cut_bytes[stage.start - 1])
        after_first = max(0, nbytes - CHUNK)
        seconds = after_first / costs.bw[index[before.device], index[stage.device]] * (1 + rng.uniform(-noise, noise))
        out[stage.device] = [LinkSample(src=before.device, bytes=after_first, chunks=-(-after_first // CHUNK),
                                        seconds=seconds)]
    return out


def serve(profile: ClusterProfile, truth: ClusterProfile, items: int, *, noise: float, seed: int = 0
          ) -> tuple[ServePlan, list[int], ClosedLoop[ServePlan, ClusterProfile]]:
    """The coordinator's loop over ``items`` micro-batches: plan on ``profile``; each item's stages compute and its
    tensors arrive as ``truth`` says (times seeded noise); between two items the job moves to the loop's better
    plan. Returns the final plan, the items after which it moved, and the loop."""
    rng = np.random.default_rng(seed)
    plan = plan_serving(profile, OPTIONS)
    loop: ClosedLoop[ServePlan, ClusterProfile] = ClosedLoop(
        RefitPricing(reprice, lambda _plan, refit: plan_serving(refit, OPTIONS), scaled),
        cost=lambda p: p.bottleneck_s)
    moves = []
    for item in range(items):
        true = predicted_compute_s(plan, truth)
        loop.add(predicted_compute_s(plan, profile), {n: s * (1 + rng.uniform(-noise, noise)) for n, s in true.items()},
                 link_fit_inputs(profile, arrivals(plan, truth, noise, rng)))
        found = loop.better(plan, profile, now=float(item))
        if found is not None:
            assert found[0].best is not None
            plan = found[0].best.model_copy(update={"epoch": plan.epoch + 1})
            moves.append(item)
            loop.new_plan()
    return plan, moves, loop


def test_a_link_five_times_slower_than_profiled_is_fitted_from_the_arrivals_and_the_stream_moves_off_it() -> None:
    profile = profiled()
    truth = scaled(profile, SLOW)
    wrong, right = plan_serving(profile, OPTIONS), plan_serving(truth, OPTIONS)
    assert "a" in wrong.devices and "a" not in right.devices, (wrong.stages, right.stages)
    assert reprice(right, truth).bottleneck_s < 0.5 * reprice(wrong, truth).bottleneck_s
    plan, moves, loop = serve(profile, truth, items=50, noise=0.05)
    # A link is fitted only once a plan crosses it: the first move leaves the slow link it measured and may cross the
    # other slow one, which the second move leaves. Then it stays.
    assert 1 <= len(moves) <= 2 and moves[-1] < 10, moves
    assert reprice(plan, truth).bottleneck_s == pytest.approx(reprice(right, truth).bottleneck_s, rel=0.03)
    # The links the wrong plan crossed are fitted about 5x; the devices, computing as profiled, did not move.
    scales = loop.scales()
    crossed = [link_key(x, y) for x, y in zip(wrong.devices, wrong.devices[1:], strict=False)]
    assert all(scales[k] == pytest.approx(5.0, rel=0.06) for k in crossed if k in SLOW), scales
    assert all(scales[n] == pytest.approx(1.0, rel=0.06) for n in "abc" if n in scales), scales
    assert moved_text(loop.link_fit.moved()).startswith("links measured against the profile: a<->"), scales
    # Refitted, the running plan's prediction is the truth's.
    refitted = reprice(plan, scaled(profile, scales)).bottleneck_s
    assert refitted == pytest.approx(reprice(plan, truth).bottleneck_s, rel=0.10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_links_and_devices_as_profiled_never_move_the_stream_on_noise(seed: int) -> None:
    profile = profiled()
    plan, moves, loop = serve(profile, profile, items=60, noise=0.12, seed=seed)
    assert moves == [] and plan.devices == plan_serving(profile, OPTIONS).devices
    assert loop.link_fit.scales(), "the pipeline's links were fitted"


def test_a_links_milliseconds_per_item_are_summed_until_they_say_something() -> None:
    """A served item's tensor takes a millisecond on a link: the loop sums its items until their prediction reaches
    MIN_LINK_S, then fits the sum as one sample."""
    from edgeswarm.planning.refit import MIN_LINK_S

    loop: ClosedLoop[ServePlan, ClusterProfile] = ClosedLoop(
        RefitPricing(reprice, lambda _plan, refit: plan_serving(refit, OPTIONS), scaled), cost=lambda p: p.bottleneck_s)
    key = link_key("a", "b")
    per_item = MIN_LINK_S / 5
    for item in range(4):
        loop.add({}, {}, ({key: per_item}, {key: 4 * per_item}))
        assert key not in loop.scales(), item
    loop.add({}, {}, ({key: per_item}, {key: 4 * per_item}))
    assert loop.scales()[key] == pytest.approx(4.0) and loop.rounds()[key] == 1

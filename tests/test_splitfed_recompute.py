"""The Memory Reducer's runtime (SmartSplit spec 6.3, U9): per-segment recomputation gives the no-recompute
gradients, holds less, stays within its bound and spends the extra layer forwards the paper counts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgeswarm.errors import ConfigError
from edgeswarm.models.zoo import example_input
from edgeswarm.splitfed.profiling import model_cost
from edgeswarm.splitfed.recompute import (
    RecomputeError,
    Segment,
    UnitChain,
    extra_forwards,
    find_segments,
    is_expensive,
    op_names,
)
from edgeswarm.splitfed.split import build_parts, split_point
from edgeswarm.values.profiles import ModelSpec

STRATEGIES = ("none", "speed", "memory")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), 1e-12)).item()


def _train(units: list[nn.Module], plan: list[str], x: torch.Tensor) -> tuple[UnitChain, int, list[torch.Tensor]]:
    """One forward and backward of ``units`` under ``plan``; the chain, the bytes it held after the forward (the
    persistent part: checkpoints and expensive units' inputs) and the parameter gradients."""
    chain = UnitChain(units, plan, input_grad=False)
    torch.manual_seed(1)  # dropout masks: the recomputation must replay them
    out = chain.forward(x)
    held = chain.held_bytes()
    chain.ledger.peak_bytes = 0  # the backward's own peak, from what the forward left held
    chain.ledger.sample()
    chain.backward(torch.ones_like(out))
    grads = [p.grad.clone() for u in units for p in u.parameters()]
    return chain, held, grads


def test_segments_are_the_runs_of_cheap_units_and_the_paper_counts_extra_forwards() -> None:
    assert find_segments([True, False, False, True, False]) == [Segment(1, 3), Segment(4, 5)]
    assert find_segments([False, True, True]) == [Segment(0, 1)]
    assert find_segments([True, True]) == []
    assert (extra_forwards("speed", 4), extra_forwards("memory", 4), extra_forwards("none", 4)) == (3, 6, 0)
    assert is_expensive(["conv2d", "batchnorm2d"]) and not is_expensive(["relu", "maxpool2d", "add"])


def test_a_four_unit_segment_recomputes_as_the_paper_says() -> None:
    torch.manual_seed(0)
    base = [nn.Linear(64, 4096), nn.ReLU(), nn.Dropout(0.5), nn.Tanh(), nn.Sigmoid(), nn.Linear(4096, 3)]
    x = torch.randn(16, 64)
    assert find_segments([is_expensive(op_names(u)) for u in base]) == [Segment(1, 5)]
    results = {s: _train(copy.deepcopy(base), [s], x) for s in STRATEGIES}
    for strategy in STRATEGIES:
        chain, held, grads = results[strategy]
        for got, want in zip(grads, results["none"][2], strict=True):
            assert _relative(got, want) <= 1e-6
        assert chain.stats.extra_forwards == [extra_forwards(strategy, 4)]  # 0, 3, 6
    assert results["speed"][0].stats.vjp_forwards == 1 and results["memory"][0].stats.vjp_forwards == 4
    peak = {s: results[s][0].ledger.peak_bytes for s in STRATEGIES}
    # Speed-centric holds the checkpoint (the Linear's output, which no unit saves without recomputation) and the
    # whole rebuilt segment at once: here, where the segment is the peak, more than no recomputation does.
    assert peak["memory"] < peak["none"] < peak["speed"]


def test_each_strategy_on_a_vgg_front_gives_the_same_gradients_within_its_bound() -> None:
    spec = ModelSpec(name="vgg11", config={"width": 0.25})
    batch, cut = 4, 15
    front = build_parts(spec, split_point(spec, cut), ("front",))["front"]  # training: BatchNorm updates its statistics
    cost = model_cost(spec, batch).units[:cut]
    segments = find_segments([u.expensive for u in cost])
    assert segments == find_segments([is_expensive(op_names(u)) for u in front.units])
    l_f, l_b = [u.out_bytes for u in cost], [u.backward_bytes for u in cost]
    l_peak = max(l_b)
    seg_cost = [sum(l_f[s.start:s.end]) + l_b[s.end - 1] for s in segments]
    # Algorithm 3 with theta = l_peak (the pure planner's decision, spelt out here)
    cost_aware = ["speed" if c <= l_peak else "memory" for c in seg_cost]
    assert set(cost_aware) == {"speed", "memory"}
    plans = {s: [s] * len(segments) for s in STRATEGIES} | {"cost": cost_aware}
    bound = {"speed": max(seg_cost), "memory": l_peak, "cost": l_peak}
    x = example_input(spec, batch)
    runs = {}
    for name, plan in plans.items():
        units = copy.deepcopy(front.units)
        runs[name] = (*_train(units, plan, x), [b.clone() for u in units for b in u.buffers()])
    none_chain, _, none_grads, none_buffers = runs["none"]
    for name, (chain, held, grads, buffers) in runs.items():
        for got, want in zip(grads, none_grads, strict=True):
            assert _relative(got, want) <= 1e-6, name
        for got, want in zip(buffers, none_buffers, strict=True):
            assert torch.equal(got, want), name  # running statistics updated once, not once per recomputation
        expected = [extra_forwards(s, seg.size) for s, seg in zip(plans[name], segments, strict=True)]
        assert chain.stats.extra_forwards == expected, name
        if name != "none":
            assert chain.ledger.peak_bytes < none_chain.ledger.peak_bytes, name
            assert chain.ledger.peak_bytes <= held + bound[name], name


def test_bad_plans_and_out_of_order_calls_are_refused() -> None:
    units = [nn.Linear(4, 4), nn.ReLU()]
    with pytest.raises(ConfigError):
        UnitChain(units, ["speed", "memory"])
    with pytest.raises(ConfigError):
        UnitChain(units, ["fast"])
    chain = UnitChain(units, ["memory"])
    with pytest.raises(RecomputeError):
        chain.backward(torch.ones(1, 4))
    chain.forward(torch.ones(2, 4))
    chain.reset()
    assert chain.held_bytes() == 0

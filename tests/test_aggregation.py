"""FedAvg, flat and hierarchical, and the refusal of bad updates (edgeswarm.aggregation; spec §8, U12)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeswarm.aggregation import (
    BadWeightError,
    FedAvg,
    NonFiniteUpdateError,
    PartialSum,
    State,
    UpdateMismatchError,
    UpdateRejectedError,
)
from edgeswarm.errors import ConfigError
from edgeswarm.models.zoo import build_model
from edgeswarm.values.profiles import ModelSpec


def fedavg(updates: list[tuple[State, float]], reference: State) -> dict[str, torch.Tensor]:
    """Flat FedAvg of ``updates`` ((state, n_i) pairs) of the model ``reference``, as a server aggregating its
    devices runs it."""
    agg = FedAvg(reference)
    for k, (state, weight) in enumerate(updates):
        agg.add(state, weight, who=f"update {k}")
    return agg.result()


def partial_sum(updates: list[tuple[State, float]], reference: State) -> PartialSum:
    """The PartialSum of ``updates`` an edge server sends (no updates give an empty partial)."""
    agg = FedAvg(reference)
    for k, (state, weight) in enumerate(updates):
        agg.add(state, weight, who=f"update {k}")
    return agg.partial()


def finish(partials: list[PartialSum], reference: State) -> dict[str, torch.Tensor]:
    """The server's step of hierarchical FedAvg: the weighted mean of the edge servers' ``partials``."""
    agg = FedAvg(reference)
    for k, partial in enumerate(partials):
        agg.merge(partial, who=f"partial sum {k}")
    return agg.result()


def _state(seed: int) -> dict[str, torch.Tensor]:
    """A small conv net with BatchNorm whose weights and running statistics differ per seed."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                              torch.nn.Linear(3 * 4 * 4, 5))
    net.train()
    for _ in range(seed % 3 + 1):  # a different num_batches_tracked per seed
        net(torch.randn(4, 1, 6, 6))
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_fedavg_of_identical_models_is_a_no_op() -> None:
    state = _state(0)
    mean = fedavg([(state, 3), (state, 50), (state, 7)], state)
    assert set(mean) == set(state)
    for name, value in mean.items():
        assert value.dtype == state[name].dtype
        torch.testing.assert_close(value, state[name], rtol=0, atol=1e-7)


def test_the_weights_follow_the_sample_counts() -> None:
    states = [_state(s) for s in range(4)]
    counts = [12, 250, 31, 7]
    mean = fedavg(list(zip(states, np.array(counts), strict=True)), states[0])  # numpy counts, as partitions give
    total = sum(counts)
    for name, value in mean.items():
        if value.is_floating_point():
            explicit = sum(s[name].double() * (n / total) for s, n in zip(states, counts, strict=True))
            torch.testing.assert_close(value.double(), explicit, rtol=0, atol=1e-6)
        else:  # num_batches_tracked: the device with the largest n_i
            assert torch.equal(value, states[1][name])
    # Not the plain mean: the counts matter.
    plain = sum(s["3.weight"] for s in states) / 4
    assert (mean["3.weight"] - plain).abs().max() > 1e-3


def test_batchnorm_running_statistics_are_averaged_like_parameters() -> None:
    a, b = _state(1), _state(2)
    mean = fedavg([(a, 1), (b, 3)], a)
    for name in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(mean[name], (a[name] + 3 * b[name]) / 4)


def test_hierarchical_equals_flat() -> None:
    states = [_state(s) for s in range(7)]
    counts = [40, 13, 99, 5, 61, 61, 2]
    flat = fedavg(list(zip(states, counts, strict=True)), states[0])
    # Three edge servers with 3, 2 and 2 devices, in device order; the server finishes.
    groups = [(0, 3), (3, 5), (5, 7)]
    partials = [partial_sum(list(zip(states[a:b], counts[a:b], strict=True)), states[0]) for a, b in groups]
    assert [p.count for p in partials] == [3, 2, 2] and sum(p.weight for p in partials) == sum(counts)
    hier = finish(partials, states[0])
    for name in flat:
        torch.testing.assert_close(hier[name], flat[name], rtol=0, atol=1e-7)
        assert hier[name].dtype == flat[name].dtype


def test_an_empty_edge_server_is_a_no_op_and_no_update_fails_the_round() -> None:
    state = _state(0)
    assert finish([PartialSum(), partial_sum([(state, 2)], state)], state)["3.bias"].equal(state["3.bias"])
    with pytest.raises(ConfigError, match="no update"):
        finish([PartialSum()], state)
    with pytest.raises(ConfigError, match="no update"):
        fedavg([], state)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_update_is_refused_and_the_round_goes_on(bad: float) -> None:
    good, other = _state(0), _state(1)
    poisoned = {k: v.clone() for k, v in other.items()}
    poisoned["0.weight"][0, 0, 1, 1] = bad
    agg = FedAvg(good)
    agg.add(good, 10, who="device 1")
    with pytest.raises(NonFiniteUpdateError, match="device 2: 0.weight holds NaN or infinite") as caught:
        agg.add(poisoned, 10, who="device 2")
    assert caught.value.reason == "non_finite" and isinstance(caught.value, UpdateRejectedError)
    agg.add(other, 30, who="device 3")
    assert agg.count == 2 and agg.weight == 40
    expected = fedavg([(good, 10), (other, 30)], good)
    for name, value in agg.result().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_updates_that_do_not_match_the_global_model_are_refused() -> None:
    state = _state(0)
    agg = FedAvg(state)
    missing = {k: v for k, v in state.items() if k != "3.bias"}
    with pytest.raises(UpdateMismatchError, match=r"missing \['3.bias'\]"):
        agg.add(missing, 1)
    wrong_shape = {**state, "3.bias": torch.zeros(6)}
    with pytest.raises(UpdateMismatchError, match=r"3.bias is \(6,\)"):
        agg.add(wrong_shape, 1)
    wrong_dtype = {**state, "3.bias": state["3.bias"].double()}
    with pytest.raises(UpdateMismatchError, match="float64"):
        agg.add(wrong_dtype, 1)
    for weight in (0, -3, float("nan"), float("inf"), True):
        with pytest.raises(BadWeightError):
            agg.add(state, weight)  # type: ignore[arg-type]
    assert agg.count == 0


def test_a_bad_partial_sum_is_refused() -> None:
    state = _state(0)
    good = partial_sum([(state, 4)], state)
    lying = PartialSum(sums=good.sums, weight=4.0, heaviest=9.0, count=1)
    with pytest.raises(BadWeightError, match="inconsistent"):
        finish([lying], state)
    poisoned = PartialSum(sums={**good.sums, "3.bias": torch.full_like(good.sums["3.bias"], float("nan"))},
                          weight=4.0, heaviest=4.0, count=1)
    with pytest.raises(NonFiniteUpdateError):
        finish([poisoned], state)
    single = PartialSum(sums={**good.sums, "3.bias": good.sums["3.bias"].float()}, weight=4.0, heaviest=4.0, count=1)
    with pytest.raises(UpdateMismatchError, match="float32"):
        finish([single], state)


def test_lenet5_states_average_on_the_compute_device() -> None:
    """A zoo model's state averages to the explicit mean, and the sums live where the reference does."""
    spec = ModelSpec(name="lenet5")
    a = build_model(spec).state_dict()
    b = {k: v + 0.5 for k, v in a.items()}
    mean = fedavg([(a, 1), (b, 1)], a)
    for name, value in mean.items():
        assert value.device == a[name].device
        torch.testing.assert_close(value, a[name] + 0.25)


def test_overflow_of_a_sum_is_not_mistaken_for_a_non_finite_update() -> None:
    """The fast finiteness check sums in float64; values whose float64 sum overflows are still finite."""
    big = {"w": torch.full((4,), 1e308, dtype=torch.float64)}
    agg = FedAvg(big)
    agg.add(big, 1)
    assert torch.equal(agg.result()["w"], big["w"])
    with pytest.raises(NonFiniteUpdateError):
        agg.add({"w": torch.tensor([1e308, 1e308, float("inf"), 1e308], dtype=torch.float64)}, 1)
    half = {"w": torch.full((3,), 60000.0, dtype=torch.float16)}
    FedAvg(half).add(half, 2)

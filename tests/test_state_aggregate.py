"""FedAvg's weighted mean of model states (edgeswarm.state.aggregate)."""

from __future__ import annotations

import pytest
import torch

from edgeswarm.errors import ConfigError
from edgeswarm.state.aggregate import weighted_mean


def _net(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net.train()
    net(torch.randn(5, 3))  # moves the running statistics and counts a batch
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_the_mean_weights_each_state_by_its_weight() -> None:
    states = [_net(0), _net(1), _net(2)]
    weights = [10.0, 30.0, 60.0]
    mean = weighted_mean(states, weights)
    for name, value in mean.items():
        if value.is_floating_point():
            expected = sum(s[name].double() * w for s, w in zip(states, weights, strict=True)) / 100.0
            torch.testing.assert_close(value, expected.float())
        else:
            assert torch.equal(value, states[2][name])  # the heaviest client's count


def test_one_state_is_itself_and_bfloat16_stays_bfloat16() -> None:
    state = {"w": torch.randn(6).to(torch.bfloat16)}
    assert torch.equal(weighted_mean([state], [1.0])["w"], state["w"])
    two = weighted_mean([state, {"w": torch.zeros(6, dtype=torch.bfloat16)}], [1.0, 1.0])["w"]
    assert two.dtype == torch.bfloat16 and torch.equal(two, (state["w"].double() / 2).to(torch.bfloat16))


@pytest.mark.parametrize(("states", "weights", "says"), [
    ([], [], "no states"),
    ([{"w": torch.ones(2)}], [1.0, 2.0], "one weight per state"),
    ([{"w": torch.ones(2)}, {"w": torch.ones(2)}], [0.0, 0.0], "not all zero"),
    ([{"w": torch.ones(2)}, {"v": torch.ones(2)}], [1.0, 1.0], "must match"),
    ([{"w": torch.ones(2)}, {"w": torch.ones(3)}], [1.0, 1.0], "state 1 has (3,)"),
])
def test_states_that_cannot_be_averaged_are_refused(states: list, weights: list, says: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        weighted_mean(states, weights)
